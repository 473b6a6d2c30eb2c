"""Scheduling one step ahead (scheduler.schedule_next, ModelRunner.launch/collect) on the NumPy backend.

The NumPy runner computes a launched step at once, so these tests check the scheduling itself: a step scheduled
before the tokens of the one before it are known must give every request exactly what synchronous steps give,
including requests that stop (eos, stop token, stop string, max_tokens) or are aborted while a step for them is
already launched, and must leave no KV block held.
"""

from __future__ import annotations

import pytest

from colibri_stream.engine import EngineCore
from colibri_stream.request import Request, SamplingParams
from colibri_stream.scheduler import FED_TOKEN

ROOMY = dict(device="cpu", block_size=4, num_kv_blocks=96, max_seq_len=64, max_batch_size=8)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world", "streaming tokens one by one!",
         "Mixture of experts models route every token to a few experts."]


def engines(tiny_model_dir, **options):
    """The same engine twice: steps read before the next is scheduled, and steps scheduled one ahead."""
    sync = EngineCore.from_pretrained(str(tiny_model_dir), **{**ROOMY, **options}, async_scheduling=False)
    ahead = EngineCore.from_pretrained(str(tiny_model_dir), **{**ROOMY, **options}, async_scheduling=True)
    return sync, ahead


class LaunchCounter:
    """Counts the steps an engine's runner launched ahead (wraps `launch`)."""

    def __init__(self, core: EngineCore):
        self.count = 0
        self.steps = []  # the SchedulerOutputs launched
        launch = core.runner.launch

        def counted(step):
            launched = launch(step)
            if launched is not None:
                self.count += 1
                self.steps.append(step)
            return launched

        core.runner.launch = counted


def run_all(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]], abort_after: dict | None = None):
    """Add every request, step until done; (request_id, index) -> (token ids, text, finish_reason, stop_reason,
    completion_tokens). `abort_after`: request id -> abort it once it got that many tokens."""
    for request_id, (ids, params) in requests.items():
        core.add_request(request_id, ids, params)
    results: dict[tuple, list] = {}

    def record(outputs):
        for out in outputs:
            entry = results.setdefault((out.request_id, out.index), [[], "", None, None, 0])
            entry[0] += out.token_ids
            entry[1] += out.text
            entry[2:] = [out.finish_reason, out.stop_reason, out.completion_tokens]

    while core.has_unfinished():
        record(core.step())
        for request_id, count in (abort_after or {}).items():
            if len(results.get((request_id, 0), [[]])[0]) >= count:
                record(core.abort(request_id))
    assert core.kv.num_used_blocks == 0  # nothing held once every request finished
    return results


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    core = EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY)
    return [core.tokenizer.encode(text) for text in TEXTS]


def test_greedy_requests_of_different_lengths_match_synchronous_steps(tiny_model_dir, prompts):
    sync, ahead = engines(tiny_model_dir)
    counter = LaunchCounter(ahead)
    requests = {f"r{i}": (ids, SamplingParams(max_tokens=3 + 5 * i, temperature=0.0, ignore_eos=True))
                for i, ids in enumerate(prompts)}
    expected = run_all(sync, requests)
    assert run_all(ahead, requests) == expected
    assert [len(expected[(f"r{i}", 0)][0]) for i in range(4)] == [3, 8, 13, 18]
    assert counter.count >= 15  # the decode steps ran ahead (18 tokens, one prefill)
    # every launch but the first of a run was made before the step before it was read
    assert 0 < ahead.stats().num_steps_launched_ahead < counter.count
    assert sync.stats().num_steps_launched_ahead == 0


