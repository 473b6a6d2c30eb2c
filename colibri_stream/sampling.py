"""Pick the next token of every sequence in a batch from its logits, with NumPy on the host.

The semantics follow vLLM: logit bias and penalties (repetition over prompt and output, frequency and presence
over the output), then greedy argmax for temperature 0, otherwise temperature, top-k, top-p, min-p and a draw from
the sequence's own random generator. Logprobs describe the model's raw distribution (before bias, penalties and
temperature).

The logits may stay where the model left them (`LogitSource`): a row with top-k or top-p needs only its best
tokens, sorted (`Candidates`), and its log-normaliser; a greedy row only its argmax. A row sampled over the whole
vocabulary (no top-k, no top-p: the OpenAI default; plain temperature; min-p) needs its best TOP_P_CANDIDATES and
its exp sum, and its whole row only when the draw lands beyond them (`_walk`). Only rows with penalties, logprobs
under a temperature other than 1, more candidates than the source serves, a nucleus beyond the candidates, or a
whole-vocabulary draw beyond them (or min-p keeping the last candidate) need the whole row on the host.
`HostLogits` computes these pieces with NumPy and is the reference a device source must match bit for bit:
candidates are ordered by scaled logit, equal ones by lower id, and the log-normaliser is built from an integer
(`exp_sums`), so it does not depend on the order in which a device adds up a row.

A draw over the whole vocabulary walks the inverse CDF in this order: the best TOP_P_CANDIDATES tokens by scaled
logit (equal ones by lower id: the candidates' order), then every other token by id; each token weighs
floor(exp(x - max) * 2**bits) (`fixed_exp`, the terms of `exp_sums`), so the candidates' weights and the row's
total are exact integers on either processor and the walk ends on the same token whether or not the row is
copied. The distribution is the softmax's (to 2**-bits of the best token's weight); which token a given uniform
maps to follows this order, not the token ids'.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from .exact_softmax import _fraction, exp_sums, fixed_exp, fixed_point, log_normaliser, top_sorted
from .request import SamplingParams
from .structured import TokenConstraint

logger = logging.getLogger(__name__)

# Temperatures below this are greedy: dividing float32 logits by them would overflow.
GREEDY_TEMPERATURE = 1e-5
# Top-p without top-k first tries the best TOP_P_CANDIDATES tokens; only a row whose nucleus is larger sorts the
# whole vocabulary. Both give the same tokens: the nucleus is the same set. A draw over the whole vocabulary walks
# these many best tokens first (`_walk`): the order, and so the token a uniform maps to, depends on this number.
TOP_P_CANDIDATES = 1024
# A draw over the whole vocabulary weighs this many candidates first, the others only if it goes beyond them.
WALK_HEAD = 64
# Sampling from a whole row finds the draw's block of this many tokens first, then the token inside it.
CDF_BLOCK = 1024


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampling inputs: its parameters, its random generator and its token history.

    The caller appends every sampled token to `output_token_ids` (the penalties count them) and hands it to the
    constraint, if any.
    """

    params: SamplingParams
    generator: np.random.Generator
    prompt_token_ids: np.ndarray  # [P] int64
    output_token_ids: list[int] = field(default_factory=list)
    constraint: TokenConstraint | None = None  # where params.grammar is set: the tokens it allows next
    ending_token_ids: tuple[int, ...] = ()  # end-of-sequence and stop tokens: banned before params.min_tokens

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

    logprob: float  # a float32 value (`log_probabilities`), as each of top_logprobs
    top_token_ids: np.ndarray  # [k] int64, most likely first
    top_logprobs: np.ndarray  # [k] float32


@dataclass
class SamplerOutput:
    """The tokens picked for a batch, and their logprobs where the request asked for them."""

    token_ids: np.ndarray  # [B] int64; -1 in a failed row
    logprobs: list[TokenLogprobs | None]  # [B]: None where params.logprobs is None
    failures: dict[int, str] = field(default_factory=dict)  # row -> why it has no token (`Sampler.sample_from`)


