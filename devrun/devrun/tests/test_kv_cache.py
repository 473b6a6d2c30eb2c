"""Block pool and KV cache manager: exact block ids through allocate, append, failure and free."""

import pytest

from colibri_stream.kv_cache import BlockPool, KVCacheManager


def test_pool_hands_out_from_the_front_and_takes_back_at_the_back():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1, 0])
    assert pool.num_free == 3
    assert pool.allocate(3) == [3, 1, 0]
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_allocate_append_and_free_exact_ids():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]  # 5 tokens: two blocks
    assert kv.allocate_slots("b", 4) == [2]
    assert kv.allocate_slots("a", 8) == []  # appending within the last block takes nothing
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.block_ids("a") == [0, 1, 3]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (4, 2)

    kv.free("a")
    assert kv.block_ids("a") == []
    assert kv.num_free_blocks == 5
    assert kv.allocate_slots("c", 12) == [4, 5, 0]  # the never-used blocks first, then the freed ones in order
    assert kv.allocate_slots("b", 12) == [1, 3]
    assert kv.block_ids("b") == [2, 1, 3]
    kv.free("missing")  # a sequence without blocks is ignored


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate_slots("a", 4) == [0, 1]
    assert kv.num_new_blocks("b", 3) == 2
    assert kv.allocate_slots("b", 3) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots("b", 2) == [2]


def test_blocks_for_rounds_up():
    kv = KVCacheManager(num_blocks=1, block_size=16)
    assert [kv.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
