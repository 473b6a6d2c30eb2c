"""The batched NumPy sampler: greedy, top-k/top-p/min-p, penalties, distributions, seeds and logprobs."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest

from colibri_stream.backends.kernels import kernel_dir
from colibri_stream.request import SamplingParams
from colibri_stream.exact_softmax import (
    EXP_CHUNK,
    EXP_TAYLOR,
    LN2_HI,
    LN2_LO,
    LOG2E,
    exp_sums,
    fixed_exp,
    fixed_point,
    log_normaliser,
    top_sorted,
)
from colibri_stream.sampling import (
    TOP_P_CANDIDATES,
    WALK_HEAD,
    HostLogits,
    Sampler,
    SamplerOutput,
    SamplingState,
    apply_penalties,
    drawn_over_vocabulary,
    token_logprobs,
)

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


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 0, 3]])
def test_an_all_greedy_batch_takes_the_argmaxes_and_nothing_else(rows):
    logits = random_logits(4, 1000, seed=3)
    source = HostLogits(logits[rows])
    states = states_for([SamplingParams(temperature=0.0, top_k=5, seed=1)] * len(rows))
    drawn = [s.generator.bit_generator.state["state"]["state"] for s in states]
    out = SAMPLER.sample_from(source, states)
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits[rows], axis=1))
    assert out.token_ids.dtype == np.int64 and out.logprobs == [None] * len(rows)
    assert [s.generator.bit_generator.state["state"]["state"] for s in states] == drawn  # no draws
    # A logit bias, a penalty or logprobs still take the whole path: the bias moves the token.
    bias = SamplingParams(temperature=0.0, logit_bias=((1, 100.0),))
    asks = SamplingParams(temperature=0.0, logprobs=2)
    out = SAMPLER.sample_from(source, states_for([bias, asks] + [SamplingParams(temperature=0.0)] * (len(rows) - 2)))
    assert out.token_ids[0] == 1 and out.logprobs[1] is not None
    np.testing.assert_array_equal(out.token_ids[1:], np.argmax(logits[rows][1:], axis=1))


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=2), SamplingParams(min_p=1.0, seed=3),
    SamplingParams(top_k=50, top_p=1e-6, seed=4), SamplingParams(temperature=1e-7, seed=5),
    SamplingParams(top_p=0.0, seed=6), SamplingParams(top_k=50, top_p=0.0, temperature=3.0, seed=7),
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


def test_a_tokens_logprob_is_its_own_top_logprobs_entry():
    """Every path (candidates at temperature 1, whole rows for penalties or another temperature, greedy, prompt
    logprobs) reports the sampled token's logprob as the very number of its entry among the top ones."""
    logits = random_logits(6, 300, seed=3, scale=4.0)
    params = [SamplingParams(logprobs=20, seed=0), SamplingParams(logprobs=20, temperature=0.0),
              SamplingParams(logprobs=20, temperature=0.7, seed=1), SamplingParams(logprobs=20, top_k=5, seed=2),
              SamplingParams(logprobs=20, temperature=0.0, presence_penalty=0.5),
              SamplingParams(logprobs=20, top_p=0.9, frequency_penalty=0.3, seed=3)]
    out = SAMPLER.sample(logits, states_for(params, prompt=[5, 6]))
    found = 0
    for token, info in zip(out.token_ids.tolist(), out.logprobs, strict=True):
        assert info.top_logprobs.dtype == np.float32 and info.logprob == float(np.float32(info.logprob))
        top = dict(zip(info.top_token_ids.tolist(), info.top_logprobs.tolist()))
        found += token in top
        assert token not in top or top[token] == info.logprob
    assert found == len(params)  # every token was among its row's best 20
    for b in (1, 4):  # greedy: the best entry
        assert out.logprobs[b].logprob == out.logprobs[b].top_logprobs[0]
    targets = np.argmax(logits, axis=1)  # [B]: prompt tokens that are each row's best
    for target, info in zip(targets.tolist(), token_logprobs(HostLogits(logits), targets, 3), strict=True):
        assert info.top_token_ids[0] == target and info.logprob == info.top_logprobs[0]