@dataclass
class Candidates:
    """Some rows' best tokens after temperature, and each row's log-normaliser over its whole vocabulary."""

    token_ids: np.ndarray  # [R, C] int64: largest scaled logit first, equal ones by lower id first
    logits: np.ndarray  # [R, C] float32: those tokens' logits / the row's temperature (float32 division)
    lse: np.ndarray  # [R] float64: log_normaliser of the row's scaled logits; NaN where not asked for
    sums: np.ndarray  # [R] int64: exp_sums of the row's scaled logits, whose lse is; -1 where not asked for


class LogitSource(ABC):
    """A step's logits [B, V] float32, wherever the model left them; the sampler asks each row for what it needs."""

    max_candidates: int  # the most candidates per row `candidates` serves

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """V."""

    @abstractmethod
    def rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows [R] of the logits, on the host.  # [R, V] float32"""

    @abstractmethod
    def argmax(self, rows: np.ndarray) -> np.ndarray:
        """Each row's largest logit's id, the lowest among equal ones.  # [R] int64"""

    @abstractmethod
    def candidates(self, rows: np.ndarray, temperature: np.ndarray, count: int, lse_rows: np.ndarray) -> Candidates:
        """The `count` best tokens (count <= min(V, max_candidates)) of rows [R] after dividing each by its
        temperature [R] float32; the log-normaliser at least where lse_rows [R] bool is set."""

    @abstractmethod
    def values(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """The logit of token token_ids[r] [R] in row rows[r] [R], on the host.  # [R] float32"""

    def finite(self, rows: np.ndarray, argmax: np.ndarray) -> np.ndarray:
        """Whether each of rows [R] can be sampled: no NaN, no +inf, a value above -inf; given their argmaxes [R]
        (NumPy's argmax stops at the first NaN, so the value there is NaN, +inf or -inf exactly where the row is
        not; a source whose argmax skips NaN checks its rows whole).  # [R] bool"""
        return np.isfinite(self.values(rows, argmax))

    def whole_vocabulary_draws(self, rows: np.ndarray, temperature: np.ndarray,
                               uniform: np.ndarray) -> np.ndarray | None:
        """Tokens [R] int64 of rows [R] drawn over the whole vocabulary at temperatures [R] without min-p, with
        uniforms [R]: what `_walk` draws, where the source computes it itself; None where it does not (the
        sampler then walks the candidates)."""
        return None


class HostLogits(LogitSource):
    """Logits on the host, served with NumPy: the reference for every other source."""

    def __init__(self, logits: np.ndarray):
        self.logits = logits  # [B, V] float32
        self.max_candidates = logits.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[1]

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return self.logits[rows]

    def argmax(self, rows: np.ndarray) -> np.ndarray:
        return np.argmax(self._logits_of(rows), axis=1)

    def values(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return self.logits[rows, token_ids]

    def candidates(self, rows: np.ndarray, temperature: np.ndarray, count: int, lse_rows: np.ndarray) -> Candidates:
        logits = self._logits_of(rows)  # [R, V]
        scaled = logits if (temperature == 1.0).all() else logits / temperature[:, None]  # [R, V]: read only
        ids = top_sorted(scaled, count)  # [R, C]
        lse = np.full(len(rows), np.nan)  # [R]
        sums = np.full(len(rows), -1, dtype=np.int64)  # [R]
        asked = scaled if lse_rows.all() else scaled[lse_rows]  # [L, V]
        sums[lse_rows] = exp_sums(asked)
        lse[lse_rows] = log_normaliser(asked.max(axis=1), sums[lse_rows], scaled.shape[1])
        return Candidates(ids, np.take_along_axis(scaled, ids, axis=1), lse, sums)

    def _logits_of(self, rows: np.ndarray) -> np.ndarray:
        """The logits of rows [R]: [R, V], not copied when they are every row in order."""
        whole = len(rows) == len(self.logits) and bool((rows == np.arange(len(rows))).all())
        return self.logits if whole else self.logits[rows]


@dataclass
class _RowParams:
    """The sampling parameters of some rows, as arrays."""

    temperature: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] int64: 0 without top-k (also for k >= V, which keeps every token)
    top_p: np.ndarray  # [R] float64
    min_p: np.ndarray  # [R] float64
    logprobs: np.ndarray  # [R] int64: -1 without logprobs, else how many top tokens (at most V)
    penalised: np.ndarray  # [R] bool: a logit bias or a penalty changes its logits

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int) -> _RowParams:
        return cls(np.array([p.temperature for p in params], dtype=np.float32),
                   np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=np.int64),
                   np.array([p.top_p for p in params]), np.array([p.min_p for p in params]),
                   np.array([-1 if p.logprobs is None else min(p.logprobs, vocab) for p in params], dtype=np.int64),
                   np.array([_adjusts_logits(p) for p in params], dtype=bool))

    def take(self, rows: np.ndarray) -> _RowParams:
        return _RowParams(*(getattr(self, name)[rows] for name in self.__dataclass_fields__))

    @property
    def greedy(self) -> np.ndarray:  # [R] bool
        return self.temperature < GREEDY_TEMPERATURE


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
        return self.sample_from(HostLogits(np.asarray(logits, dtype=np.float32)), states)

    def sample_from(self, source: LogitSource, states: list[SamplingState]) -> SamplerOutput:
        """`sample` for logits held by `source`: the same tokens and logprobs, asking the source for argmaxes and
        candidates where they suffice and for whole rows only where they do not.

        A row that cannot be sampled fails alone (`SamplerOutput.failures`, token -1): its logits are not finite
        (the largest is NaN or infinite: corrupt weights, an overflow), no token is left after its grammar, bias
        and bans, or sampling it raises (its grammar failing, a parameter the sampler cannot serve); the other rows
        get the tokens and logprobs they would get without it."""
        every = np.arange(len(states))  # [B]
        best = source.argmax(every)  # [B]
        finite = source.finite(every, best)  # [B]
        if finite.all() and all(argmax_only(s.params) for s in states):  # the arrays below cost more here
            return SamplerOutput(best, [None] * len(states))
        params = _RowParams.of([s.params for s in states], source.vocab_size)
        uniform = np.array([0.0 if g else s.generator.random() for s, g in zip(states, params.greedy)])  # [B]
        out = SamplerOutput(np.full(len(states), -1, dtype=np.int64), [None] * len(states),
                            {int(b): NON_FINITE_LOGITS for b in np.flatnonzero(~finite)})
        try:
            _sample_selected(out, source, states, params, uniform, finite)
        except Exception:  # noqa: BLE001 - one row's failure: sampled again one row at a time to find it
            logger.warning("sampling a batch failed; sampling its rows one at a time", exc_info=True)
            for b in np.flatnonzero(finite):
                alone = every == b  # [B]
                out.token_ids[b] = -1
                try:
                    _sample_selected(out, source, states, params, uniform, alone)
                except Exception as error:  # noqa: BLE001 - this row's, reported for its request
                    logger.warning("sampling row %d failed", b, exc_info=True)
                    out.token_ids[b], out.logprobs[b] = -1, None
                    out.failures[int(b)] = f"sampling failed: {error}"
        return out


