"""The batched NumPy sampler: greedy, top-k/top-p/min-p, penalties, distributions, seeds and logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.request import SamplingParams
from colibri_stream.sampling import TOP_P_CANDIDATES, Sampler, SamplingState, apply_penalties

SAMPLER = Sampler()


def states_for(params_list, prompt=(), generator=None) -> list[SamplingState]:
    """One state per params; a shared generator lets many rows draw from one stream."""
    if generator is None:
        return [SamplingState.from_params(p, prompt) for p in params_list]
    return [SamplingState(p, generator, np.asarray(prompt, dtype=np.int64)) for p in params_list]


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)  # [B, V]


def probs64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_greedy_is_argmax_in_a_mixed_batch():
    logits = random_logits(8, 1000)
    params = [SamplingParams(temperature=0.0) if b % 2 == 0 else SamplingParams(seed=b) for b in range(8)]
    out = SAMPLER.sample(logits, states_for(params))
    assert out.token_ids.dtype == np.int64 and out.token_ids.shape == (8,)
    np.testing.assert_array_equal(out.token_ids[::2], np.argmax(logits[::2], axis=1))
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=2), SamplingParams(min_p=1.0, seed=3),
    SamplingParams(top_k=50, top_p=1e-6, seed=4), SamplingParams(temperature=1e-7, seed=5),
])
@pytest.mark.parametrize("vocab", [50, 3 * TOP_P_CANDIDATES])
def test_settings_that_reduce_to_greedy(params, vocab):
    logits = random_logits(16, vocab, seed=vocab)
    out = SAMPLER.sample(logits, states_for([params] * 16))
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=1))


@pytest.mark.parametrize("kwargs, transform", [
    ({}, lambda p: p),
    ({"temperature": 2.0}, lambda p: p ** 0.5),
    ({"temperature": 0.5}, lambda p: p ** 2),
    ({"top_k": 3}, lambda p: np.where(p >= np.sort(p)[-3], p, 0)),
    ({"top_p": 0.6}, lambda p: np.where(np.isin(p, [0.3, 0.25, 0.2]), p, 0)),  # 0.3 + 0.25 < 0.6 <= + 0.2
    ({"min_p": 0.6}, lambda p: np.where(p >= 0.18, p, 0)),
    ({"top_k": 4, "top_p": 0.7}, lambda p: np.where(np.isin(p, [0.3, 0.25, 0.2]), p, 0)),  # 0.55/0.9 < 0.7
])
def test_sampled_frequencies_match_the_distribution(kwargs, transform):
    probs = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    n = 20000
    logits = np.tile(np.log(probs).astype(np.float32), (n, 1))  # [N, 5]
    out = SAMPLER.sample(logits, states_for([SamplingParams(seed=0, **kwargs)] * n, generator=np.random.default_rng(0)))
    expected = transform(probs) / transform(probs).sum()
    freq = np.bincount(out.token_ids, minlength=5) / n
    assert np.all(freq[expected == 0] == 0)
    np.testing.assert_allclose(freq, expected, atol=5 * np.sqrt(0.25 / n))


def test_flat_nucleus_larger_than_the_candidate_shortcut():
    vocab, n = 4 * TOP_P_CANDIDATES, 1000
    logits = np.zeros((n, vocab), dtype=np.float32)
    logits[:, :2000] = 10.0  # 2000 equally likely tokens hold nearly all the mass
    params = SamplingParams(top_p=0.9, seed=0)
    out = SAMPLER.sample(logits, states_for([params] * n, generator=np.random.default_rng(1)))
    assert out.token_ids.max() < 2000 and len(np.unique(out.token_ids)) > 500


def reference_allowed(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] bool: tokens the filters keep, computed the slow way in float64 (top-k, then top-p, then min-p)."""
    x = logits.astype(np.float64) / params.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    keep[order[:params.top_k] if params.top_k > 0 else order] = True
    p = probs64(np.where(keep, x, -np.inf))
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    if params.top_p < 1.0:
        keep[order[before >= params.top_p]] = False
    p = probs64(np.where(keep, x, -np.inf))
    return keep & (p >= params.min_p * p.max())


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=5, seed=0), SamplingParams(top_p=0.5, seed=0), SamplingParams(min_p=0.2, seed=0),
    SamplingParams(top_k=40, top_p=0.8, min_p=0.05, temperature=0.7, seed=0),
    SamplingParams(top_p=0.95, temperature=3.0, seed=0),
])
def test_filters_never_pick_a_masked_token(params):
    logits = random_logits(300, 2 * TOP_P_CANDIDATES, seed=3)
    for step in range(3):
        out = SAMPLER.sample(logits, states_for([params] * 300, generator=np.random.default_rng(step)))
        allowed = np.array([reference_allowed(row, params)[t] for row, t in zip(logits, out.token_ids)])
        assert allowed.all()