class FailingGrammar:
    """A constraint whose grammar has failed, as TokenConstraint reports it."""

    def allowed(self):
        from colibri_stream.errors import GrammarError

        raise GrammarError("the grammar failed: a parser limit")


class OneTokenGrammar:
    """A constraint that allows one token next."""

    def __init__(self, token: int, vocab: int):
        self.mask = np.zeros(vocab, dtype=bool)  # [V]
        self.mask[token] = True

    def allowed(self):
        return self.mask


def test_a_row_that_cannot_be_sampled_fails_alone():
    """Rows with NaN or infinite logits, a failing grammar, or a grammar and min_tokens that ban every token get
    token -1 and their reason; every other row gets the token and logprobs it gets alone, its generator drawn
    once as alone."""
    logits = random_logits(7, 300, seed=4, scale=3.0)
    logits[1, 17] = np.nan
    logits[2, 3] = np.inf
    params = [SamplingParams(seed=0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5, seed=1), SamplingParams(seed=2, presence_penalty=0.5),
              SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=3, min_tokens=2),
              SamplingParams(temperature=0.5, top_p=0.9, seed=4)]
    states = states_for(params)
    states[3].constraint = FailingGrammar()
    states[5].constraint = OneTokenGrammar(9, 300)
    states[5].ending_token_ids = (9,)  # min_tokens bans it
    out = SAMPLER.sample(logits, states)
    assert sorted(out.failures) == [1, 2, 3, 5] and all(out.token_ids[b] == -1 for b in out.failures)
    assert "not finite" in out.failures[1] and "not finite" in out.failures[2]
    assert "parser limit" in out.failures[3] and "no token is allowed" in out.failures[5]
    for b in (0, 4, 6):
        alone = SAMPLER.sample(logits[b:b + 1], states_for([params[b]]))
        assert out.token_ids[b] == alone.token_ids[0]
        assert (out.logprobs[b] is None) == (alone.logprobs[0] is None)
        if out.logprobs[b] is not None:
            assert out.logprobs[b].logprob == alone.logprobs[0].logprob
    assert SAMPLER.sample(logits[[0, 4, 6]], states_for([params[b] for b in (0, 4, 6)])).failures == {}


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


class CandidateLogits(HostLogits):
    """Host logits served as a GPU source serves them: at most TOP_P_CANDIDATES candidates (always that many, to
    show a row reads only its own prefix), every row's log-normaliser, and a record of the rows copied whole."""

    def __init__(self, logits: np.ndarray):
        super().__init__(logits)
        self.max_candidates = TOP_P_CANDIDATES
        self.copied: list[int] = []

    def rows(self, rows):
        self.copied += rows.tolist()
        return super().rows(rows)

    def candidates(self, rows, temperature, count, lse_rows):
        wide = min(self.vocab_size, self.max_candidates)
        return super().candidates(rows, temperature, wide, np.ones(len(rows), dtype=bool))


def reference_walk(row: np.ndarray, temperature: float, min_p: float, uniform: float) -> tuple[int, bool]:
    """(token, copied) of a draw over the whole vocabulary computed over the whole row [V] at once: the inverse CDF
    walks the best TOP_P_CANDIDATES tokens by scaled logit (equal ones by lower id), then the rest by id, over
    integer weights floor(exp(x - max) * 2**bits) (0 where x - max < log(min_p)), to the first token whose
    cumulative weight exceeds floor(uniform * total). copied: whether the candidate path must copy the row (the
    walk ends beyond the candidates, or min-p keeps the last candidate, so the tail's total is needed)."""
    vocab = len(row)
    m = min(vocab, TOP_P_CANDIDATES)
    scaled = row / np.float32(temperature)  # [V] float32
    best = np.lexsort((np.arange(vocab), -scaled))[:m]  # [m]
    order = np.concatenate([best, np.setdiff1d(np.arange(vocab), best)])  # [V]
    bits, cutoff = fixed_point(vocab)
    y = scaled.astype(np.float64) - float(scaled.max())  # [V]
    lowest = math.log(min_p) if min_p > 0 else -math.inf
    weights = np.where(y >= lowest, fixed_exp(y.copy(), bits, cutoff), 0).astype(np.int64)  # [V]
    mass = np.cumsum(weights[order])  # [V]
    assert 0 < mass[-1] < 2**63
    position = int(np.searchsorted(mass, (int(uniform * 2**53) * int(mass[-1])) >> 53, side="right"))
    return int(order[position]), position >= m or (m < vocab and y[best[-1]] >= lowest and min_p > 0)