NON_FINITE_LOGITS = "the model's logits are not finite (NaN or infinity) for this sequence"
# the request's own constraints leave no token: its grammar (if any), its stop tokens and min_tokens' ban on them
NO_TOKEN_ALLOWED = "no token is allowed next: the output format and min_tokens' ban on stop tokens leave none"


def _sample_selected(out: SamplerOutput, source: LogitSource, states: list[SamplingState], params: _RowParams,
                     uniform: np.ndarray, selected: np.ndarray) -> None:
    """Sample the selected rows [B] bool of the batch into `out` (tokens, logprobs, and the rows left without a
    token in failures): from candidates where they suffice, else from whole rows on the host."""
    # Rows whose logprobs (of the raw logits) are not among their candidates (of the scaled ones) go whole.
    whole = params.penalised | ((params.logprobs >= 0) & ~params.greedy & (params.temperature != 1.0))  # [B]
    rows = np.flatnonzero(selected & ~whole)  # [S]
    out.token_ids[rows], served = _sample_rows(source, rows, params.take(rows), uniform[rows])
    for b, row_logprobs in zip(rows, served):
        out.logprobs[b] = row_logprobs
    rows = np.flatnonzero(selected & (out.token_ids < 0))  # [H]
    if rows.size:
        out.token_ids[rows], served = _sample_host(source.rows(rows), [states[b] for b in rows], params.take(rows),
                                                   uniform[rows])
        for b, row_logprobs, token in zip(rows, served, out.token_ids[rows]):
            out.logprobs[b] = row_logprobs
            if token < 0:
                out.failures[int(b)] = NO_TOKEN_ALLOWED