def test_penalties_match_a_hand_computation():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0],
                       [2.0, -1.0, 0.5, 3.0, -2.0]], dtype=np.float32)  # [2, 5]
    penalised = SamplingState.from_params(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), prompt_token_ids=[0, 1])
    penalised.output_token_ids += [3, 3, 4]
    plain = SamplingState.from_params(SamplingParams(), prompt_token_ids=[0, 1, 2])
    plain.output_token_ids += [3]
    out = apply_penalties(logits, [penalised, plain])
    # repetition over {0, 1, 3, 4}: 2 -> 1, -1 -> -2, 3 -> 1.5, -2 -> -4; token 2 untouched;
    # then token 3 (twice): 1.5 - 2 * 0.5 - 0.25 = 0.25, token 4 (once): -4 - 0.5 - 0.25 = -4.75
    np.testing.assert_allclose(out[0], [1.0, -2.0, 0.5, 0.25, -4.75], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out[1], logits[1])
    np.testing.assert_array_equal(logits[0], [2.0, -1.0, 0.5, 3.0, -2.0])  # the input is not modified
    greedy = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                                          presence_penalty=0.25), np.random.default_rng(), np.array([0, 1]), [3, 3, 4])
    assert SAMPLER.sample(logits[:1], [greedy]).token_ids[0] == 0  # 3 without the penalties


def test_presence_and_frequency_alone():
    logits = np.zeros((1, 4), dtype=np.float32)
    state = SamplingState.from_params(SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0), [1, 2])
    state.output_token_ids += [2, 2, 2, 0]
    np.testing.assert_allclose(apply_penalties(logits, [state])[0], [-1.0, 0.0, 1.0, 0.0])


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    vocab, steps = 500, 20
    params = SamplingParams(seed=1234, temperature=1.3, top_p=0.9)

    def run(companions: int) -> list[int]:
        state = SamplingState.from_params(params, [1, 2, 3])
        others = [SamplingState.from_params(SamplingParams(seed=s), []) for s in range(companions)]
        tokens = []
        for step in range(steps):
            logits = random_logits(1 + companions, vocab, seed=step, scale=1.0)
            logits[0] = random_logits(1, vocab, seed=100 + step, scale=1.0)[0]
            tokens.append(int(SAMPLER.sample(logits, [state] + others).token_ids[0]))
        return tokens

    first = run(0)
    assert first == run(0) == run(5) and len(set(first)) > 5

    def draws(state: SamplingState) -> list[int]:
        logits = np.zeros((1, vocab), dtype=np.float32)
        return [int(SAMPLER.sample(logits, [state]).token_ids[0]) for _ in range(30)]

    assert draws(SamplingState.from_params(params, [], index=1)) != draws(SamplingState.from_params(params, []))
    unseeded = SamplingParams()
    assert draws(SamplingState.from_params(unseeded, [])) != draws(SamplingState.from_params(unseeded, []))


def test_logprobs_match_a_float64_reference():
    logits = random_logits(5, 300, seed=9, scale=4.0)
    params = [SamplingParams(logprobs=5, seed=0), SamplingParams(), SamplingParams(logprobs=0, temperature=0.0),
              SamplingParams(logprobs=20, temperature=0.5, repetition_penalty=1.5, top_k=10, seed=1),
              SamplingParams(logprobs=3, temperature=0.0, presence_penalty=2.0)]
    states = states_for(params, prompt=[5, 6, 7])
    states[4].output_token_ids += [int(np.argmax(logits[4]))]
    out = SAMPLER.sample(logits, states)
    reference = np.log(probs64(logits))  # raw: before penalties and temperature
    assert out.logprobs[1] is None
    assert out.token_ids[4] != np.argmax(logits[4])  # the penalty moved the greedy pick, not the logprobs
    for b in (0, 2, 3, 4):
        info, k = out.logprobs[b], params[b].logprobs
        assert info.logprob == pytest.approx(reference[b, out.token_ids[b]], abs=1e-5)
        np.testing.assert_array_equal(info.top_token_ids, np.argsort(-reference[b], kind="stable")[:k])
        np.testing.assert_allclose(info.top_logprobs, np.sort(reference[b])[::-1][:k], atol=1e-5)


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="one row per state"):
        SAMPLER.sample(np.zeros((2, 4), dtype=np.float32), states_for([SamplingParams()]))


def test_mass_at_block_edges_and_no_mass_elsewhere():
    vocab, n = 3000, 4000
    logits = np.full((n, vocab), -np.inf, dtype=np.float32)
    hot = [0, 1023, 1024, 2047, 2999]
    logits[:, hot] = 0.0
    out = SAMPLER.sample(logits, states_for([SamplingParams(seed=0)] * n, generator=np.random.default_rng(2)))
    assert set(out.token_ids.tolist()) == set(hot)
    np.testing.assert_allclose(np.bincount(out.token_ids, minlength=vocab)[hot] / n, 0.2, atol=0.03)
