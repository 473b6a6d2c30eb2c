"""The engine end to end on a tiny exported model: batching, preemption, abort, stop strings, seeds, asyncio."""

from __future__ import annotations

import asyncio
import threading
import contextlib

import pytest

from colibri_stream.async_engine import AsyncEngine
from colibri_stream.engine import EngineCore
from colibri_stream.errors import (EngineStepError, EngineStoppedError, InvalidParameterError, PromptTooLongError,
                                   QueueFullError)
from colibri_stream.request import Request, SamplingParams
from colibri_stream.runner import build_batch
from colibri_stream.scheduler import ScheduledSeq

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",
    "Mixture of experts models route every token to a few experts; the rest stay on the disk.",
    "你好，世界。",
    "streaming tokens one by one!",
]
# Small enough that five requests preempt one another and prompts are prefilled in chunks.
TIGHT = dict(device="cpu", block_size=4, num_kv_blocks=24, max_seq_len=64, max_num_batched_tokens=16,
             max_batch_size=4)
ROOMY = dict(device="cpu", block_size=4, num_kv_blocks=64, max_seq_len=64)


def run_all(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple, list[int]]:
    """Add every request, step until done; returns (request_id, index) -> generated token ids."""
    for request_id, (ids, params) in requests.items():
        core.add_request(request_id, ids, params)
    tokens: dict[tuple, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    return tokens


def run_alone(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple, list[int]]:
    tokens = {}
    for request_id, request in requests.items():
        tokens.update(run_all(core, {request_id: request}))
    return tokens


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    return EngineCore.from_pretrained(str(tiny_model_dir), **ROOMY)


@pytest.fixture(scope="module")
def prompts(roomy):
    return [roomy.tokenizer.encode(text) for text in TEXTS]


def test_build_batch_lays_sequences_end_to_end():
    params = SamplingParams()
    a, b = Request("a", [5, 6, 7, 8, 9], params), Request("b", [1, 2], params)
    batch = build_batch([ScheduledSeq(a, [8, 9], 3, [4, 2, 5], True), ScheduledSeq(b, [1, 2], 0, [7], False)], 2)
    assert batch.token_ids.tolist() == [8, 9, 1, 2]
    assert batch.positions.tolist() == [3, 4, 0, 1]
    assert batch.query_start.tolist() == [0, 2, 4]
    assert batch.context_lens.tolist() == [5, 2]
    assert batch.block_tables.tolist() == [[4, 2, 5], [7, 0, 0]]
    assert batch.slot_mapping.tolist() == [5, 10, 14, 15]  # block 2 row 1, block 5 row 0, block 7 rows 0 and 1
    assert batch.logits_indices.tolist() == [1]
    batch.validate(block_size=2, num_blocks=8)


def test_batched_greedy_with_preemption_equals_each_request_alone(tiny_model_dir, roomy, prompts):
    requests = {f"r{i}": (ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
                for i, ids in enumerate(prompts)}
    alone = run_alone(roomy, requests)
    tight = EngineCore.from_pretrained(str(tiny_model_dir), **TIGHT)
    batched = run_all(tight, requests)
    assert tight.stats().num_preemptions > 0
    assert batched == alone
    assert all(len(tokens) == 24 for tokens in batched.values())
    assert tight.stats().kv_blocks_used == 0


def test_seeded_sampling_reproduces_in_any_batch(tiny_model_dir, roomy, prompts):
    requests = {f"s{i}": (ids, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True,
                                               n=2 if i == 0 else 1))
                for i, ids in enumerate(prompts)}
    alone = run_alone(roomy, requests)
    assert alone == run_alone(roomy, requests)
    assert alone[("s0", 0)] != alone[("s0", 1)]  # the n sequences draw from different generators
    assert run_all(EngineCore.from_pretrained(str(tiny_model_dir), **TIGHT), requests) == alone


def test_abort_frees_blocks_at_once(roomy, prompts):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    roomy.add_request("keep", prompts[0], params)
    roomy.add_request("drop", prompts[2], params)
    with pytest.raises(ValueError, match="already running"):
        roomy.add_request("keep", prompts[1], params)
    for _ in range(3):
        roomy.step()
    used = roomy.stats().kv_blocks_used
    held = roomy.kv.block_ids(("drop", 0))
    assert len(held) == roomy.kv.blocks_for(len(prompts[2]) + 2)  # the third token is not in the cache yet
    outputs = roomy.abort("drop")
    assert [(o.request_id, o.finished, o.finish_reason, o.completion_tokens) for o in outputs] == [
        ("drop", True, "abort", 3)]
    assert roomy.stats().kv_blocks_used == used - len(held)
    assert roomy.abort("drop") == [] and roomy.abort("unknown") == []
    roomy.abort("keep")
    assert roomy.stats().kv_blocks_used == 0 and not roomy.has_unfinished()


def test_stop_strings_cut_the_text(roomy, prompts):
    full = run_text(roomy, prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    start = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])  # a stop string mid-text
    stop = full[start:start + 2]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=("never there", stop))
    roomy.add_request("stop", prompts[0], params)
    outputs = []
    while roomy.has_unfinished():
        outputs += roomy.step()
    assert "".join(o.text for o in outputs) == full[:full.find(stop)]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop)
    assert outputs[-1].completion_tokens < 40 and roomy.stats().kv_blocks_used == 0
    kept = run_text(roomy, prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,),
                                                      include_stop_str_in_output=True))
    assert kept == full[:full.find(stop) + len(stop)]  # vLLM's include_stop_str_in_output