def needs_whole_row(p: SamplingParams, vocab: int, logits: np.ndarray, uniform: float) -> bool:
    """Whether the candidate path must copy this row: penalties, logprobs of a temperature other than 1, more than
    TOP_P_CANDIDATES candidates, a nucleus beyond them, or a draw over the whole vocabulary that needs the row."""
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        return True
    if p.temperature < 1e-5:
        return False
    if (p.logprobs is not None and p.temperature != 1.0) or top_k > 1024 or (p.logprobs or 0) > 1024:
        return True
    if top_k == 0 and p.top_p == 1.0:
        return reference_walk(logits, p.temperature, p.min_p, uniform)[1]
    if top_k or vocab <= TOP_P_CANDIDATES:
        return False
    scaled = (logits / np.float32(p.temperature)).astype(np.float64)
    best = np.sort(scaled)[::-1][:TOP_P_CANDIDATES]
    lse = np.log(np.exp(scaled - scaled.max()).sum()) + scaled.max()
    return np.exp(best - lse).sum() < p.top_p


def random_params(rng: np.random.Generator) -> SamplingParams:
    kwargs = {"seed": int(rng.integers(0, 2**63)), "temperature": float(rng.choice([0.0, 0.3, 1.0, 1.0, 2.5]))}
    if rng.random() < 0.5:
        kwargs["top_k"] = int(rng.choice([1, 2, 7, 50, 1024, 1025, 4000, 10**6]))
    if rng.random() < 0.5:
        kwargs["top_p"] = float(rng.choice([1e-6, 0.3, 0.9, 0.99, 0.999999, 1.0]))
    if rng.random() < 0.3:
        kwargs["min_p"] = float(rng.choice([0.01, 0.3, 1.0]))
    if rng.random() < 0.3:
        kwargs["logprobs"] = int(rng.choice([0, 1, 5, 20]))
    if rng.random() < 0.15:
        kwargs[str(rng.choice(["repetition_penalty", "presence_penalty"]))] = 1.5
    return SamplingParams(**kwargs)


def random_tied_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Logits with many equal values (few distinct levels, -0 and +0, -inf) or none, by row."""
    logits = (rng.standard_normal((rows, vocab)) * rng.choice([0.3, 3.0, 12.0])).astype(np.float32)  # [B, V]
    tied = rng.random(rows) < 0.5
    logits[tied] = np.round(logits[tied] * 2) / 2
    logits[rng.random((rows, vocab)) < 0.01] = -np.inf
    logits[rng.random((rows, vocab)) < 0.01] = -0.0
    return logits


def assert_same_output(ours: SamplerOutput, expected: SamplerOutput) -> None:
    """The same tokens and logprobs, bit for bit."""
    np.testing.assert_array_equal(ours.token_ids, expected.token_ids)
    for a, b in zip(ours.logprobs, expected.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == b.logprob
            np.testing.assert_array_equal(a.top_token_ids, b.top_token_ids)
            np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)


@pytest.mark.parametrize("seed", range(12))
def test_the_candidate_path_gives_the_host_tokens_and_logprobs(seed):
    """Sampler.sample (whole host rows) and sample_from a source of candidates only agree on every row: tokens
    bit for bit, logprobs too; and only the rows that need it are copied whole."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([5, 300, TOP_P_CANDIDATES, 3000, 20000]))
    rows = 24
    logits = random_tied_logits(rng, rows, vocab)
    params = [random_params(rng) for _ in range(rows)]
    states, twins = ([SamplingState(p, np.random.default_rng(p.seed), np.array([1, 2, 3]), [0, 4]) for p in params]
                     for _ in range(2))
    for _ in range(3):
        source = CandidateLogits(logits)
        uniforms = [copy.deepcopy(t.generator).random() for t in twins]  # each row's next draw
        assert_same_output(SAMPLER.sample_from(source, twins), SAMPLER.sample(logits, states))
        expected = [b for b, p in enumerate(params) if needs_whole_row(p, vocab, logits[b], uniforms[b])]
        assert sorted(source.copied) == expected
        logits = random_tied_logits(rng, rows, vocab)