def _sample_rows(source: LogitSource, rows: np.ndarray, params: _RowParams, uniform: np.ndarray):
    """Tokens [R] for rows [R] of `source` from argmaxes and candidates (penalties are not applied), and the
    logprobs of the rows asking for them; token -1 where that is not enough: more candidates than the source
    serves, a nucleus beyond them. A draw over the whole vocabulary beyond the candidates copies its row (`_walk`)."""
    vocab = source.vocab_size
    greedy = params.greedy  # [R]
    token_ids = np.full(len(rows), -1, dtype=np.int64)  # [R]
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    argmax = greedy & (params.logprobs < 0)  # [R]
    if argmax.any():
        token_ids[argmax] = source.argmax(rows[argmax])
    full = ~greedy & (params.top_k == 0) & (params.top_p >= 1.0)  # [R]: drawn over the whole vocabulary
    # Candidates a row draws from: its top k, else the first TOP_P_CANDIDATES (top-p alone; the whole vocabulary
    # walks them first).
    draw = np.where(greedy, 1, np.where(params.top_k > 0, params.top_k, min(vocab, TOP_P_CANDIDATES)))  # [R]
    count = np.maximum(draw, params.logprobs)  # [R]
    temperature = np.where(greedy, np.float32(1.0), params.temperature)  # [R]; greedy rows: the raw logits
    lse_rows = (params.logprobs >= 0) | ((params.top_k == 0) & ~greedy)  # [R]
    drawn = full & (params.min_p <= 0.0) & (params.logprobs < 0)  # [R]: only a token asked, over the vocabulary
    if drawn.any():
        tokens = source.whole_vocabulary_draws(rows[drawn], temperature[drawn], uniform[drawn])
        if tokens is not None:
            token_ids[drawn] = tokens
    served = np.flatnonzero(~argmax & (token_ids < 0) & (count <= source.max_candidates))  # [S]
    while served.size:
        candidates = source.candidates(rows[served], temperature[served], int(count[served].max()),
                                       lse_rows[served])
        walked = full[served]  # [S]
        columns = _pick(candidates, draw[served], vocab, params.take(served), uniform[served], walked)  # [S]
        at = np.flatnonzero(columns >= 0)
        tokens = np.full(len(served), -1, dtype=np.int64)  # [S]
        values = np.zeros(len(served), dtype=np.float32)  # [S]: the tokens' scaled logits
        tokens[at], values[at] = candidates.token_ids[at, columns[at]], candidates.logits[at, columns[at]]
        at = np.flatnonzero(walked)
        if at.size:
            tokens[at], values[at] = _walk(source, rows[served[at]], candidates, at, temperature[served[at]],
                                           params.min_p[served[at]], uniform[served[at]])
        picked = tokens >= 0  # [S]
        token_ids[served[picked]] = tokens[picked]
        for s in np.flatnonzero(picked & (params.logprobs[served] >= 0)):
            logprobs[served[s]] = _token_logprobs(candidates, s, float(values[s]), int(params.logprobs[served[s]]))
        # A nucleus beyond TOP_P_CANDIDATES: a source that serves whole rows sorts them all.
        served = served[~picked] if source.max_candidates >= vocab else served[:0]
        draw[served] = count[served] = vocab
    return token_ids, logprobs


