"""Sampling from logits left on the GPU: only argmaxes, drawn tokens, candidates and exp sums come back to the host.

`DeviceLogits` is the sampler's `LogitSource` for a CuPy step (sampling.py): greedy rows get their argmax
(argmax_rows), other rows their best `count` tokens after temperature, sorted, and their exp sum (top_candidates in
kernels/sampling.cu, one block per row), which the host turns into the row's log-normaliser. Top-k and top-p rows
draw from those candidates; rows over the whole vocabulary (no top-k, no top-p: the OpenAI default, plain
temperature, min-p) walk their best TOP_P_CANDIDATES (= MAX_CANDIDATES) first against the exact exp sum. Both
kernels give exactly what NumPy computes from the same logits (`HostLogits`), so a seeded request samples the same
tokens on either backend. The rest is copied row by row: penalties, logprobs under a temperature other than 1, a
nucleus beyond the candidates, a whole-vocabulary draw that lands beyond them (with the probability of the mass
beyond the best 1024 tokens: small for a peaked row, nearly 1 for a flat one), or min-p keeping the last candidate.
A whole-vocabulary row without min-p or logprobs (the OpenAI default) is drawn on the device instead
(`whole_vocabulary_draws`: the same walk, the same integers): only its token comes back. For 64 rows of 151936
logits that is [64, C] ids and values (C = 1024 at the most: 512 KiB) instead of 39 MB.
"""

from __future__ import annotations

import numpy as np

from ..exact_softmax import fixed_point, log_normaliser, uniform_bits
from ..sampling import Candidates, LogitSource
from .base import Array, Backend
from .cupy_launch import NULL, launch

MAX_CANDIDATES = 1024  # MAX_CANDIDATES in sampling.cu: one row's candidates are sorted in shared memory
SELECT_THREADS = 1024  # SELECT_THREADS in sampling.cu


def draw_on_device(logits: Array, rows: Array, temperature: Array, draws: Array, tokens: Array) -> None:
    """top_candidates with draws, on the current stream: tokens[r] [R] int64 = the token of logits row rows[r]
    [R] int32 drawn over the whole vocabulary at temperature[r] [R] float32 with the uniform draws[r] / 2**53 [R]
    uint64: the walk of sampling._walk without min-p (the TOP_P_CANDIDATES best first, then the other ids), with the
    same integers. Rows whose temperature is not above 0 are skipped (tokens[r] left as it is)."""
    import cupy

    r, vocab = rows.shape[0], logits.shape[1]
    count = min(vocab, MAX_CANDIDATES)
    bits, cutoff = fixed_point(vocab)
    ids = cupy.empty((r, count), np.int32)  # [R, C] scratch
    values = cupy.empty((r, count), np.float32)  # [R, C] scratch
    sums = cupy.empty(r, np.uint64)  # [R] scratch
    launch("sampling.cu", "top_candidates", (r,), SELECT_THREADS,
            (logits, rows, temperature, np.int32(vocab), np.int32(count), np.int32(bits), np.float64(cutoff), ids,
             values, sums, draws, tokens))


class DeviceLogits(LogitSource):
    """A step's logits [B, V] float32 on the GPU, produced on `stream`; each request copies back only its answer.

    `argmax` may hold the rows' argmaxes already computed on the device (a decode graph's), else the backend's
    greedy kernel computes them when first asked.
    """

    max_candidates = MAX_CANDIDATES

    def __init__(self, logits: Array, backend: Backend, stream=None, argmax: Array | None = None):
        import cupy

        self.cp = cupy
        self.stream = stream if stream is not None else cupy.cuda.get_current_stream()
        with self.stream:
            self.logits = cupy.ascontiguousarray(logits)  # [B, V] float32
        self.backend = backend
        self._argmax = argmax  # [B] int64 on the device, or None
        self._finite = None  # [B] bool on the device once `finite` is asked

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[1]

    def rows(self, rows: np.ndarray) -> np.ndarray:
        with self.stream:
            return self.logits[self.cp.asarray(rows)].get(stream=self.stream)  # [R, V]

    def argmax(self, rows: np.ndarray) -> np.ndarray:
        with self.stream:
            if self._argmax is None:
                self._argmax = self.backend.greedy(self.logits)  # [B] int64
            return self._argmax.get(stream=self.stream)[rows]

    def finite(self, rows: np.ndarray, argmax: np.ndarray) -> np.ndarray:
        """LogitSource.finite from each row's maximum (CuPy's max propagates NaN; the greedy kernel's argmax skips
        it), taken for every row when first asked.  # [R] bool"""
        with self.stream:
            if self._finite is None:
                self._finite = self.cp.isfinite(self.logits.max(axis=1))  # [B] bool
            return self._finite.get(stream=self.stream)[rows]

    def values(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        cp = self.cp
        with self.stream:
            return self.logits[cp.asarray(rows), cp.asarray(token_ids)].get(stream=self.stream)  # [R]

    def whole_vocabulary_draws(self, rows: np.ndarray, temperature: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """Each row's token drawn on the device (`draw_on_device`); only the ids come back.  # [R] int64"""
        cp = self.cp
        with self.stream:
            tokens = cp.empty(len(rows), np.int64)  # [R]
            draw_on_device(self.logits, cp.asarray(rows, dtype=np.int32), cp.asarray(temperature, dtype=np.float32),
                           cp.asarray(uniform_bits(uniform)), tokens)
            return tokens.get(stream=self.stream)

    def candidates(self, rows: np.ndarray, temperature: np.ndarray, count: int, lse_rows: np.ndarray) -> Candidates:
        """Every row's exp sum comes with its candidates (lse_rows is not needed: the pass is cheap on a GPU)."""
        cp, vocab = self.cp, self.vocab_size
        if not 1 <= count <= min(vocab, MAX_CANDIDATES):
            raise ValueError(f"top_candidates serves 1 to {min(vocab, MAX_CANDIDATES)} candidates, not {count}")
        bits, cutoff = fixed_point(vocab)
        with self.stream:
            ids = cp.empty((len(rows), count), np.int32)  # [R, C]
            values = cp.empty((len(rows), count), np.float32)  # [R, C]
            sums = cp.empty(len(rows), np.uint64)  # [R]
            launch("sampling.cu", "top_candidates", (len(rows),), SELECT_THREADS,
                    (self.logits, cp.asarray(rows, dtype=np.int32), cp.asarray(temperature, dtype=np.float32),
                     np.int32(vocab), np.int32(count), np.int32(bits), np.float64(cutoff), ids, values, sums, NULL,
                     NULL))
            values = values.get(stream=self.stream)
            sums = sums.get(stream=self.stream).astype(np.int64)  # below 2**62 (fixed_point)
            return Candidates(ids.get(stream=self.stream).astype(np.int64), values,
                              log_normaliser(values[:, 0], sums, vocab), sums)