def test_top_sorted_breaks_ties_by_lower_id():
    rng = np.random.default_rng(5)
    for vocab in (1, 9, 700, 5000):
        x = random_tied_logits(rng, 6, vocab)
        for m in sorted({1, min(3, vocab), vocab // 2 or 1, vocab}):
            expected = np.stack([np.lexsort((np.arange(vocab), -row))[:m] for row in x])  # value desc, then id
            np.testing.assert_array_equal(top_sorted(x, m), expected)


def test_log_normaliser_is_the_float64_logsumexp():
    rng = np.random.default_rng(6)
    for vocab in (1, 384, 151936):
        x = random_tied_logits(rng, 3, vocab)
        x[0, 1:] = -np.inf  # one finite value
        x64 = x.astype(np.float64)
        top = x64.max(axis=1, keepdims=True)
        reference = (top + np.log(np.exp(x64 - top).sum(axis=1, keepdims=True)))[:, 0]
        ours = log_normaliser(x.max(axis=1), exp_sums(x), vocab)
        np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-12 * vocab)


def test_the_kernel_uses_the_same_exp_constants():
    source = (kernel_dir() / "sampling.cu").read_text()
    taylor = re.search(r"TAYLOR\[12\] = \{([^}]*)\}", source).group(1)
    assert tuple(float.fromhex(c.strip()) for c in taylor.split(",")) == EXP_TAYLOR
    for name, value in (("LOG2E", LOG2E), ("LN2_HI", LN2_HI), ("LN2_LO", LN2_LO)):
        assert float(re.search(rf"double {name} = ([^;]+);", source).group(1)) == value


def whole_vocabulary_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """[B, V] float32, by row: peaked (a few hot tokens), flat, tied (few levels, -0 and +0, -inf), wide."""
    logits = (rng.standard_normal((rows, vocab)) * 3.0).astype(np.float32)  # [B, V]: wide
    for b in range(rows):
        kind = b % 4
        if kind == 0:
            logits[b, rng.integers(0, vocab, 8)] += 15.0
        elif kind == 1:
            logits[b] = rng.standard_normal(vocab).astype(np.float32) * 0.01
        elif kind == 2:
            logits[b] = random_tied_logits(rng, 1, vocab)[0]
    return logits


def whole_vocabulary_params(rng: np.random.Generator, rows: int) -> list[SamplingParams]:
    """Rows without top-k or top-p: temperatures 0.3 to 2, min-p or not, logprobs or not, the default."""
    return [SamplingParams(seed=int(rng.integers(0, 2**63)), temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5, 2.0])),
                           min_p=float(rng.choice([0.0, 0.0, 1e-3, 0.05, 0.5])),
                           logprobs=None if rng.random() < 0.6 else int(rng.choice([0, 5])))
            if b else SamplingParams(seed=int(rng.integers(0, 2**63))) for b in range(rows)]


