"""Pick the next token of every sequence in a batch from its logits, on the host with NumPy.

The semantics follow vLLM: penalties (repetition over prompt and output, frequency and presence over the output),
then greedy argmax for temperature 0, otherwise temperature, top-k, top-p, min-p and a draw from the sequence's
own random generator. Logprobs describe the model's raw distribution (before penalties and temperature).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from .request import SamplingParams

# Temperatures below this are greedy: dividing float32 logits by them would overflow.
GREEDY_TEMPERATURE = 1e-5
# Top-p without top-k first tries the best TOP_P_CANDIDATES tokens; only a row whose nucleus is larger sorts the
# whole vocabulary. Both give the same tokens: the nucleus is the same set.
TOP_P_CANDIDATES = 1024
# Sampling from a whole row finds the draw's block of this many tokens first, then the token inside it.
CDF_BLOCK = 1024


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampling inputs: its parameters, its random generator and its token history.

    The caller appends every sampled token to `output_token_ids` (the penalties count them).
    """

    params: SamplingParams
    generator: np.random.Generator
    prompt_token_ids: np.ndarray  # [P] int64
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_params(cls, params: SamplingParams, prompt_token_ids: Iterable[int], index: int = 0) -> SamplingState:
        """A fresh state; the generator is seeded with params.seed (+ index, the sequence's number among the
        request's n, so the n sequences differ) modulo 2**64, NumPy taking no negative seed; or, without a seed,
        from fresh entropy."""
        seed = None if params.seed is None else (params.seed + index) % 2**64
        return cls(params, np.random.default_rng(seed), np.fromiter(prompt_token_ids, dtype=np.int64))


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the most likely tokens', under the raw model distribution."""

    logprob: float
    top_token_ids: np.ndarray  # [k] int64, most likely first
    top_logprobs: np.ndarray  # [k] float32


@dataclass
class SamplerOutput:
    """The tokens picked for a batch, and their logprobs where the request asked for them."""

    token_ids: np.ndarray  # [B] int64
    logprobs: list[TokenLogprobs | None]  # [B]: None where params.logprobs is None