def _sample_host(logits: np.ndarray, states: list[SamplingState], params: _RowParams, uniform: np.ndarray):
    """Tokens [H] and logprobs of whole rows [H, V] on the host: penalties, then the same candidates and walks as
    any source; token -1 (and no logprobs) where the penalties left no token."""
    penalised = HostLogits(apply_penalties(logits, states))
    plain = replace(params, logprobs=np.full(len(states), -1))  # logprobs: of the raw logits, below
    token_ids = np.full(len(states), -1, dtype=np.int64)  # [H]; -1 where every token is banned
    left = np.flatnonzero(penalised.logits.max(axis=1) > -np.inf)  # [A]
    token_ids[left], _ = _sample_rows(penalised, left, plain.take(left), uniform[left])  # a host source serves all
    logprobs: list[TokenLogprobs | None] = [None] * len(states)
    asked = np.flatnonzero((params.logprobs >= 0) & (token_ids >= 0))  # [L]
    if asked.size:
        raw = HostLogits(logits).candidates(asked, np.ones(len(asked), dtype=np.float32),
                                            max(1, int(params.logprobs[asked].max())), np.ones(len(asked), bool))
        for a, h in enumerate(asked):
            logprobs[h] = _token_logprobs(raw, a, float(logits[h, token_ids[h]]), int(params.logprobs[h]))
    return token_ids, logprobs


def _pick(candidates: Candidates, draw: np.ndarray, vocab: int, params: _RowParams, uniform: np.ndarray,
          skip: np.ndarray):
    """Columns [S] of the candidates drawn under each row's top-k, top-p and min-p (column 0 for greedy rows),
    from the first draw [S] candidates of each; -1 where a top-p row's nucleus reaches beyond them, and for the
    rows to skip [S] bool."""
    columns = np.where(skip, -1, 0)  # [S]
    for m in np.unique(draw[~params.greedy & ~skip]):
        group = np.flatnonzero((draw == m) & ~params.greedy & ~skip)  # [G]
        values = candidates.logits[group, :m].astype(np.float64)  # [G, m]
        top_k, top_p = params.top_k[group], params.top_p[group]  # [G], [G]
        # Top-k renormalises over the k kept tokens; top-p alone measures mass against the whole vocabulary.
        norm = np.where(top_k > 0, _logsumexp(values), candidates.lse[group])  # [G]
        probs = np.exp(values - norm[:, None])  # [G, m], descending
        fits = (top_k > 0) | (m >= vocab) | (probs.sum(axis=1) >= top_p)  # [G]: the nucleus is among them
        mass_before = np.cumsum(probs, axis=1) - probs  # [G, m]
        # [G]; 1.0 must not drop a rounding tail, and 0 (as OpenAI takes it) keeps the most likely token alone
        cutoff = np.where(top_p < 1.0, np.maximum(top_p, np.finfo(np.float64).tiny), np.inf)
        probs[mass_before >= cutoff[:, None]] = 0.0  # the first token always stays: its mass before is 0
        probs[probs < params.min_p[group, None] * probs[:, :1]] = 0.0
        columns[group] = np.where(fits, _inverse_cdf(probs, uniform[group]), -1)
    return columns