@pytest.mark.parametrize("vocab, rows", [(5, 16), (300, 16), (TOP_P_CANDIDATES, 8), (3000, 16), (151936, 8)])
def test_a_whole_vocabulary_draw_from_candidates_is_the_walk_over_the_whole_row(vocab, rows):
    """Rows without top-k or top-p: the candidates' path gives the tokens of a walk over the whole row (the best
    TOP_P_CANDIDATES, then the rest by id, exact integer weights), copies a row when and only when that walk needs
    it, and equals the host path (HostLogits) in tokens and logprobs."""
    rng = np.random.default_rng(vocab)
    params = whole_vocabulary_params(rng, rows)
    states, twins = ([SamplingState.from_params(p, [1, 2]) for p in params] for _ in range(2))
    copies = 0
    for _ in range(4):
        logits = whole_vocabulary_logits(rng, rows, vocab)
        uniforms = [copy.deepcopy(s.generator).random() for s in states]  # each row's next draw
        expected = [reference_walk(logits[b], p.temperature, p.min_p, uniforms[b]) for b, p in enumerate(params)]
        source = CandidateLogits(logits)
        ours = SAMPLER.sample_from(source, twins)
        assert_same_output(ours, SAMPLER.sample(logits, states))
        assert ours.token_ids.tolist() == [token for token, _ in expected]
        copied = [b for b, (p, (_, beyond)) in enumerate(zip(params, expected))
                  if beyond or (p.logprobs is not None and p.temperature != 1.0)]
        assert sorted(source.copied) == copied
        copies += sum(beyond for _, beyond in expected)
        with np.errstate(divide="ignore"):
            reference = np.log(probs64(logits))  # -inf logits: -inf
        for b, info in enumerate(ours.logprobs):
            if info is not None:
                assert info.logprob == pytest.approx(reference[b, ours.token_ids[b]], abs=1e-5)
    assert vocab <= TOP_P_CANDIDATES or copies > 0  # some draws went beyond the candidates


def test_a_flat_row_draws_beyond_the_candidates_and_a_peaked_one_never():
    vocab, rows = 151936, 6
    logits = np.zeros((2 * rows, vocab), dtype=np.float32)  # [2B, V]: flat rows first
    logits[rows:, 7] = 40.0  # peaked: token 7 holds all but e^-40 * V of the mass
    params = [SamplingParams(temperature=2.0, seed=b) for b in range(rows)] + [SamplingParams(seed=b, logprobs=3)
                                                                              for b in range(rows)]
    source = CandidateLogits(logits)
    out = SAMPLER.sample_from(source, states_for(params))
    # A draw lands among the 1024 candidates (ids 0..1023: all equal) with probability 1024 / V.
    beyond = [b for b in range(rows) if out.token_ids[b] >= TOP_P_CANDIDATES]
    assert source.copied == beyond and len(beyond) >= rows - 1
    assert out.token_ids[rows:].tolist() == [7] * rows
    assert [info.top_token_ids.tolist() for info in out.logprobs[rows:]] == [[7, 0, 1]] * rows  # no copy needed
    assert_same_output(out, SAMPLER.sample(logits, states_for(params)))


def test_min_p_below_the_last_candidate_never_copies_the_row():
    vocab, rows = 151936, 32
    logits = np.full((rows, vocab), -3.0, dtype=np.float32)  # [B, V]
    logits[:, 100:1100] = 0.0  # 1000 likely tokens; the other 150936 hold 88 % of the mass (e^-3 each)
    cut = [SamplingParams(min_p=0.1, seed=b) for b in range(rows)]  # e^-3 < 0.1: the tail is dropped
    source = CandidateLogits(logits)
    out = SAMPLER.sample_from(source, states_for(cut))
    assert source.copied == [] and ((out.token_ids >= 100) & (out.token_ids < 1100)).all()
    kept = [SamplingParams(min_p=0.01, seed=b) for b in range(rows)]  # e^-3 > 0.01: the tail stays, its mass unknown
    source = CandidateLogits(logits)
    out = SAMPLER.sample_from(source, states_for(kept))
    assert source.copied == list(range(rows)) and (out.token_ids >= 1100).sum() > rows // 2
    assert_same_output(out, SAMPLER.sample(logits, states_for(kept)))


def reference_fixed_exp(y: np.ndarray, bits: int, cutoff: float) -> np.ndarray:
    """fixed_exp as first written (int64), the kernel's steps one by one: clamp, k = rint(y * LOG2E), r, Horner,
    ldexp, floor, 0 below the cutoff."""
    y = y.astype(np.float64)
    counted = y >= cutoff
    y = np.maximum(y, cutoff)
    k = np.rint(y * LOG2E)
    r = (y - k * LN2_HI) - k * LN2_LO
    p = r * EXP_TAYLOR[-1]
    for c in EXP_TAYLOR[-2:0:-1]:
        p = (p + c) * r
    p = p + EXP_TAYLOR[0]
    return (np.floor(np.ldexp(p, k.astype(np.int32) + bits)) * counted).astype(np.int64)


