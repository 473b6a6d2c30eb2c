"""Scheduler on CPU without a model: token budget, chunked prefill, batch size, admission, preemption and
exact KV block ids through allocate, append, preempt, resume and free."""

import pytest

from colibri_stream.config import SchedulerConfig
from colibri_stream.errors import ConfigError, PromptTooLongError
from colibri_stream.kv_cache import KVCacheManager
from colibri_stream.request import Request, RequestStatus, SamplingParams
from colibri_stream.scheduler import Scheduler

EOS = 2


def make_scheduler(num_blocks=8, block_size=4, budget=16, batch=4, max_seq_len=16, prefix_caching=False):
    """Prefix caching is off by default here: these prompts all start with the same tokens, and the exact block ids
    below are those of the plain pool (test_prefix_cache.py covers the cache)."""
    config = SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=budget, max_seq_len=max_seq_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))


def add(scheduler, name, prompt_len, max_tokens=8, **params):
    request = Request(name, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                      eos_token_ids=frozenset({EOS}))
    scheduler.add_request(request)
    return request


def step(scheduler, token=7):
    """One schedule/update round; every sampling sequence samples `token`. Returns the schedule."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, [token] * sum(seq.sample for seq in out.seqs))
    return out


def plan(out):
    """{request_id: (number of tokens, start position, block table, samples)} of a schedule."""
    return {s.request.request_id: (len(s.token_ids), s.start_position, s.block_ids, s.sample) for s in out.seqs}


def test_exact_block_ids_through_allocate_append_preempt_resume_free():
    s = make_scheduler()
    a = add(s, "a", 6, max_tokens=6)
    b = add(s, "b", 5, max_tokens=10)
    c = add(s, "c", 7, max_tokens=4)

    # allocate: the budget of 16 covers a and b and the first 5 tokens of c's prompt
    assert plan(step(s)) == {"a": (6, 0, [0, 1], True), "b": (5, 0, [2, 3], True), "c": (5, 0, [4, 5], False)}
    assert plan(step(s)) == {"a": (1, 6, [0, 1], True), "b": (1, 5, [2, 3], True), "c": (2, 5, [4, 5], True)}
    assert plan(step(s)) == {"a": (1, 7, [0, 1], True), "b": (1, 6, [2, 3], True), "c": (1, 7, [4, 5], True)}
    # append: the ninth tokens of a and c open a third block each; the pool is then empty
    assert plan(step(s)) == {"a": (1, 8, [0, 1, 6], True), "b": (1, 7, [2, 3], True), "c": (1, 8, [4, 5, 7], True)}
    assert s.kv.num_free_blocks == 0

    # preempt: b needs a block, c (admitted last) gives back 4, 5, 7 and queues first with its 3 output tokens
    out = step(s)
    assert plan(out) == {"a": (1, 9, [0, 1, 6], True), "b": (1, 8, [2, 3, 4], True)}
    assert out.preempted == [c]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_output_tokens == 3
    assert list(s.waiting) == [c] and s.kv.block_ids(c.seq_id) == []

    # c needs 3 blocks for its 10 tokens and only 5, 7 are free: it waits; a reaches max_tokens and frees 0, 1, 6
    assert plan(step(s)) == {"a": (1, 10, [0, 1, 6], True), "b": (1, 9, [2, 3, 4], True)}
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 6
    assert s.kv.num_free_blocks == 5

    # resume: c recomputes prompt and output in one chunk on blocks 5, 7, 0 and samples its fourth token
    out = step(s)
    assert plan(out) == {"b": (1, 10, [2, 3, 4], True), "c": (10, 0, [5, 7, 0], True)}
    assert out.finished_seq_ids == [("a", 0)]
    assert out.seqs[1].token_ids == list(range(10, 17)) + [7, 7, 7]
    assert c.status is RequestStatus.FINISHED_LENGTH and c.num_output_tokens == 4

    # free: c's blocks went back behind 1 and 6, so b's fourth block is 1
    assert plan(step(s)) == {"b": (1, 11, [2, 3, 4], True)}
    assert plan(step(s)) == {"b": (1, 12, [2, 3, 4, 1], True)}
    step(s)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 10
    assert not s.has_unfinished() and s.kv.num_free_blocks == 8
    assert s.num_preemptions == 1


def test_long_prompt_is_chunked_and_decodes_keep_going():
    s = make_scheduler(num_blocks=16, budget=8, max_seq_len=32)
    d = add(s, "d", 3, max_tokens=10)
    step(s)  # d's prompt; d decodes from now on
    e = add(s, "e", 20)
    plans = [plan(step(s)) for _ in range(3)]
    assert [p["d"][:2] for p in plans] == [(1, 3), (1, 4), (1, 5)]
    assert [p["e"] for p in plans] == [(7, 0, [1, 2], False), (7, 7, [1, 2, 4, 5], False),
                                       (6, 14, [1, 2, 4, 5, 6], True)]
    assert s.kv.block_ids(d.seq_id) == [0, 3]  # d's fifth token took block 3 between e's chunks
    assert e.num_output_tokens == 1 and d.num_output_tokens == 4
    assert all(sum(n for n, *_ in p.values()) <= 8 for p in plans)


def test_max_batch_size_limits_running_sequences():
    s = make_scheduler(num_blocks=16, batch=2, max_seq_len=16)
    add(s, "a", 2, max_tokens=2)
    add(s, "b", 2, max_tokens=5)
    c = add(s, "c", 2, max_tokens=1)
    assert set(plan(step(s))) == {"a", "b"}
    assert set(plan(step(s))) == {"a", "b"}  # a finishes here
    assert c.status is RequestStatus.WAITING
    assert set(plan(step(s))) == {"b", "c"}
    assert s.num_running == 1  # c finished after its one token


def test_admission_rejects_prompts_over_max_seq_len():
    s = make_scheduler(max_seq_len=16)
    with pytest.raises(PromptTooLongError) as info:
        add(s, "a", 12, max_tokens=5)
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.max_seq_len) == (12, 5, 16)
    assert "12" in str(info.value) and "5" in str(info.value) and "16" in str(info.value)
    with pytest.raises(PromptTooLongError):
        add(s, "b", 16, max_tokens=None)
    assert add(s, "c", 10, max_tokens=None).max_tokens == 6  # until max_seq_len
    assert s.num_waiting == 1


def test_kv_cache_must_hold_one_full_sequence():
    with pytest.raises(ConfigError, match="max_seq_len"):
        make_scheduler(num_blocks=3, block_size=4, max_seq_len=16)


def test_stop_tokens_and_eos():
    s = make_scheduler()
    a = add(s, "a", 3)
    b = add(s, "b", 3, stop_token_ids=(9,))
    c = add(s, "c", 3, ignore_eos=True, max_tokens=2)
    out = s.schedule()
    updates = s.update_from_output(out, [EOS, 9, EOS])
    assert [(u.request.request_id, u.new_token_ids, u.finished) for u in updates] == [
        ("a", [EOS], True), ("b", [9], True), ("c", [EOS], False)]
    assert (a.status, a.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert (b.status, b.stop_reason) == (RequestStatus.FINISHED_STOPPED, 9)
    assert b.status.finish_reason == "stop" and c.status.finish_reason is None
    assert s.num_running == 1 and s.kv.block_ids(c.seq_id) == [2]


def test_finish_from_outside_frees_running_and_waiting():
    s = make_scheduler(batch=1)
    a = add(s, "a", 5)
    b = add(s, "b", 5)
    step(s)
    assert s.kv.block_ids(a.seq_id) == [0, 1]
    s.finish([a.seq_id, b.seq_id, ("gone", 0)], RequestStatus.FINISHED_ABORTED)
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()
    assert s.schedule().finished_seq_ids == [("a", 0), ("b", 0)]


def test_engine_options_take_cuda_graphs_as_a_boolean_and_the_cli_turns_it_off():
    from colibri_stream.cli import _engine_options, build_parser
    from colibri_stream.config import EngineConfig

    assert EngineConfig.from_options("m").cuda_graphs
    assert not EngineConfig.from_options("m", cuda_graphs=False).cuda_graphs
    with pytest.raises(ConfigError, match="cuda_graphs must be a boolean"):
        EngineConfig.from_options("m", cuda_graphs="no")
    assert _engine_options(build_parser().parse_args(["serve", "--no-cuda-graphs"]))["cuda_graphs"] is False
    assert "cuda_graphs" not in _engine_options(build_parser().parse_args(["serve"]))
    options = _engine_options(build_parser().parse_args(["serve", "--cpu-threads", "3"]))
    assert EngineConfig.from_options("m", **options).experts.cpu_threads == 3
    assert EngineConfig.from_options("m", prefetch=True).experts.prefetch
    with pytest.raises(ConfigError, match="prefetch must be a boolean"):
        EngineConfig.from_options("m", prefetch="yes")


def test_matmul_precision_is_medium_by_default_and_the_cli_sets_high():
    from colibri_stream.cli import _engine_options, build_parser
    from colibri_stream.config import EngineConfig
    from colibri_stream.loader import select_backend

    assert EngineConfig.from_options("m").matmul_precision == "medium"
    options = _engine_options(build_parser().parse_args(["serve", "--matmul-precision", "high"]))
    assert EngineConfig.from_options("m", **options).matmul_precision == "high"
    with pytest.raises(ConfigError, match="matmul_precision must be one of high, medium, got 'low'"):
        EngineConfig.from_options("m", matmul_precision="low")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--matmul-precision", "highest"])
    assert select_backend("cpu", matmul_precision="medium").name == "numpy"  # float32 at either precision
