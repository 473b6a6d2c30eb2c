"""Prefix caching end to end on the shipped default model (CPU, NumPy backend): the same greedy tokens with and
without it under preemption and eviction, the work it saves, n > 1 sharing one prompt."""

from __future__ import annotations

import pytest

from colibri_stream.engine import EngineCore
from colibri_stream.request import SamplingParams
from test_engine import run_all

# Small enough that the mixed workload below preempts sequences and evicts cached blocks.
TIGHT = dict(device="cpu", block_size=8, num_kv_blocks=24, max_seq_len=128, max_num_batched_tokens=48,
             max_batch_size=4)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SYSTEM = ("You are a careful assistant for Python questions. Answer briefly, show code when it helps, and say so "
          "when you are not sure.")
QUESTIONS = ["What does len() return?", "How do I sort a dict by value?", "What is a generator?",
             "Explain list comprehensions.", "What is the GIL?"]
FRESH = ["def fibonacci(n):", "import os\n\nfor root, dirs, files in os.walk('.'):", "class Stack:\n    def push"]


def chat(*turns: str) -> list[dict]:
    """System prompt, then user and assistant turns alternating."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[tuple, list[int]]:
    """Add every prompt at once and step until done; (request id, index) -> generated token ids."""
    return run_all(core, {request_id: (ids, params) for request_id, ids in prompts.items()})


def workload(core: EngineCore) -> dict[tuple, list[int]]:
    """Three rounds: shared-system-prompt questions mixed with fresh prompts; the same again with repeats and a
    second turn of each conversation (built from this engine's own answers); the first round resent."""
    encode = core.encode_prompt
    first = {f"q{i}": encode(chat(q)) for i, q in enumerate(QUESTIONS)}
    first |= {f"f{i}": encode(p) for i, p in enumerate(FRESH)}
    results = run(core, first)
    second = {f"t{i}": encode(chat(q, core.tokenizer.decode(results[(f"q{i}", 0)]), "Why?"))
              for i, q in enumerate(QUESTIONS)}
    second |= {"repeat": first["q0"], "repeat-fresh": first["f1"], "new": encode("print('hello')")}
    results |= run(core, second)
    results |= {(f"again-{k[0]}", k[1]): v for k, v in run(core, first).items()}
    return results


@pytest.fixture(scope="module")
def cores() -> tuple[EngineCore, EngineCore]:
    return (EngineCore.from_pretrained(None, enable_prefix_caching=True, **TIGHT),
            EngineCore.from_pretrained(None, enable_prefix_caching=False, **TIGHT))


def test_greedy_tokens_equal_with_and_without_prefix_caching(cores):
    """Exact equality holds on this model, although the NumPy backend is not bitwise the same per row across
    batch shapes (OpenBLAS rounds a product's rows differently with the row count, so a prompt computed from a
    cached prefix gets logits a few float32 ulps off those of a whole prompt); see the logits test below."""
    cached, plain = cores
    with_cache, without = workload(cached), workload(plain)
    stats = cached.stats()
    assert stats.num_preemptions > 0  # the cache is tight enough to preempt ...
    assert stats.prefix_cache_hit_tokens > 0 and plain.stats().prefix_cache_hit_tokens == 0
    assert stats.kv_blocks_cached <= stats.kv_blocks_total
    assert with_cache == without
    assert stats.prefill_computed_tokens < plain.stats().prefill_computed_tokens


def test_cached_blocks_are_evicted_under_pressure(cores):
    cached, _ = cores
    prompt = cached.encode_prompt("x = 1\n" * 10)
    run(cached, {"warm": prompt}, SamplingParams(max_tokens=1))
    assert cached.kv.find_cached_prefix(prompt).block_ids  # cached once computed
    for i in range(6):  # unrelated prompts that need every block in turn
        run(cached, {f"filler{i}": cached.encode_prompt(f"# filler {i}\n" + "y = 2\n" * 15)},
            SamplingParams(max_tokens=1))
    assert cached.kv.find_cached_prefix(prompt).block_ids == []


@pytest.fixture(scope="module")
def fp32_cores() -> tuple[EngineCore, EngineCore]:
    """As `cores`, with the float32 KV cache of the reference."""
    return (EngineCore.from_pretrained(None, enable_prefix_caching=True, kv_cache_dtype="fp32", **TIGHT),
            EngineCore.from_pretrained(None, enable_prefix_caching=False, kv_cache_dtype="fp32", **TIGHT))


# Relative to the largest logit: float32 rounding with a float32 KV cache; with bf16 KV, one bf16 rounding step
# (2^-8): a key or value a few float32 ulps off on the two paths can round to neighbouring bf16 values.
LOGIT_TOLERANCES = {"fp32": 1e-4, "bf16": 2**-8}


@pytest.mark.parametrize("kv_dtype", LOGIT_TOLERANCES)
def test_logits_of_a_cached_prefix_match_a_whole_prompt_within_rounding(kv_dtype, request):
    """The logits of a prompt's last token, computed after a cached prefix, against computing the whole prompt:
    equal up to rounding (not bitwise: see the test above), and the same argmax."""
    cached, plain = request.getfixturevalue("fp32_cores" if kv_dtype == "fp32" else "cores")
    prompt = cached.encode_prompt(chat("What does a cached prefix change?"))
    last = []  # each engine's logits of the probe's last step
    for core in (cached, plain):
        captured = []
        forward = core.runner.model.forward_device  # every eager step's logits (host arrays on the CPU)
        core.runner.model.forward_device = lambda batch, device_batch, kv, forward=forward: captured.append(
            forward(batch, device_batch, kv)) or captured[-1]
        try:
            run(core, {"warm": prompt[:-3]}, SamplingParams(max_tokens=1))  # shares all but the last blocks
            run(core, {"probe": prompt}, SamplingParams(max_tokens=1))
        finally:
            del core.runner.model.forward_device
        last.append(captured[-1])
    with_cache, without = last
    assert with_cache.shape == without.shape == (1, cached.model_config.vocab_size)
    assert with_cache.argmax() == without.argmax()
    assert abs(with_cache - without).max() <= LOGIT_TOLERANCES[kv_dtype] * abs(without).max()


def test_a_resent_long_prompt_computes_only_its_last_partial_block(cores):
    cached, _ = cores
    prompt = cached.encode_prompt("def add(a, b):\n    return a + b\n\n" * 6)
    block = cached.kv.block_size
    assert len(prompt) > 4 * block and len(prompt) % block
    before = cached.stats()
    first = run(cached, {"first": prompt}, SamplingParams(max_tokens=1))
    middle = cached.stats()
    cached.add_request("second", prompt, SamplingParams(max_tokens=1))
    outputs = cached.step()
    after = cached.stats()
    assert after.last_step_tokens == len(prompt) % block  # the tokens after the last full block
    assert after.prefix_cache_hit_tokens - middle.prefix_cache_hit_tokens == len(prompt) // block * block
    assert middle.prefill_computed_tokens - before.prefill_computed_tokens == len(prompt)
    assert [o.token_ids for o in outputs] == [first[("first", 0)]]
    assert outputs[0].cached_tokens == len(prompt) // block * block


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(cores):
    cached, _ = cores
    block = cached.kv.block_size
    prompt = (cached.encode_prompt("while True:\n    pass\n" * 8) * 2)[: 5 * block]
    run(cached, {"first": prompt}, SamplingParams(max_tokens=1))
    cached.add_request("second", prompt, SamplingParams(max_tokens=1))
    cached.step()
    assert cached.stats().last_step_tokens == block  # never the last token: its whole block is computed


def test_n_sequences_share_the_prompt(cores):
    cached, plain = cores
    prompt = cached.encode_prompt("Write three different haiku about caches, each in the voice of a tired engineer.")
    block = cached.kv.block_size
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    before = cached.stats()
    tokens = run(cached, {"n3": prompt}, params)
    after = cached.stats()
    shared = (len(prompt) - 1) // block * block
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 2 * shared
    assert after.prefill_computed_tokens - before.prefill_computed_tokens == len(prompt) + 2 * (len(prompt) - shared)
    alone = run(plain, {"n1": prompt}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [tokens[("n3", i)] for i in range(3)] == [alone[("n1", 0)]] * 3