@pytest.mark.parametrize("vocab", [1 << n for n in range(0, 31, 3)] + [151936])
def test_fixed_exp_is_the_kernels_step_by_step(vocab):
    """The same integers as the kernel's sequence of float64 operations, for every bit count: at and around the
    cutoff (raised to it, where the weight floors to 0), -inf, 0 and -0, a dense sweep and random values."""
    rng = np.random.default_rng(vocab)
    bits, cutoff = fixed_point(vocab)
    y = np.concatenate([np.linspace(1.05 * cutoff, 0.0, 20001), [cutoff, np.nextafter(cutoff, 0), -np.inf, 0.0, -0.0],
                        -rng.random(20000) * 50, -rng.exponential(1.0, 20000), -rng.random(1000) * 1e-9])
    expected = reference_fixed_exp(y, bits, cutoff)
    ours = fixed_exp(y.copy(), bits, cutoff)
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, expected)
    assert expected[-1000:].min() > 2**(bits - 1) and expected[:20001].min() == 0  # near 1 and 0: both ends reached
    scratch = (np.empty_like(y), np.empty_like(y))
    np.testing.assert_array_equal(fixed_exp(y.reshape(-1, 1).copy(), bits, cutoff,
                                            tuple(a.reshape(-1, 1) for a in scratch))[:, 0], expected)


@pytest.mark.parametrize("vocab, rows", [(5, 7), (3000, 11), (EXP_CHUNK, 3), (EXP_CHUNK + 7, 3), (32000, 5),
                                         (151936, 2)])
def test_exp_sums_is_the_sum_of_the_fixed_exps(vocab, rows):
    """exp_sums in pieces and reused buffers (rows split across pieces, a short last piece) is the plain sum."""
    rng = np.random.default_rng(vocab)
    x = np.concatenate([random_tied_logits(rng, rows, vocab), whole_vocabulary_logits(rng, rows, vocab)])
    bits, cutoff = fixed_point(vocab)
    expected = [reference_fixed_exp(row.astype(np.float64) - row.max(), bits, cutoff).sum() for row in x]
    np.testing.assert_array_equal(exp_sums(x), expected)


@pytest.mark.parametrize("vocab", [8192, 32000])
def test_top_sorted_at_serving_sizes(vocab):
    """The candidates' order (value, then lower id) over whole vocabularies: peaked, flat and tied rows, few levels
    (many values equal to the 1024th), -0.0 with +0.0, -inf; fewer candidates than the vocabulary and all of it."""
    rng = np.random.default_rng(vocab)
    x = np.concatenate([whole_vocabulary_logits(rng, 8, vocab),
                        rng.integers(-2, 2, (2, vocab)).astype(np.float32),
                        np.where(rng.random((2, vocab)) < 0.5, np.float32(-0.0), np.float32(0.0))])
    x[-1, :5] = [np.inf, -np.inf, 1.0, -1.0, np.float32(1e-45)]
    order = np.stack([np.lexsort((np.arange(vocab), -row)) for row in x])  # value desc, then id
    for m in (1, WALK_HEAD, TOP_P_CANDIDATES, vocab - 1, vocab):
        np.testing.assert_array_equal(top_sorted(x, m), order[:, :m])


