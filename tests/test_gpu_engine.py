"""The engine's decode steps as CUDA graphs (cuda_graph.DecodeGraphs) against eager steps (CUDA GPU).

Both run the same kernels (a captured step computes every projection with linear_rows, as the eager step does up
to SMALL_BATCH tokens), so at up to four sequences greedy and seeded sampled tokens are identical; a batch of five
is padded into the bucket of eight and compared by logits.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.cuda_graph import DecodeGraphs, is_decode  # noqa: E402
from colibri_stream.llm import LLM  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from colibri_stream.batch import flat_batch  # noqa: E402
from colibri_stream.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = ["Mixture of experts", "The quick brown fox", "你好"]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16, temperature=0),
                                    SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)])
def test_engine_decode_graphs_give_the_eager_tokens(tiny_model_dir, params):
    graphs = LLM(str(tiny_model_dir), device="cuda")
    assert graphs.engine.runner.graphs is not None
    eager = LLM(str(tiny_model_dir), device="cuda")
    eager.engine.runner.graphs = None
    assert ([r.token_ids for r in graphs.generate(PROMPTS, params)]
            == [r.token_ids for r in eager.generate(PROMPTS, params)])
    assert graphs.engine.runner.graphs._graphs  # decode steps ran as graphs


def test_a_padded_decode_batch_gives_the_eager_logits(tiny_model_dir):
    model = load_model(str(tiny_model_dir), device="cuda")
    block, per_seq, b = 4, 4, 5
    kv = model.allocate_kv_cache(b * per_seq, block, "fp32")  # the 1e-4 below is float32's
    tables = np.arange(b * per_seq).reshape(b, per_seq).tolist()
    prompts = np.random.default_rng(0).integers(3, model.config.vocab_size, (b, 6)).tolist()
    first = model.forward(flat_batch(prompts, [0] * b, tables, [True] * b, block), kv)  # [b, V] prefill
    step = flat_batch([[int(t)] for t in first.argmax(axis=1)], [6] * b, tables, [True] * b, block)
    assert is_decode(step)
    graphs = DecodeGraphs(model, kv, per_seq, max_batch_size=32)
    assert graphs.fits(step)
    from_graph = graphs.logits(step)  # [5, V] from the bucket of 8
    eager = model.forward(step, kv)  # rewrites the same KV slots with the same values
    assert from_graph.shape == eager.shape
    assert np.abs(from_graph - eager).max() <= 1e-4 * np.abs(eager).max()
    assert not graphs.fits(flat_batch(prompts, [0] * b, tables, [True] * b, block))  # a prefill is not decode


def test_prefix_caching_on_the_gpu_gives_the_uncached_tokens():
    """The CPU test's workload (test_prefix_cache_engine.py: shared system prompts, repeats, second turns, under
    preemption) on the GPU. A cached prefix's blocks are read by a prefill chunk that starts after them, the
    kernels of chunked prefill. Greedy tokens equal with and without the cache; a difference is either a bug or a
    near-tie decided by float32 rounding (prefills of different lengths reduce in a different order): compare the
    logits to tell."""
    from test_prefix_cache_engine import TIGHT, workload

    from colibri_stream.engine import EngineCore

    options = {**TIGHT, "device": "cuda", "matmul_precision": "high"}  # chunks of other lengths round alike
    cached = EngineCore.from_pretrained(None, enable_prefix_caching=True, **options)
    plain = EngineCore.from_pretrained(None, enable_prefix_caching=False, **options)
    assert workload(cached) == workload(plain)
    assert cached.stats().prefix_cache_hit_tokens > 0 and cached.stats().num_preemptions > 0


def test_steps_launched_ahead_give_the_synchronous_tokens(tiny_model_dir):
    """Decode steps launched before the host read the step before (their tokens taken on the device: argmaxes, and
    seeded draws over the whole vocabulary made in the graph) give what steps read one by one give, while requests
    finish (max_tokens, stop strings, stop tokens) and the batch moves to smaller buckets with a step in flight."""
    ahead = LLM(str(tiny_model_dir), device="cuda")
    assert ahead.engine.async_scheduling  # the default where decode steps are graphs
    launches = []
    launch = ahead.engine.runner.launch
    ahead.engine.runner.launch = lambda step: launches.append(launch(step)) or launches[-1]
    sync = LLM(str(tiny_model_dir), device="cuda", async_scheduling=False)
    texts = PROMPTS + ["streaming tokens one by one!", "Hello world"]
    free = sync.generate(texts[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    prompts_params = [(text, SamplingParams(max_tokens=4 + 5 * i, temperature=0, ignore_eos=True))
                      for i, text in enumerate(texts)]
    prompts_params += [(texts[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(free.token_ids[7],))),
                       (texts[0], SamplingParams(max_tokens=24, temperature=0, stop=(free.text[10:13],))),
                       (texts[1], SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)),
                       (texts[3], SamplingParams(max_tokens=14, temperature=0.6, seed=12, ignore_eos=True))]

    def run(llm):
        for i, (text, params) in enumerate(prompts_params):
            llm.engine.add_request(str(i), llm.engine.encode_prompt(text), params)
        outputs = {}  # request id -> [token ids, text, finish reason]
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                entry = outputs.setdefault(out.request_id, [[], "", None])
                entry[0] += out.token_ids
                entry[1] += out.text
                entry[2] = out.finish_reason
        assert llm.engine.kv.num_used_blocks == 0
        return outputs

    expected = run(sync)
    assert run(ahead) == expected
    assert sum(launched is not None for launched in launches) >= 15
    assert len(ahead.engine.runner.graphs._graphs) >= 3  # buckets 8, 4, 2 or 1 captured between launches


def test_requests_joining_a_running_batch_are_launched_ahead_with_it(tiny_model_dir):
    """Requests added while others decode are admitted in steps launched ahead (their prompts computed eagerly on
    the graphs' stream beside decode tokens fed from the step before, cuda_graph.DecodeGraphs.launch_eager), and
    every request gets the tokens of synchronous steps: greedy and seeded draws, prompts of several lengths."""
    ahead = LLM(str(tiny_model_dir), device="cuda")
    launches = []
    launch = ahead.engine.runner.launch
    ahead.engine.runner.launch = lambda step: launches.append((step, launch(step))) or launches[-1][1]
    sync = LLM(str(tiny_model_dir), device="cuda", async_scheduling=False)
    texts = PROMPTS + ["streaming tokens one by one!", "Hello world", "A longer prompt of several words " * 4]
    arrivals = [(2 * i, texts[i % len(texts)],
                 SamplingParams(max_tokens=6 + 3 * i, temperature=0.7 if i % 3 == 2 else 0, seed=i, ignore_eos=True))
                for i in range(9)]

    def run(llm):
        outputs, step = {}, 0  # request id -> [token ids, text]
        while llm.engine.has_unfinished() or step <= arrivals[-1][0]:
            for at, (when, text, params) in enumerate(arrivals):
                if when == step:
                    llm.engine.add_request(str(at), llm.engine.encode_prompt(text), params)
            for out in llm.engine.step():
                entry = outputs.setdefault(out.request_id, [[], ""])
                entry[0] += out.token_ids
                entry[1] += out.text
            step += 1
        assert llm.engine.kv.num_used_blocks == 0
        return outputs

    assert run(ahead) == run(sync)
    mixed = [step for step, launched in launches if launched is not None
             and any(len(s.token_ids) > 1 for s in step.seqs) and any(s.feed_row >= 0 for s in step.seqs)]
    assert len(mixed) >= 3


def test_a_step_takes_its_tokens_from_the_step_before_on_the_device(tiny_model_dir):
    """DecodeGraphs.launch with feed rows: five sequences, then three of them in another order (a smaller
    bucket), each step launched before the previous one's ids are read, give the ids of synchronous steps."""
    model = load_model(str(tiny_model_dir), device="cuda")
    block, per_seq, b = 4, 4, 5
    kv = model.allocate_kv_cache(b * per_seq, block)
    tables = np.arange(b * per_seq).reshape(b, per_seq).tolist()
    prompts = np.random.default_rng(1).integers(3, model.config.vocab_size, (b, 6)).tolist()
    first = model.forward(flat_batch(prompts, [0] * b, tables, [True] * b, block), kv).argmax(axis=1)  # [b]
    graphs = DecodeGraphs(model, kv, per_seq, max_batch_size=8)
    order = [3, 0, 4]

    def steps(ahead: bool) -> list[np.ndarray]:
        one = flat_batch([[int(t)] for t in first], [6] * b, tables, [True] * b, block)
        if not ahead:
            ids_one = graphs.launch(one, np.full(b, -1, np.int64)).wait()
            two = flat_batch([[int(ids_one[s])] for s in order], [7] * 3, [tables[s] for s in order], [True] * 3, block)
            return [ids_one, graphs.launch(two, np.full(3, -1, np.int64)).wait()]
        pending_one = graphs.launch(one, np.full(b, -1, np.int64))
        two = flat_batch([[-1]] * 3, [7] * 3, [tables[s] for s in order], [True] * 3, block)
        pending_two = graphs.launch(two, np.array(order, np.int64))
        return [pending_one.wait(), pending_two.wait()]

    synchronous = steps(ahead=False)
    graphs._graph(flat_batch([[1]] * 3, [7] * 3, tables[:3], [True] * 3, block))  # both buckets captured
    launched = steps(ahead=True)
    assert all(np.array_equal(a, s) for a, s in zip(launched, synchronous))
    assert len(graphs._graphs) == 2


def test_the_server_streams_on_the_gpu_with_steps_launched_ahead(tiny_model_dir):
    """`colibri serve` on the GPU as shipped (decode graphs, async scheduling): concurrent streamed chat completions
    through the openai client, one of them dropped mid-stream (its sequence aborted while a step for it may be in
    flight), give what the same server with async scheduling off gives; the server goes on serving."""
    import asyncio

    import openai
    from test_server import LiveServer

    from colibri_stream.server.state import STATE

    messages = [[{"role": "user", "content": text}] for text in PROMPTS + ["streaming tokens one by one!"]]

    async def ask(live: LiveServer) -> list:
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def stream(chat: list, max_tokens: int) -> tuple[str, str]:
            chunks = await client.chat.completions.create(model="tiny-mixtral", messages=chat, stream=True,
                                                          temperature=0, max_tokens=max_tokens)
            text, reason = "", None
            async for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    reason = chunk.choices[0].finish_reason or reason
            return text, reason

        async def dropped(chat: list) -> None:
            chunks = await client.chat.completions.create(model="tiny-mixtral", messages=chat, stream=True,
                                                          temperature=0, max_tokens=40)
            async for _ in chunks:
                break
            await chunks.close()

        results = await asyncio.gather(dropped(messages[0]),
                                       *(stream(chat, 8 + 6 * i) for i, chat in enumerate(messages)))
        again = await stream(messages[1], 12)  # served after the drop
        return [*results[1:], again]

    answers = {}
    for name, options in {"ahead": {}, "sync": {"async_scheduling": False}}.items():
        live = LiveServer(tiny_model_dir, {"max_batch_size": 8, "device": "cuda", "engine_process": False, **options})
        try:
            assert live.app[STATE].engine._core.async_scheduling == (name == "ahead")
            answers[name] = asyncio.run(ask(live))
        finally:
            live.close()
    assert answers["ahead"] == answers["sync"]
    assert all(reason in ("length", "stop") for _, reason in answers["ahead"])
    assert sum(bool(text) for text, _ in answers["ahead"]) >= 3


def test_prompt_logprobs_on_the_gpu_match_the_numpy_engine(tiny_model_dir):
    """Prompt positions' logits come back beside the sampling rows of an eager step; the decode graphs still run
    the later steps; the logprobs match the NumPy backend's (within float32 rounding: float32 KV caches)."""
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=3, logprobs=1)
    gpu = LLM(str(tiny_model_dir), device="cuda", kv_cache_dtype="fp32", matmul_precision="high")
    cpu = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="fp32")
    ours, theirs = gpu.generate(PROMPTS, params), cpu.generate(PROMPTS, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids) - 1
        np.testing.assert_allclose([lp for _, lp, _ in a.prompt_logprobs], [lp for _, lp, _ in b.prompt_logprobs],
                                   atol=1e-4)
    assert gpu.engine.runner.graphs._graphs  # the decode steps after the prompt ran as graphs


def test_structured_output_on_the_gpu_follows_the_schema_as_on_the_cpu(tiny_model_dir):
    """Constrained rows are sampled on the host from rows the GPU copies back; greedy, they give the CPU's text."""
    import json

    from colibri_stream.structured import json_schema_grammar

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, grammar=json_schema_grammar(schema))
    gpu, cpu = LLM(str(tiny_model_dir), device="cuda", matmul_precision="high"), LLM(str(tiny_model_dir), device="cpu")
    ours, theirs = gpu.generate(PROMPTS, params), cpu.generate(PROMPTS, params)
    assert [r.text for r in ours] == [r.text for r in theirs]
    assert all(r.finish_reason == "stop" and set(json.loads(r.text)) == {"ok", "n"} for r in ours)