def _walk(source: LogitSource, rows: np.ndarray, candidates: Candidates, which: np.ndarray,
          temperature: np.ndarray, min_p: np.ndarray, uniform: np.ndarray):
    """Tokens [G] int64 and their scaled logits [G] float32 drawn over the whole vocabulary, for rows [G] of
    `source` whose candidates (at least min(V, TOP_P_CANDIDATES), with exp sums) are rows `which` [G] of
    `candidates`, at temperatures [G] (float32), under min-p [G].

    The inverse CDF walks the first TOP_P_CANDIDATES candidates, then every other token by id. A token weighs
    `fixed_exp` of its scaled logit less the row's largest, 0 if that is below log(min_p) (a token less likely
    than min_p times the best), so the total of a row without min-p is its candidates' exp sum, and the draw,
    floor(uniform * total), is an exact integer: the walk ends on the same token in the candidates or beyond, and
    the row is copied (source.rows) only when it ends beyond them. Tokens beyond are no likelier than the last
    candidate: if min-p drops that, it drops them all; if min-p keeps it, the row is copied to know their total.
    """
    vocab = source.vocab_size
    m = min(vocab, TOP_P_CANDIDATES)
    bits, cutoff = fixed_point(vocab)
    top = candidates.logits[which, :1].astype(np.float64)  # [G, 1]: the largest scaled logit
    with np.errstate(divide="ignore"):
        lowest = np.log(min_p)  # [G]: below this (x - max) a token is dropped; -inf without min-p
    y = candidates.logits[which, :m] - top  # [G, m] float64, <= 0
    kept = y >= lowest[:, None]  # [G, m]
    closed = (m >= vocab) | ~kept[:, -1]  # [G]: no token beyond the candidates is kept
    known = closed | (min_p <= 0.0)  # [G]: the total is known without the row
    # The cumulative weights [G, m] of the first WALK_HEAD candidates, where most draws end; of the others only in
    # rows whose draw goes further or whose total is their candidates' (elsewhere the head's total, never reached).
    head = min(m, WALK_HEAD)
    mass = np.empty((len(which), m), dtype=np.int64)  # [G, m]
    np.cumsum(np.where(kept[:, :head], fixed_exp(y[:, :head], bits, cutoff), 0), axis=1, out=mass[:, :head])
    target = _fraction(uniform, candidates.sums[which])  # [G]: the draw, exact, where the exp sum is the total
    further = ~known | closed | (target >= mass[:, head - 1])  # [G]
    mass[~further, head:] = mass[~further, head - 1:head]
    if head < m and further.any():
        rest = np.flatnonzero(further)  # [F]
        weights = np.where(kept[rest, head:], fixed_exp(y[rest, head:], bits, cutoff), 0)  # [F, m - head]
        mass[rest, head:] = np.cumsum(weights, axis=1) + mass[rest, head - 1:head]
    target[closed] = _fraction(uniform[closed], mass[closed, -1])  # where not known, redrawn below
    columns = (mass <= target[:, None]).sum(axis=1)  # [G]: the first candidate whose cumulative weight exceeds it
    inside = known & (columns < m)  # [G]
    tokens = np.where(inside, candidates.token_ids[which, np.minimum(columns, m - 1)], -1)  # [G]
    values = candidates.logits[which, np.minimum(columns, m - 1)]  # [G] float32
    beyond = np.flatnonzero(~inside)  # [W]
    for g, row in zip(beyond, source.rows(rows[beyond]) if beyond.size else ()):
        scaled = row / temperature[g]  # [V] float32, as the candidates' logits
        y = scaled.astype(np.float64) - top[g]  # [V]
        kept = y >= lowest[g]  # [V]
        weights = np.where(kept, fixed_exp(y, bits, cutoff), 0)  # [V]
        weights[candidates.token_ids[which[g], :m]] = 0  # walked already
        tail = mass[g, -1] + np.cumsum(weights)  # [V]: the cumulative weight after the candidates, by id
        if not known[g]:
            target[g] = _fraction(uniform[g:g + 1], tail[-1:])[0]
            if target[g] < mass[g, -1]:
                column = int(np.searchsorted(mass[g], target[g], side="right"))
                tokens[g], values[g] = candidates.token_ids[which[g], column], candidates.logits[which[g], column]
                continue
        tokens[g] = np.searchsorted(tail, target[g], side="right")  # never a candidate: their weight is 0 here
        values[g] = scaled[tokens[g]]
    return tokens, values


def argmax_only(params: SamplingParams) -> bool:
    """Whether the token is the raw logits' argmax and nothing else is asked: greedy, no logprobs, logits as they
    are (`_sample_rows` takes `source.argmax` for such a row)."""
    return params.temperature < GREEDY_TEMPERATURE and params.logprobs is None and not _adjusts_logits(params)


def drawn_over_vocabulary(params: SamplingParams, vocab: int) -> bool:
    """Whether a row's token is a draw over the whole vocabulary that needs nothing but the row's uniform: sampled,
    no top-k (or one keeping every token), top-p, min-p, logprobs, penalties or bias. These are the rows
    `LogitSource.whole_vocabulary_draws` serves."""
    return (np.float32(params.temperature) >= GREEDY_TEMPERATURE and not 0 < params.top_k < vocab
            and params.top_p >= 1.0 and params.min_p <= 0.0 and params.logprobs is None
            and not _adjusts_logits(params))


def _adjusts_logits(params: SamplingParams) -> bool:
    """Whether `apply_penalties` changes this sequence's logits."""
    return bool(params.logit_bias) or params.grammar is not None or params.min_tokens > 0 or (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)