@pytest.mark.parametrize("vocab", [8192, 32000])
def test_whole_vocabulary_draws_on_both_sides_of_the_head(vocab):
    """Draws over the whole vocabulary whose rows hold about half their mass in the first WALK_HEAD candidates:
    the walk weighs the other candidates only for some rows, and every token is the whole row's walk (candidates'
    path and host path alike), min-p and temperatures included."""
    rng = np.random.default_rng(vocab + 1)
    rows = 48
    logits = (rng.standard_normal((rows, vocab)) * 0.5).astype(np.float32)  # [B, V]
    for b in range(rows):
        logits[b, rng.choice(vocab, WALK_HEAD, replace=False)] += np.float32(np.log(vocab / WALK_HEAD) + 0.5)
    params = [SamplingParams(seed=b, temperature=float(rng.choice([1.0, 1.0, 0.7, 1.3])),
                             min_p=float(rng.choice([0.0, 0.0, 0.0, 1e-4, 0.2]))) for b in range(rows)]
    states, twins = states_for(params), states_for(params)
    uniforms = [copy.deepcopy(s.generator).random() for s in states]
    expected = [reference_walk(logits[b], p.temperature, p.min_p, uniforms[b]) for b, p in enumerate(params)]
    source = CandidateLogits(logits)
    ours = SAMPLER.sample_from(source, twins)
    assert ours.token_ids.tolist() == [token for token, _ in expected]
    assert sorted(source.copied) == [b for b, (_, beyond) in enumerate(expected) if beyond]
    assert_same_output(ours, SAMPLER.sample(logits, states))
    scaled = [logits[b] / np.float32(p.temperature) for b, p in enumerate(params)]
    rank = [int(np.flatnonzero(np.lexsort((np.arange(vocab), -row)) == t)[0]) for row, t in zip(scaled, ours.token_ids)]
    assert min(rank) < WALK_HEAD and any(WALK_HEAD <= r < TOP_P_CANDIDATES for r in rank)  # both sides reached


class FixedDraw:
    """A generator whose every draw is the given uniform."""

    def __init__(self, uniform: float):
        self.uniform = uniform

    def random(self) -> float:
        return self.uniform