def test_stops_found_after_the_next_step_was_launched(tiny_model_dir, prompts):
    """Stop tokens and stop strings end a sequence while a step for it is already launched: its token from that
    step is dropped, and the text, finish reason and usage are what synchronous steps give."""
    sync, ahead = engines(tiny_model_dir)
    free = run_all(sync, {"g": (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))})
    tokens, text = free[("g", 0)][:2]
    stop_string = text[len(text) // 2:len(text) // 2 + 3]
    assert stop_string.strip()
    requests = {
        "token": (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(tokens[6],))),
        "string": (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop_string,))),
        "eos": (prompts[0], SamplingParams(max_tokens=20, temperature=0.0)),
        "long": (prompts[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
    }
    sync.eos_token_ids = ahead.eos_token_ids = frozenset({tokens[9]})
    counter = LaunchCounter(ahead)
    expected = run_all(sync, requests)
    got = run_all(ahead, requests)
    assert got == expected and counter.count >= 15
    assert expected[("token", 0)][2] == "stop" and expected[("token", 0)][0][-1] == tokens[6]
    assert expected[("string", 0)][3] == stop_string
    assert expected[("eos", 0)][2] == "stop" and len(expected[("eos", 0)][0]) < 20
    assert expected[("long", 0)][2] == "length"


def test_abort_while_a_step_is_launched(tiny_model_dir, prompts):
    sync, ahead = engines(tiny_model_dir)
    requests = {f"r{i}": (ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
                for i, ids in enumerate(prompts)}
    expected = run_all(sync, requests, abort_after={"r1": 5})
    got = run_all(ahead, requests, abort_after={"r1": 5})
    assert {key: value[0] for key, value in got.items() if key[0] != "r1"} == \
           {key: value[0] for key, value in expected.items() if key[0] != "r1"}
    assert 5 <= len(got[("r1", 0)][0]) < 16 and got[("r1", 0)][2] == "abort"


def test_sampled_requests_go_ahead_and_others_hold_the_batch_back(tiny_model_dir, prompts):
    """Seeded draws over the whole vocabulary go ahead with greedy ones (their uniforms drawn at launch, one a
    step); a step with a row that needs more (logprobs, top-p) is not launched ahead. Every request gets the tokens
    of synchronous steps."""
    sync, ahead = engines(tiny_model_dir)
    counter = LaunchCounter(ahead)
    requests = {
        "seeded": (prompts[0], SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, n=2)),
        "default": (prompts[3], SamplingParams(max_tokens=20, seed=5, ignore_eos=True)),  # temperature 1
        "logprobs": (prompts[1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)),
        "nucleus": (prompts[1], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)),
        "greedy": (prompts[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    }
    assert run_all(ahead, requests) == run_all(sync, requests)
    assert counter.count >= 10
    launched = {s.request.request_id for step in counter.steps for s in step.seqs}
    assert {"seeded", "default", "greedy"} <= launched and not {"logprobs", "nucleus"} & launched


def test_preemption_and_chunked_prefill_with_steps_launched_ahead(tiny_model_dir, prompts):
    """A tight KV cache and token budget: admissions, chunks and preemptions happen between steps launched
    ahead; every request gets the tokens of synchronous steps."""
    tight = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_batch_size=4)
    sync, ahead = engines(tiny_model_dir, **tight)
    counter = LaunchCounter(ahead)
    requests = {f"r{i}": (ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
                for i, ids in enumerate(prompts * 2)}
    expected = run_all(sync, requests)
    assert run_all(ahead, requests) == expected
    assert ahead.scheduler.num_preemptions > 0 and counter.count > 0


def test_schedule_next_feeds_each_sequence_its_row_and_admits_beside_them(tiny_model_dir, prompts):
    core = EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY, async_scheduling=False)
    scheduler = core.scheduler
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", prompts[i], params, frozenset()))
    prefill = scheduler.schedule()
    first = scheduler.schedule_next(prefill)  # the prompts' whole chunks sample: their first decodes follow
    assert [s.feed_row for s in first.seqs] == [0, 1, 2]
    assert [s.start_position for s in first.seqs] == [len(p) for p in prompts[:3]]
    scheduler.update_from_output(prefill, [7, 8, 9])
    ahead = scheduler.schedule_next(first)
    assert [s.feed_row for s in ahead.seqs] == [0, 1, 2]
    assert [s.token_ids for s in ahead.seqs] == [[FED_TOKEN]] * 3
    assert [s.start_position for s in ahead.seqs] == [len(p) + 1 for p in prompts[:3]]
    updates = scheduler.update_from_output(first, [1, 2, 3])
    assert [u.new_token_ids for u in updates] == [[1], [2], [3]]
    # max_tokens 3: the step launched ahead makes the third token, so nothing follows it
    assert scheduler.schedule_next(ahead) is None
    scheduler.update_from_output(ahead, [4, 5, 6])
    assert not scheduler.has_unfinished()
    outputs = [s.request.token_ids[len(p):] for s, p in zip(prefill.seqs, prompts)]
    assert outputs == [[7, 1, 4], [8, 2, 5], [9, 3, 6]]

    longer = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("a", prompts[0], longer, frozenset()))
    scheduler.update_from_output(scheduler.schedule(), [1])
    decode = scheduler.schedule()
    scheduler.add_request(Request("b", prompts[1], longer, frozenset()))
    assert scheduler.schedule_next(decode) is None  # "b" is to be admitted, and nothing says it may go ahead
    assert scheduler.schedule_next(decode, lambda request: request.request_id != "b") is None  # nor this
    mixed = scheduler.schedule_next(decode, lambda request: True)  # "a"'s fed token, then "b"'s prompt
    assert [(s.request.request_id, s.feed_row, len(s.token_ids), s.sample) for s in mixed.seqs] == \
           [("a", 0, 1, True), ("b", -1, len(prompts[1]), True)]
    assert mixed.num_batched_tokens == 1 + len(prompts[1]) and not scheduler.waiting
    scheduler.update_from_output(decode, [2])
    following = scheduler.schedule_next(mixed, lambda request: True)  # both decode, "b" from its prompt's end
    assert [(s.feed_row, s.start_position) for s in following.seqs] == [(0, len(prompts[0]) + 2),
                                                                        (1, len(prompts[1]))]