def apply_penalties(logits: np.ndarray, states: list[SamplingState]) -> np.ndarray:
    """Logits [B, V] with each row's logit bias and repetition, frequency and presence penalties applied (a copy
    if any).

    The logit bias comes first (as in vLLM): added to the logits of the tokens it names. Then repetition (over
    prompt and output tokens): positive logits are divided by the penalty, negative ones multiplied. Then frequency
    and presence (over output tokens): logit -= frequency * count + presence * (count > 0). Only the logits of
    tokens a sequence has seen or biased are touched. Last, -inf for the tokens a sequence may not draw now: those
    its grammar (structured output) does not allow next, and its ending tokens before min_tokens.
    """
    out = _penalised(logits, states)
    constrained = [b for b, s in enumerate(states) if s.constraint is not None]
    early = [b for b, s in enumerate(states) if len(s.output_token_ids) < s.params.min_tokens and s.ending_token_ids]
    if constrained or early:
        out = out.copy() if out is logits else out
        for b in constrained:
            out[b, ~states[b].constraint.allowed()] = -np.inf
        for b in early:
            out[b, list(states[b].ending_token_ids)] = -np.inf
    return out


def _penalised(logits: np.ndarray, states: list[SamplingState]) -> np.ndarray:
    """`apply_penalties` before the grammars: the bias and the penalties."""
    params = [s.params for s in states]
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)  # [B]
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)  # [B]
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)  # [B]
    biased = [b for b, p in enumerate(params) if p.logit_bias]
    rows = np.flatnonzero((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0))  # [P]
    if not rows.size and not biased:
        return logits
    vocab = logits.shape[1]
    out = logits.copy()  # [B, V]; penalised entries are addressed by flat index b * V + token
    for b in biased:
        token_ids, biases = zip(*params[b].logit_bias)
        np.add.at(out[b], list(token_ids), np.array(biases, dtype=np.float32))
    if not rows.size:
        return out
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


def token_logprobs(source: LogitSource, token_ids: np.ndarray, k: int) -> list[TokenLogprobs | None]:
    """Each row's log-probability of its token token_ids[r] [M] int64 and of its k most likely tokens under the raw
    model distribution (prompt logprobs), from the M rows of `source`: only those figures leave the device. None
    for a row whose logits are not finite (its largest is NaN or infinite)."""
    every = np.arange(len(token_ids))  # [M]
    rows = every[source.finite(every, source.argmax(every))]  # [F]
    out: list[TokenLogprobs | None] = [None] * len(token_ids)
    if not rows.size:
        return out
    best = source.candidates(rows, np.ones(len(rows), np.float32), min(max(k, 1), source.vocab_size),
                             np.ones(len(rows), bool))
    chosen = log_probabilities(source.values(rows, token_ids[rows]), best.lse)  # [F]
    top_logprobs = log_probabilities(best.logits[:, :k], best.lse[:, None])  # [F, k]
    for f, r in enumerate(rows):
        out[r] = TokenLogprobs(float(chosen[f]), best.token_ids[f, :k], top_logprobs[f])
    return out


def log_probabilities(logits: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """Log-probabilities [...] float32 of raw logits [...] float32 under their rows' log-normalisers lse (float64,
    broadcast to them): the one computation behind every logprob the sampler reports, so that a token's logprob
    and its own entry among the top ones are the same number."""
    return (np.asarray(logits, dtype=np.float32).astype(np.float64) - lse).astype(np.float32)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """[N, V] -> [N] log(sum(exp(x))) along the last axis, computed stably."""
    top = np.max(x, axis=1, keepdims=True)  # [N, 1]
    return (top + np.log(np.sum(np.exp(x - top), axis=1, keepdims=True)))[:, 0]


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


def _token_logprobs(candidates: Candidates, row: int, logit: float, k: int) -> TokenLogprobs:
    """The sampled token's (raw logit `logit`) and the first k candidates' log-probabilities of one row whose
    candidates are of its raw logits."""
    lse = candidates.lse[row]
    return TokenLogprobs(float(log_probabilities(np.float32(logit), lse)), candidates.token_ids[row, :k],
                         log_probabilities(candidates.logits[row, :k], lse))