class Sampler:
    """Turns a batch of next-token logits into tokens, one row per sequence, each with its own parameters.

    Rows are grouped by what they need (greedy, a sorted candidate list, the full vocabulary) and each group is
    handled with whole-array operations. A row's token depends only on its logits, its history and its own
    generator, never on the other rows of the batch, so a seeded request gives the same tokens in any batch.
    """

    def sample(self, logits: np.ndarray, states: list[SamplingState]) -> SamplerOutput:
        """logits: [B, V] float32, row b for states[b]. Draws one number from each non-greedy row's generator."""
        if logits.ndim != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [batch, vocab] with one row per state, got {logits.shape}")
        logits = np.asarray(logits, dtype=np.float32)
        logprob_rows = [b for b, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = log_softmax(logits[logprob_rows])  # [L, V]

        logits = apply_penalties(logits, states)
        temperature = np.array([s.params.temperature for s in states], dtype=np.float32)  # [B]
        greedy = temperature < GREEDY_TEMPERATURE  # [B]
        token_ids = np.empty(len(states), dtype=np.int64)  # [B]
        token_ids[greedy] = np.argmax(logits[greedy], axis=1)
        rows = np.flatnonzero(~greedy)  # [R]
        if rows.size:
            scaled = logits[rows] / temperature[rows, None]  # [R, V]
            token_ids[rows] = _sample_rows(scaled, [states[b] for b in rows])

        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        for row_logprobs, b in zip(raw_logprobs, logprob_rows):
            logprobs[b] = _token_logprobs(row_logprobs, int(token_ids[b]), states[b].params.logprobs)
        return SamplerOutput(token_ids, logprobs)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[N, V] -> [N, V] log-probabilities along the last axis (float32)."""
    return logits - _logsumexp(logits)[:, None]


def apply_penalties(logits: np.ndarray, states: list[SamplingState]) -> np.ndarray:
    """Logits [B, V] with each row's repetition, frequency and presence penalties applied (a copy if any).

    Repetition (over prompt and output tokens): positive logits are divided by the penalty, negative ones
    multiplied. Then frequency and presence (over output tokens): logit -= frequency * count + presence * (count > 0).
    Only the logits of tokens a sequence has seen are touched.
    """
    params = [s.params for s in states]
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)  # [B]
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)  # [B]
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)  # [B]
    rows = np.flatnonzero((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0))  # [P]
    if not rows.size:
        return logits
    vocab = logits.shape[1]
    out = logits.copy()  # [B, V]; penalised entries are addressed by flat index b * V + token
    output = np.concatenate([b * vocab + np.asarray(states[b].output_token_ids, dtype=np.int64) for b in rows])
    repeated = rows[repetition[rows] != 1.0]
    if repeated.size:
        seen = np.unique(np.concatenate([output] + [b * vocab + states[b].prompt_token_ids for b in repeated]))
        seen = seen[repetition[seen // vocab] != 1.0]  # [S]
        penalty, value = repetition[seen // vocab], out.flat[seen]  # [S], [S]
        out.flat[seen] = np.where(value > 0, value / penalty, value * penalty)
    tokens, counts = np.unique(output, return_counts=True)  # [U], [U]
    row = tokens // vocab  # [U]
    out.flat[tokens] -= frequency[row] * counts + presence[row]
    return out


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """[N, V] -> [N] log(sum(exp(x))) along the last axis, computed stably."""
    top = np.max(x, axis=1, keepdims=True)  # [N, 1]
    return (top + np.log(np.sum(np.exp(x - top), axis=1, keepdims=True)))[:, 0]


def _sample_rows(scaled: np.ndarray, states: list[SamplingState]) -> np.ndarray:
    """Token ids [R] drawn from temperature-scaled logits [R, V] under each row's top-k, top-p and min-p."""
    num_rows, vocab = scaled.shape
    top_k = np.array([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states])  # [R]
    top_p = np.array([s.params.top_p for s in states])  # [R] float64
    min_p = np.array([s.params.min_p for s in states])  # [R] float64
    uniform = np.array([s.generator.random() for s in states])  # [R] float64 in [0, 1)
    # Candidates per row: the top k, or for a top-p row the shortest prefix known to hold its nucleus; 0: all, unsorted.
    num_candidates = np.where(top_k < vocab, top_k, np.where(top_p < 1.0, vocab, 0))  # [R]
    lse = np.zeros(num_rows)  # [R]; the full log-normaliser, needed by rows with top-p but no top-k
    measured = np.flatnonzero(num_candidates == vocab)  # [M]
    lse[measured] = _logsumexp(scaled[measured])
    if measured.size and vocab > TOP_P_CANDIDATES:
        best = -np.partition(-scaled[measured], TOP_P_CANDIDATES - 1, axis=1)[:, :TOP_P_CANDIDATES]  # [M, C]
        mass = np.exp(best - lse[measured, None]).sum(axis=1)  # [M]
        num_candidates[measured[mass >= top_p[measured]]] = TOP_P_CANDIDATES

    out = np.empty(num_rows, dtype=np.int64)  # [R]
    for m in np.unique(num_candidates):
        group = np.flatnonzero(num_candidates == m)  # [G]
        x = scaled[group]  # [G, V]
        if m == 0:  # neither top-k nor top-p: the whole vocabulary, in token order
            probs = np.exp(x - x.max(axis=1, keepdims=True))  # [G, V] unnormalised, the most likely at 1
            probs[probs < min_p[group, None]] = 0.0
            out[group] = _inverse_cdf(probs, uniform[group])
            continue
        ids = _top_sorted(x, int(m))  # [G, m] token ids, most likely first
        values = np.take_along_axis(x, ids, axis=1).astype(np.float64)  # [G, m]
        # Top-k renormalises over the k kept tokens; top-p alone measures mass against the whole vocabulary.
        norm = np.where(top_k[group] < vocab, _logsumexp(values), lse[group])  # [G]
        probs = np.exp(values - norm[:, None])  # [G, m], descending
        mass_before = np.cumsum(probs, axis=1) - probs  # [G, m]
        cutoff = np.where(top_p[group] < 1.0, top_p[group], np.inf)  # [G]; 1.0 must not drop a rounding tail
        probs[mass_before >= cutoff[:, None]] = 0.0  # the first token always stays: top_p > 0
        probs[probs < min_p[group, None] * probs[:, :1]] = 0.0
        picks = _inverse_cdf(probs, uniform[group])  # [G]
        out[group] = ids[np.arange(len(group)), picks]
    return out


def _top_sorted(x: np.ndarray, m: int) -> np.ndarray:
    """[G, V] -> [G, m] int64: the ids of each row's m largest values, largest first."""
    ids = np.argpartition(-x, m - 1, axis=1)[:, :m] if m < x.shape[1] else np.broadcast_to(np.arange(m), x.shape)
    order = np.argsort(-np.take_along_axis(x, ids, axis=1), axis=1, kind="stable")  # [G, m]
    return np.take_along_axis(ids, order, axis=1).astype(np.int64)


def _inverse_cdf(probs: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """[G, N] unnormalised probabilities (zeros never picked), [G] uniforms in [0, 1) -> [G] column indices.

    Two levels, so no row needs a sequential cumulative sum over the whole vocabulary: find the block of
    CDF_BLOCK columns that holds the draw, then the column inside it.
    """
    num_rows, n = probs.shape
    width = min(CDF_BLOCK, n)
    r = np.arange(num_rows)  # [G]
    starts = np.arange(0, n, width)  # [K]
    sums = np.add.reduceat(probs, starts, axis=1, dtype=np.float64)  # [G, K]
    block_cdf = np.cumsum(sums, axis=1)  # [G, K]
    target = uniform * block_cdf[:, -1]  # [G]
    last_block = len(starts) - 1 - np.argmax(sums[:, ::-1] > 0, axis=1)  # [G]: a draw rounded up to the total
    block = np.minimum((block_cdf <= target[:, None]).sum(axis=1), last_block)  # [G]
    cols = starts[block][:, None] + np.arange(width)  # [G, W]
    values = np.where(cols < n, probs[r[:, None], np.minimum(cols, n - 1)], 0.0)  # [G, W]
    inner = np.cumsum(values, axis=1, dtype=np.float64)  # [G, W]
    remaining = target - (block_cdf[r, block] - sums[r, block])  # [G]: the draw measured from the block start
    last_col = width - 1 - np.argmax(values[:, ::-1] > 0, axis=1)  # [G]
    return starts[block] + np.minimum((inner <= remaining[:, None]).sum(axis=1), last_col)


def _token_logprobs(row: np.ndarray, token_id: int, k: int) -> TokenLogprobs:
    """The sampled token's and the top-k tokens' entries of one row of log-probabilities [V]."""
    top = _top_sorted(row[None, :], k)[0] if k else np.empty(0, dtype=np.int64)  # [k]
    return TokenLogprobs(float(row[token_id]), top, row[top])