def test_a_draw_at_the_heads_total_goes_to_the_next_candidate():
    """floor(u * total) equal to the first WALK_HEAD candidates' total weight picks candidate WALK_HEAD (the first
    whose cumulative weight exceeds it), one less picks candidate WALK_HEAD - 1; no row is copied."""
    vocab = 8192
    logits = np.full((1, vocab), -10.0, dtype=np.float32)  # [1, V]
    logits[0, 100:100 + 2 * WALK_HEAD] = -3.0
    logits[0, 5000] = 0.0  # the total stays below 2**53: every integer draw is some uniform's
    bits, cutoff = fixed_point(vocab)
    order = np.lexsort((np.arange(vocab), -logits[0]))  # [V]
    head = int(reference_fixed_exp(logits[0, order[:WALK_HEAD]].astype(np.float64), bits, cutoff).sum())
    total = int(exp_sums(logits)[0])
    assert total < 2**53
    for target, rank in ((head, WALK_HEAD), (head - 1, WALK_HEAD - 1)):
        draw = -(-(target << 53) // total)  # the least uniform * 2**53 whose draw is at least the target
        assert (draw * total) >> 53 == target
        params = SamplingParams(seed=0)
        state = SamplingState(params, FixedDraw(draw / 2**53), np.zeros(0, dtype=np.int64))
        assert reference_walk(logits[0], 1.0, 0.0, draw / 2**53) == (order[rank], False)
        source = CandidateLogits(logits)
        assert SAMPLER.sample_from(source, [state]).token_ids.tolist() == [order[rank]] and source.copied == []
        assert SAMPLER.sample(logits, [state]).token_ids.tolist() == [order[rank]]


class DrawingLogits(CandidateLogits):
    """A candidate source that also draws whole-vocabulary rows itself, as DeviceLogits does on the GPU, here by the
    reference walk over the whole row; records the rows it drew."""

    def __init__(self, logits: np.ndarray):
        super().__init__(logits)
        self.drawn: list[int] = []

    def whole_vocabulary_draws(self, rows, temperature, uniform):
        self.drawn += rows.tolist()
        return np.array([reference_walk(self.logits[r], float(t), 0.0, float(u))[0]
                         for r, t, u in zip(rows.tolist(), temperature, uniform)], dtype=np.int64)


@pytest.mark.parametrize("vocab", [300, 3000])
def test_the_rows_a_source_draws_are_the_rows_launched_ahead(vocab):
    """The sampler asks a source to draw exactly the rows `drawn_over_vocabulary` names (the rows the runner
    launches ahead, with the draw in the decode graph), and those draws give the host sampler's tokens."""
    rng = np.random.default_rng(vocab + 7)
    params = [random_params(rng) for _ in range(64)] + whole_vocabulary_params(rng, 16)
    states, twins = states_for(params), states_for(params)
    logits = random_tied_logits(rng, len(params), vocab)  # [B, V]
    source = DrawingLogits(logits)
    assert_same_output(SAMPLER.sample_from(source, states), SAMPLER.sample(logits, twins))
    expected = [b for b, p in enumerate(params) if drawn_over_vocabulary(p, vocab)]
    assert sorted(source.drawn) == expected and len(expected) >= 8


# ------------------------------------------------------------------------------------ logprobs over the server

def _chat_entries_agree(content, greedy: bool) -> int:
    """Assert that each chat logprobs entry's logprob is its own top_logprobs entry's (same token and bytes) where
    that is listed, and the best one when decoding greedily; returns how many entries listed their token."""
    listed = 0
    for entry in content:
        own = [top.logprob for top in entry.top_logprobs if (top.token, top.bytes) == (entry.token, entry.bytes)]
        listed += bool(own)
        assert not own or entry.logprob in own
        if greedy:
            assert entry.logprob == entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
    return listed


@pytest.mark.parametrize("stream", [False, True])
def test_server_logprobs_equal_their_own_top_logprobs_entry(tiny_server, tiny_model_dir, stream):
    """Through the openai client, chat and completions, streamed or not, greedy and sampled, and the prompt's
    logprobs of echo and vLLM's prompt_logprobs: a token's logprob is exactly (==) the number of its own entry in
    top_logprobs, and a greedy token is the best entry (lm-evaluation-harness's is_greedy compares them)."""
    import openai
    from test_server import API_KEY

    from colibri_stream.tokenizer import Tokenizer

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    # Sampled rows draw from their top 5 so that each token is among the 5 top_logprobs listed; temperature 1 is
    # served from the candidates, 0.7 from the whole row.
    common = dict(model="tiny", max_tokens=12, stream=stream, seed=5, extra_body={"ignore_eos": True, "top_k": 5})
    for temperature, greedy in ((0.0, True), (1.0, False), (0.7, False)):
        reply = client.chat.completions.create(messages=[{"role": "user", "content": "The quick brown"}],
                                               temperature=temperature, logprobs=True, top_logprobs=5, **common)
        chunks = reply if stream else [reply]
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert len(content) == 12 and _chat_entries_agree(content, greedy) == 12

        reply = client.completions.create(prompt="Hello world", temperature=temperature, logprobs=5, **common)
        chunks = reply if stream else [reply]
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        values = [v for lp in logprobs for v in lp.token_logprobs]
        tops = [top for lp in logprobs for top in lp.top_logprobs]
        assert len(tokens) == 12
        for token, value, top in zip(tokens, values, tops, strict=True):
            assert top[token] == value if greedy else top[token] >= value  # a better token may share its text
            if greedy:
                assert value == max(top.values())

    # Scoring a greedy continuation as lm-eval's loglikelihood does: echo, max_tokens 0, logprobs 1.
    tokenizer = Tokenizer.from_folder(str(tiny_model_dir))
    prompt = tokenizer.encode("The quick brown fox")
    generated = _greedy_ids(tiny_server, prompt, 6)
    if not stream:
        scored = client.completions.create(model="tiny", prompt=prompt + generated, max_tokens=0, echo=True,
                                           logprobs=1).choices[0].logprobs
        continuation = list(zip(scored.token_logprobs, scored.top_logprobs))[len(prompt):]
        assert len(continuation) == 6 and all(value == max(top.values()) for value, top in continuation)
        vllm = client.completions.create(model="tiny", prompt=prompt + generated, max_tokens=1,
                                         extra_body={"prompt_logprobs": 5}).choices[0].model_extra["prompt_logprobs"]
        for position, token in zip(vllm[len(prompt):], generated, strict=True):
            assert position[str(token)]["rank"] == 1
            assert position[str(token)]["logprob"] == max(entry["logprob"] for entry in position.values())


def _greedy_ids(server, prompt: list[int], max_tokens: int) -> list[int]:
    """The token ids the server's engine generates greedily for a token prompt."""
    from test_server import engine_token_ids

    return engine_token_ids(server, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
