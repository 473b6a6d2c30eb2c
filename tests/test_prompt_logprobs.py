"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability under the model, from the
second token on, and the top k at its position, as transformers' float32 log-softmax gives them, for every
supported architecture; also when the prompt is computed in chunks, after a preemption, and when an earlier request
left the same prompt in the prefix cache (the prompt is then computed again, not taken from the cache).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import TOKENIZER_VOCAB_SIZE, write_tokenizer  # noqa: E402
from test_parity import reference_logits  # noqa: E402
from tiny_models import ARCHITECTURES, build_hf_model  # noqa: E402

from colibri_stream.engine import EngineCore  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.errors import InvalidParameterError  # noqa: E402
from colibri_stream.request import SamplingParams  # noqa: E402

TOP = 3
# Chunked prefill (8 tokens a step) and a KV cache small enough that three long requests preempt one another.
TIGHT = dict(device="cpu", block_size=4, num_kv_blocks=28, max_seq_len=96, max_num_batched_tokens=8,
             max_batch_size=3)


def reference_prompt_logprobs(hf_model, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob of token p + 1 at position p [P - 1], top ids [P - 1, TOP], their logprobs) from transformers."""
    logits = torch.tensor(reference_logits(hf_model, np.asarray(ids)))[:-1].double()  # [P - 1, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(TOP, dim=-1)
    return (logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy(), top.indices.numpy(),
            top.values.numpy())


def check_entries(entries, ids: list[int], reference) -> None:
    chosen, top_ids, top_values = reference
    assert [token for token, _, _ in entries] == ids[1:]
    np.testing.assert_allclose([lp for _, lp, _ in entries], chosen, atol=2e-4)
    for (_, _, top), want_ids, want_values in zip(entries, top_ids, top_values):
        np.testing.assert_allclose([lp for _, lp in top], want_values, atol=2e-4)
        # ids agree except where two candidates' logprobs tie within rounding
        got = dict(top)
        assert all(t in got or abs(v - want_values[-1]) < 2e-4 for t, v in zip(want_ids.tolist(), want_values))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompt_logprobs_match_transformers_through_chunks_preemption_and_the_prefix_cache(arch, tmp_path):
    hf_model = build_hf_model(arch, tmp_path / "hf", vocab_size=TOKENIZER_VOCAB_SIZE)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    write_tokenizer(tmp_path / "model")
    core = EngineCore.from_pretrained(str(tmp_path / "model"), kv_cache_dtype="fp32", **TIGHT)  # the reference's
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, TOKENIZER_VOCAB_SIZE, length).tolist() for length in (37, 29, 33)]
    # The first prompt goes through once without prompt logprobs: its blocks are then in the prefix cache.
    core.add_request("warm", prompts[0], SamplingParams(max_tokens=2, temperature=0))
    while core.has_unfinished():
        core.step()
    firsts = {}
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=TOP, logprobs=1))
    preempted_before = core.scheduler.num_preemptions
    while core.has_unfinished():
        for out in core.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts, "prompt logprobs come once, on the first output"
                firsts[out.request_id] = out
            assert out.prompt_logprobs is None or out.completion_tokens == 1
    assert core.scheduler.num_preemptions > preempted_before, "the test meant to preempt"
    for i, ids in enumerate(prompts):
        out = firsts[str(i)]
        assert out.prompt_token_ids == ids and len(out.prompt_logprobs) == len(ids) - 1
        assert out.cached_tokens == 0
        check_entries(out.prompt_logprobs, ids, reference_prompt_logprobs(hf_model, ids))


def test_prompt_logprobs_are_bounded_like_logprobs():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21, 2.5):
        with pytest.raises(InvalidParameterError, match="prompt_logprobs must be an integer between 0 and 20"):
            SamplingParams(prompt_logprobs=bad)


def test_offline_generation_returns_prompt_logprobs(tiny_model_dir):
    from colibri_stream.llm import LLM

    llm = LLM(str(tiny_model_dir), device="cpu")
    results = llm.generate(["Hello there", "The quick brown fox"], SamplingParams(max_tokens=3, prompt_logprobs=1))
    for result in results:
        assert [token for token, _, _ in result.prompt_logprobs] == result.prompt_token_ids[1:]
        assert all(lp <= 0 and len(top) == 1 for _, lp, top in result.prompt_logprobs)
    assert llm.generate("Hello there", SamplingParams(max_tokens=2)).prompt_logprobs is None