def run_text(core: EngineCore, ids: list[int], params: SamplingParams) -> str:
    core.add_request("text", ids, params)
    text = ""
    while core.has_unfinished():
        text += "".join(out.text for out in core.step())
    return text


def test_stop_token_ids_finish(roomy, prompts):
    greedy = run_alone(roomy, {"g": (prompts[3], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True))})[("g", 0)]
    k = next(k for k in range(1, 8) if greedy[k] not in greedy[:k])  # a token that appears first at k
    roomy.add_request("t", prompts[3], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(greedy[k],)))
    outputs = []
    while roomy.has_unfinished():
        outputs += roomy.step()
    last = outputs[-1]
    assert (last.finish_reason, last.stop_reason, last.completion_tokens) == ("stop", greedy[k], k + 1)


def test_latencies_are_reported(roomy, prompts):
    roomy.add_request("t", prompts[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outputs = []
    while roomy.has_unfinished():
        outputs += roomy.step()
    assert outputs[0].time_to_first_token > 0 and outputs[0].inter_token_latencies == []
    assert all(o.time_to_first_token is None and len(o.inter_token_latencies) == 1 for o in outputs[1:])


# ---- asyncio --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_engine(tiny_model_dir):
    return AsyncEngine.from_pretrained(str(tiny_model_dir), **TIGHT)


def run_async(engine: AsyncEngine, body):
    async def main():
        async with engine:
            return await asyncio.wait_for(body(engine), timeout=60)
    return asyncio.run(main())


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_async_generate_streams_and_matches_the_core(async_engine, roomy, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def body(engine):
        results = await asyncio.gather(*(collect(engine, ids, params) for ids in prompts))
        chat = await collect(engine, [{"role": "user", "content": "Hello"}], params)
        return results, chat

    results, chat = run_async(async_engine, body)
    expected = run_alone(roomy, {str(i): (ids, params) for i, ids in enumerate(prompts)})
    assert [tokens for tokens, _ in results] == [expected[(str(i), 0)] for i in range(len(prompts))]
    assert all(last.finished and last.finish_reason == "length" and last.completion_tokens == 12
               for _, last in results)
    assert len(chat[0]) == 12 and chat[1].prompt_tokens > 3


async def collect(engine: AsyncEngine, prompt, params: SamplingParams):
    tokens, last = [], None
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
        last = out
    return tokens, last


def test_async_cancellation_and_aclose_free_blocks(async_engine, prompts):
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)

    async def body(engine):
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompts[2], params, request_id="cancel-me"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        assert engine.stats().kv_blocks_used > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_idle(engine)

        stream = engine.generate(prompts[0], params)
        out = await stream.__anext__()
        assert not out.finished
        await stream.aclose()
        await wait_idle(engine)

        stream = engine.generate(prompts[1], params, request_id="aborted")
        await stream.__anext__()
        await engine.abort("aborted")
        assert engine.stats().kv_blocks_used == 0
        rest = [out async for out in stream]
        return rest[-1]

    last = run_async(async_engine, body)
    assert last.finished and last.finish_reason == "abort"


def test_slow_consumer_gets_merged_deltas(async_engine, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

    async def body(engine):
        stream = engine.generate(prompts[0], params)
        first = await stream.__anext__()
        await wait_idle(engine)  # the request finishes while nobody reads
        rest = [out async for out in stream]
        return first, rest

    first, rest = run_async(async_engine, body)
    assert len(rest) == 1  # everything after the first read, in one delta
    merged, count = rest[0], 10 - len(first.token_ids)
    assert len(merged.token_ids) == count and len(merged.logprobs) == count
    assert len(merged.inter_token_latencies) == count and merged.time_to_first_token is None
    assert merged.finished and merged.completion_tokens == 10
    assert [lp[0] for lp in merged.logprobs] == merged.token_ids and all(len(lp[2]) == 1 for lp in merged.logprobs)


def test_async_validation_errors_come_before_the_first_output(async_engine, prompts):
    async def body(engine):
        errors = []
        for prompt, params in [("", SamplingParams()), ([], SamplingParams()),
                               (prompts[0], SamplingParams(max_tokens=64)), ([10**6], SamplingParams())]:
            with pytest.raises((InvalidParameterError, PromptTooLongError)) as info:
                await engine.generate(prompt, params).__anext__()
            errors.append(type(info.value).__name__)

        return errors

    errors = run_async(async_engine, body)
    assert errors == ["InvalidParameterError", "InvalidParameterError", "PromptTooLongError",
                      "InvalidParameterError"]


def test_stop_without_drain_aborts_and_refuses_new_requests(async_engine, prompts):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        await async_engine.start()
        stream = async_engine.generate(prompts[0], params)
        await stream.__anext__()
        await async_engine.stop(drain=False)
        rest = [out async for out in stream]
        with pytest.raises(EngineStoppedError):
            await async_engine.generate(prompts[0], params).__anext__()
        return rest[-1]

    last = asyncio.run(main())
    assert last.finish_reason == "abort"
    assert async_engine.stats().kv_blocks_used == 0


def test_n_sequences_stream_with_their_index(async_engine, prompts):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3, ignore_eos=True)

    async def body(engine):
        tokens: dict[int, list[int]] = {}
        async for out in engine.generate(prompts[4], params):
            tokens.setdefault(out.index, []).extend(out.token_ids)
        return tokens

    tokens = run_async(async_engine, body)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
    assert tokens == run_async(async_engine, body)


def test_uvloop_runs_the_engine(async_engine, prompts):
    from colibri_stream.async_engine import run

    async def main():
        async with async_engine:
            tokens, last = await collect(async_engine, prompts[0], SamplingParams(max_tokens=4, temperature=0.0,
                                                                                     ignore_eos=True))
            return type(asyncio.get_running_loop()).__module__, last.completion_tokens

    module, count = run(main())
    assert module.startswith("uvloop") and count == 4



def test_queue_full_is_refused(tiny_model_dir, prompts):
    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), **dict(TIGHT, max_batch_size=1, max_queue=2))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    short = prompts[1][:3]

    async def body(engine):
        streams = [engine.generate(short, params) for _ in range(3)]
        tasks = [asyncio.create_task(s.__anext__()) for s in streams]
        while engine.stats().num_waiting < 2:  # one runs, two wait
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFullError):
            await engine.generate(short, params).__anext__()
        for task, stream in zip(tasks, streams):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stream.aclose()
        await wait_idle(engine)

    run_async(engine, body)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir, prompts):
    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), **TIGHT)
    execute = engine._core.runner.execute

    def broken(step):
        raise RuntimeError("device lost")

    async def body(engine):
        engine._core.runner.execute = broken
        with pytest.raises(EngineStepError, match="device lost"):
            await collect(engine, prompts[0], SamplingParams())
        assert not engine.healthy
        engine._core.runner.execute = execute
        tokens, _ = await collect(engine, prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(tokens) == 4 and engine.healthy
        assert engine.stats().kv_blocks_used == 0  # the failed step's blocks were freed

    run_async(engine, body)


def test_more_sequences_than_the_engine_can_ever_hold_are_a_bad_request(tiny_model_dir, prompts):
    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), **dict(TIGHT, max_batch_size=2, max_queue=1))

    async def body(engine):
        with pytest.raises(InvalidParameterError, match="can never be admitted") as refused:
            await engine.generate(prompts[1][:3], SamplingParams(n=4, max_tokens=2)).__anext__()
        assert refused.value.param == "n"
        params = SamplingParams(n=3, max_tokens=2, ignore_eos=True)
        tokens, _ = await collect(engine, prompts[1][:3], params)  # two run, one waits
        assert len(tokens) == 6

    run_async(engine, body)