def test_schedule_next_admits_nothing_beside_no_decode(tiny_model_dir, prompts):
    """When every running sequence's token from the running step is its last, nothing decodes next: a waiting
    prompt is left for `schedule()` (a step of prompt chunks alone may sample nothing, and a launched step must)."""
    core = EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY, async_scheduling=False)
    scheduler = core.scheduler
    scheduler.add_request(Request("a", prompts[1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                  frozenset()))
    scheduler.update_from_output(scheduler.schedule(), [1])
    decode = scheduler.schedule()  # "a"'s second token, its last
    scheduler.add_request(Request("b", prompts[0], SamplingParams(max_tokens=8, temperature=0.0), frozenset()))
    assert scheduler.schedule_next(decode, lambda request: True, max_tokens=4) is None
    assert [r.request_id for r in scheduler.waiting] == ["b"] and scheduler.kv.block_ids(scheduler.waiting[0].seq_id) == []


def test_schedule_next_bounds_admissions_not_decodes(tiny_model_dir, prompts):
    """The token bound of a step launched ahead limits what it admits, not its decode tokens: more running
    sequences than the bound still decode ahead; a waiting prompt the bound leaves no room for, while the budget
    does, is left to `schedule()` (a None), never starved behind steps ahead."""
    core = EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY, async_scheduling=False)
    scheduler = core.scheduler
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", prompts[i], params, frozenset()))
    scheduler.update_from_output(scheduler.schedule(), [1, 2, 3])
    decode = scheduler.schedule()
    ahead = scheduler.schedule_next(decode, lambda request: True, max_tokens=2)
    assert [s.feed_row for s in ahead.seqs] == [0, 1, 2]  # three decodes over a bound of two
    scheduler.add_request(Request("w", prompts[3], params, frozenset()))
    assert scheduler.schedule_next(ahead, lambda request: True, max_tokens=2) is None
    assert [r.request_id for r in scheduler.waiting] == ["w"]
    assert scheduler.schedule_next(ahead, lambda request: True, max_tokens=5).seqs[-1].request.request_id == "w"


