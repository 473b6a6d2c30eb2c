"""Prefix caching in the KV block manager and the scheduler, without a model: exact keys, matching and its limit,
reference counts, LRU eviction, never-cached blocks first, no capacity lost, n > 1 siblings."""

from colibri_stream.config import SchedulerConfig
from colibri_stream.kv_cache import KVCacheManager
from colibri_stream.request import Request, SamplingParams
from colibri_stream.scheduler import Scheduler

BS = 4


def computed(kv: KVCacheManager, seq, tokens: list[int], prefix=None) -> list[int]:
    """Allocate `seq` for `tokens` (after a cached prefix), then register its KV as computed; returns its table."""
    assert kv.allocate_slots(seq, len(tokens), prefix) is not None
    kv.cache_blocks(seq, tokens, len(tokens))
    return kv.block_ids(seq)


def test_match_takes_the_longest_cached_run_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(100, 112))  # three full blocks
    table = computed(kv, "a", tokens)
    assert kv.num_cached_blocks == 3
    # the same 12 tokens: the third block holds the last token, which must be computed for the logits
    assert kv.find_cached_prefix(tokens).block_ids == table[:2]
    assert kv.find_cached_prefix(tokens + [7]).block_ids == table  # 13 tokens: (13 - 1) // 4 = 3 blocks
    assert kv.find_cached_prefix(tokens[:4] + [0, 0, 0, 0, 1]).block_ids == table[:1]  # diverges in block 1
    assert kv.find_cached_prefix(tokens[:4]).block_ids == []  # one block: its last token is computed
    assert kv.find_cached_prefix(tokens[:5]).block_ids == table[:1]


def test_keys_are_exact_chains_not_block_contents():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared = [5, 6, 7, 8]
    computed(kv, "a", [1, 2, 3, 4] + shared)
    # block 1 holds the same tokens, after a different block 0: nothing matches, not even block 1 alone
    assert kv.find_cached_prefix([9, 9, 9, 9] + shared + [0]).block_ids == []
    # and block 0 of a's content at position 1 is no match for a sequence starting with it at position 0
    assert kv.find_cached_prefix(shared + [0]).block_ids == []
    # a second sequence with the other prefix gets its own entries for the same block tokens
    computed(kv, "b", [9, 9, 9, 9] + shared)
    assert kv.num_cached_blocks == 4
    assert kv.find_cached_prefix([9, 9, 9, 9] + shared + [0]).block_ids == kv.block_ids("b")


def test_only_full_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    assert kv.allocate_slots("a", 10) == [0, 1, 2]
    kv.cache_blocks("a", tokens, 3)  # three tokens computed: no full block
    assert kv.num_cached_blocks == 0
    kv.cache_blocks("a", tokens, 9)  # blocks 0 and 1 full, block 2 holds one token
    assert kv.num_cached_blocks == 2
    assert kv.find_cached_prefix(tokens + [1]).block_ids == [0, 1]


def test_shared_blocks_are_reference_counted_and_free_with_the_last_holder():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(8))
    computed(kv, "a", tokens)  # blocks 0, 1
    prefix = kv.find_cached_prefix(tokens + [50])
    assert kv.allocate_slots("b", 9, prefix) == [2]  # only the block of its last token is new
    assert kv.block_ids("b") == [0, 1, 2]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    assert kv.num_used_blocks == 3
    kv.free("a")
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 3
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 6  # cached blocks nobody holds count as free
    assert kv.num_cached_blocks == 2  # and keep their entries until they are needed
    assert kv.find_cached_prefix(tokens + [50]).block_ids == [0, 1]


def test_never_cached_blocks_go_first_then_least_recently_used_cached():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    computed(kv, "a", list(range(0, 8)))  # blocks 0, 1 cached
    computed(kv, "b", list(range(20, 28)))  # blocks 2, 3 cached
    kv.free("a")
    kv.free("b")  # freed after a: more recently used
    # blocks 4, 5 were never cached: they go first, then a's blocks (tail first), then b's
    assert kv.allocate_slots("c", 4 * BS) == [4, 5, 1, 0]
    assert kv.num_cached_blocks == 2  # a's entries were dropped with its blocks
    assert kv.find_cached_prefix(list(range(0, 8)) + [1]).block_ids == []
    assert kv.find_cached_prefix(list(range(20, 28)) + [1]).block_ids == [2, 3]
    assert kv.allocate_slots("d", 1) == [3]  # b's tail before its head
    assert kv.find_cached_prefix(list(range(20, 28)) + [1]).block_ids == [2]