def test_long_prompts_are_tokenized_off_the_event_loop(tiny_model_dir):
    from colibri_stream.async_engine import ENCODE_INLINE_CHARS

    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), **ROOMY)
    text = "Mixture of experts " * (ENCODE_INLINE_CHARS // 10)
    messages = [{"role": "user", "content": text}]
    threads = []
    encode = engine._core.encode_prompt

    def recording(*args):
        threads.append(threading.current_thread())
        return encode(*args)

    async def body(engine):
        engine._core.encode_prompt = recording
        # counted whole (fit_context=False): longer than this engine's context of 64 tokens
        assert await engine.encode(text, fit_context=False) == encode(text, fit_context=False)
        assert await engine.encode(messages, fit_context=False) == encode(messages, fit_context=False)
        assert await engine.encode("short") == encode("short")
        assert threads[0] is not threading.main_thread() and threads[1] is not threading.main_thread()
        assert threads[2] is threading.main_thread()  # short prompts stay on the loop

    run_async(engine, body)


def test_min_tokens_holds_back_stop_and_end_tokens(roomy, prompts):
    """A stop token the greedy text reaches at its 4th token ends it there; with min_tokens 8 that token cannot be
    drawn before the 8th, and the text runs on."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = run_all(roomy, {"g": (prompts[0], greedy)})[("g", 0)]
    stop = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])
    at = first.index(stop)
    stopped = run_all(roomy, {"s": (prompts[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                                stop_token_ids=(stop,)))})[("s", 0)]
    assert stopped == first[: at + 1]
    held = run_all(roomy, {"m": (prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                             stop_token_ids=(stop,), min_tokens=at + 4))})[("m", 0)]
    assert held[:at] == first[:at] and stop not in held[: at + 4] and len(held) >= at + 4
    with pytest.raises(InvalidParameterError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_the_text_of_the_token_that_stops_a_sequence_is_left_out_unless_asked(roomy, prompts):
    """As vLLM: the end-of-sequence token or a stop token that ends the text is not part of it, special or not,
    unless include_stop_str_in_output; the tokens themselves are still reported."""
    eos = roomy.tokenizer.eos_token_ids[0]
    ending = dict(max_tokens=6, temperature=0.0, logit_bias=((eos, 100.0),), skip_special_tokens=False)
    assert run_text(roomy, prompts[0], SamplingParams(**ending)) == ""
    piece = roomy.tokenizer.decode([eos], skip_special_tokens=False)
    assert run_text(roomy, prompts[0], SamplingParams(**ending, include_stop_str_in_output=True)) == piece
    full_ids = run_all(roomy, {"f": (prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))})
    first = full_ids[("f", 0)]
    at = next(i for i, t in enumerate(first) if i >= 2 and t not in first[:i])
    params = dict(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(first[at],))
    cut = run_text(roomy, prompts[0], SamplingParams(**params))
    kept = run_text(roomy, prompts[0], SamplingParams(**params, include_stop_str_in_output=True))
    assert cut == roomy.tokenizer.decode(first[:at]) and kept == roomy.tokenizer.decode(first[:at + 1])
    assert run_all(roomy, {"s": (prompts[0], SamplingParams(**params))})[("s", 0)] == first[:at + 1]


def test_special_tokens_in_the_text_when_asked(roomy, prompts):
    """skip_special_tokens false (vLLM's): the end-of-sequence token's text is part of the output text."""
    eos = roomy.tokenizer.eos_token_ids[0]
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((eos, 100.0),))
    skipped = run_text(roomy, prompts[0], SamplingParams(**params))
    kept = run_text(roomy, prompts[0], SamplingParams(**params, skip_special_tokens=False))
    piece = roomy.tokenizer.decode([eos], skip_special_tokens=False)
    assert piece and skipped == "" and kept == piece * 6