def test_schedule_next_takes_a_prompt_chunk_within_its_token_bound(tiny_model_dir, prompts):
    """A prompt longer than the bound left by the decodes is admitted as a first chunk; the step after it, its
    prompt going on, waits for known tokens."""
    core = EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY, async_scheduling=False)
    scheduler = core.scheduler
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("a", prompts[1], params, frozenset()))
    step = scheduler.schedule()
    scheduler.add_request(Request("b", prompts[0], params, frozenset()))
    mixed = scheduler.schedule_next(step, lambda request: True, max_tokens=5)
    assert [(s.request.request_id, len(s.token_ids), s.sample) for s in mixed.seqs] == [("a", 1, True),
                                                                                          ("b", 4, False)]
    assert scheduler.schedule_next(mixed, lambda request: True) is None


def test_async_scheduling_option_is_checked(tiny_model_dir):
    from colibri_stream.errors import ConfigError

    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY, async_scheduling="yes")
    assert not EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY).async_scheduling  # no graphs on the CPU


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_match_synchronous_steps(tiny_model_dir, prompts, seed):
    """Random mixes, added while others run: greedy requests of random lengths, some with stop ids or stop
    strings or n = 2, a few sampled ones, aborts at random steps, a tight KV cache. Steps launched ahead must give
    every request what synchronous steps give."""
    import random

    rng = random.Random(seed)
    tight = {"num_kv_blocks": 40, "max_num_batched_tokens": 24, "max_batch_size": 6}
    sync, ahead = engines(tiny_model_dir, **tight)
    counter = LaunchCounter(ahead)
    plan = []  # (step to add it at, request id, prompt, params, step to abort it at or None)
    for i in range(14):
        prompt = rng.choice(prompts)[: rng.randint(2, 12)]
        options = {"max_tokens": rng.randint(1, 20), "temperature": 0.0, "ignore_eos": rng.random() < 0.7}
        if rng.random() < 0.2:
            options["stop_token_ids"] = (rng.randrange(300),)
        if rng.random() < 0.2:
            options["stop"] = (rng.choice(["e", "a", "o", "th"]),)
        if rng.random() < 0.15:
            options["n"] = 2
        if rng.random() < 0.15:
            options.update(temperature=0.8, seed=rng.randrange(100))
        plan.append((rng.randint(0, 25), f"r{i}", prompt, SamplingParams(**options),
                     rng.randint(1, 12) if rng.random() < 0.25 and "n" not in options else None))
    aborts = {request_id: after for _, request_id, _, _, after in plan if after is not None}

    def run(core):
        """Requests join at their step; one with an abort (n = 1) is aborted once it got that many tokens (a step
        count would not do: a request added while a step runs ahead is admitted a step later)."""
        results, step = {}, 0

        def record(outputs):
            for out in outputs:
                entry = results.setdefault((out.request_id, out.index), [[], "", None])
                entry[0] += out.token_ids
                entry[1] += out.text
                entry[2] = out.finish_reason

        while step < 300 and (core.has_unfinished() or any(at >= step for at, *_ in plan)):
            for at, request_id, prompt, params, _ in plan:
                if at == step:
                    core.add_request(request_id, prompt, params)
            record(core.step())
            for request_id, after in aborts.items():
                got = results.get((request_id, 0), [[], "", None])
                if len(got[0]) >= after and got[2] is None:
                    record(core.abort(request_id))
            step += 1
        assert not core.has_unfinished() and core.kv.num_used_blocks == 0
        return results

    assert run(ahead) == run(sync)
    assert counter.count > 0
    # requests joined the batch in steps launched ahead, their prompts beside fed decode tokens
    assert any(len(s.token_ids) > 1 for step in counter.steps for s in step.seqs)
    assert any(s.feed_row >= 0 for step in counter.steps for s in step.seqs)