def test_reusing_a_cached_block_makes_it_recently_used():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    computed(kv, "a", list(range(0, 8)))
    computed(kv, "b", list(range(20, 28)))
    kv.free("a")
    kv.free("b")  # LRU order: 1, 0, 3, 2
    assert kv.allocate_slots("c", 5, kv.find_cached_prefix(list(range(0, 5)))) == [1]  # takes 0, evicts 1
    kv.free("c")  # 0 is now the most recently used; 1 (one token, never full) is free and uncached
    assert kv.allocate_slots("d", 3 * BS) == [1, 3, 2]
    assert kv.find_cached_prefix(list(range(0, 5))).block_ids == [0]
    assert kv.find_cached_prefix(list(range(20, 25))).block_ids == []


def test_caching_costs_no_capacity_and_allocation_stays_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    computed(kv, "a", list(range(16)))
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 4
    assert kv.allocate_slots("b", 17) is None  # five blocks: refused, nothing taken or evicted
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == 4
    assert sorted(kv.allocate_slots("b", 16)) == [0, 1, 2, 3]  # every cached block can be taken back
    assert kv.num_cached_blocks == 0


def test_a_cached_prefix_counts_against_free_blocks_only_when_nobody_holds_it():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = list(range(8))
    computed(kv, "a", tokens)
    kv.free("a")
    assert kv.allocate_slots("x", 2 * BS) == [2, 3]  # the two never-cached blocks
    prefix = kv.find_cached_prefix(tokens + [1, 2, 3, 4, 5])  # blocks 0, 1, free but cached
    assert kv.allocate_slots("b", 13, prefix) is None  # needs 0, 1 and two more: only 0, 1 are free
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 8 + 1, kv.find_cached_prefix(tokens + [1])) is None  # 0, 1 and one more
    kv.free("x")
    assert kv.allocate_slots("b", 9, kv.find_cached_prefix(tokens + [1])) == [2]  # the prefix was not evicted
    assert kv.block_ids("b") == [0, 1, 2]


def test_a_block_computed_twice_stays_uncached_the_second_time():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(8))
    assert kv.allocate_slots("a", 8) == [0, 1]
    assert kv.allocate_slots("b", 8) == [2, 3]  # admitted before a's KV was computed
    kv.cache_blocks("a", tokens, 8)
    kv.cache_blocks("b", tokens, 8)
    assert kv.num_cached_blocks == 2
    kv.free("a")
    kv.free("b")
    assert kv.find_cached_prefix(tokens + [1]).block_ids == [0, 1]
    assert kv.allocate_slots("c", 2 * BS) == [4, 5]
    assert kv.allocate_slots("d", 2 * BS) == [2, 3]  # b's blocks were never cached: before the cached 0, 1


def test_disabled_caches_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    computed(kv, "a", list(range(8)))
    assert kv.num_cached_blocks == 0 and kv.find_cached_prefix(list(range(9))).block_ids == []


# ---------------------------------------------------------------------------------------------------- scheduler

def scheduler(num_blocks=16, budget=64, prefix_caching=True) -> Scheduler:
    config = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=budget, max_seq_len=32)
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update_from_output(out, [token] * sum(seq.sample for seq in out.seqs))
    return out


def test_a_resent_prompt_computes_from_its_last_partial_block():
    s = scheduler()
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks and 2 tokens
    a = Request("a", prompt, SamplingParams(max_tokens=1))
    s.add_request(a)
    assert step(s).num_batched_tokens == 14
    assert not s.has_unfinished()
    b = Request("b", prompt, SamplingParams(max_tokens=1))
    s.add_request(b)
    out = step(s)
    assert [(len(x.token_ids), x.start_position) for x in out.seqs] == [(2, 12)]
    assert b.num_cached_tokens == 12
    assert (s.num_cached_prefill_tokens, s.num_computed_prefill_tokens) == (12, 16)


def test_n_siblings_wait_for_the_first_to_compute_the_prompt_then_share_it():
    s = scheduler()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    params = SamplingParams(max_tokens=3, n=3)
    seqs = [Request("r", prompt, params, index=i) for i in range(3)]
    for seq in seqs:
        s.add_request(seq)
    first = step(s)
    assert [(x.request.index, len(x.token_ids)) for x in first.seqs] == [(0, 10)]
    second = step(s)
    assert [(x.request.index, len(x.token_ids), x.start_position) for x in second.seqs] == \
        [(0, 1, 10), (1, 2, 8), (2, 2, 8)]
    tables = [x.block_ids for x in second.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert [seq.num_cached_tokens for seq in seqs] == [0, 8, 8]


def test_without_prefix_caching_siblings_are_admitted_together():
    s = scheduler(prefix_caching=False)
    for i in range(2):
        s.add_request(Request("r", list(range(100, 110)), SamplingParams(max_tokens=3, n=2), index=i))
    assert [len(x.token_ids) for x in step(s).seqs] == [10, 10]
