"""The integer arithmetic both samplers share, so that the host (NumPy) and the GPU (kernels/sampling.cu) pick the
same token from the same logits: each row's best tokens in a total order (`top_sorted`), its exp weights as
fixed-point integers (`fixed_exp`) and their exact sum (`exp_sums`, hence `log_normaliser`), and the draw as an
integer fraction of that sum (`uniform_bits`, `_fraction`).

An integer sum is the same in any order, and the exp is made of correctly rounded float64 operations only, so the
device computes the same bits as NumPy whatever order it adds a row in.
"""

from __future__ import annotations

import math

import numpy as np

# exp for exp_sums from + and * alone (kernels/sampling.cu has the same constants): exp(y) = 2**k * exp(r),
# k = rint(y * LOG2E), r = y - k * (LN2_HI + LN2_LO), exp(r) by its Taylor series to degree 11 (|r| <= 0.35:
# relative error below 1e-14).
LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # the high bits of log(2): k * LN2_HI is exact
LN2_LO = 1.90821492927058770002e-10
EXP_TAYLOR = tuple(1.0 / math.factorial(j) for j in range(12))
EXP_CHUNK = 1 << 14  # exp_sums works on pieces of this many values (their float64 temporaries stay in cache)


def uniform_bits(uniform: np.ndarray) -> np.ndarray:
    """Uniforms [R] in [0, 1), multiples of 2**-53 (as NumPy draws them), as the integers u * 2**53 that `_fraction`
    multiplies by.  # [R] uint64"""
    return (np.asarray(uniform, dtype=np.float64) * 2.0**53).astype(np.uint64)


def _fraction(uniform: np.ndarray, total: np.ndarray) -> np.ndarray:
    """floor(u * t) [G] int64, exact, of uniforms [G] in [0, 1) (multiples of 2**-53, as NumPy draws them) and
    integers t [G] below 2**63."""
    return np.array([(int(u * 2.0**53) * t) >> 53 for u, t in zip(uniform.tolist(), total.tolist())],
                    dtype=np.int64)


def top_sorted(x: np.ndarray, m: int) -> np.ndarray:
    """[G, V] -> [G, m] int64: the ids of each row's m largest values, largest first, equal ones by lower id."""
    rows, vocab = x.shape
    if m < vocab:
        kth = np.partition(x, vocab - m, axis=1)[:, vocab - m:vocab - m + 1]  # [G, 1]: the m-th largest value
        taken = x >= kth  # [G, V]
        crowded = np.flatnonzero(np.count_nonzero(taken, axis=1) > m)  # rows with more values equal to the m-th
        if crowded.size:  # than fit
            tied = x[crowded] == kth[crowded]  # [T, V]
            room = m - (x[crowded] > kth[crowded]).sum(axis=1, keepdims=True)  # [T, 1]: the tied values taken
            taken[crowded] &= ~tied | (np.cumsum(tied, axis=1) <= room)
        ids = np.flatnonzero(taken).reshape(rows, m)  # [G, m]: flat positions, ascending
        ids -= np.arange(0, rows * vocab, vocab)[:, None]
    else:
        ids = np.broadcast_to(np.arange(vocab), x.shape)
    # One int64 key per value, sorted: the value's order (descending) above, its id below, so equal values (-0.0
    # and +0.0 among them) go by lower id, and every key is distinct.
    bits = np.add(np.take_along_axis(x, ids, axis=1), np.float32(0.0)).view(np.int32)  # [G, m]; -0.0 -> +0.0
    descending = bits >> 31  # [G, m]: -1 for a negative value
    np.invert(descending, out=descending)
    descending |= np.int32(-2**31)
    descending ^= bits  # [G, m]: ~bits for a positive value, its magnitude for a negative one
    keys = descending.astype(np.int64)  # [G, m]
    keys <<= 32
    keys |= ids
    keys.sort(axis=1)
    keys &= 0xFFFFFFFF
    return keys


def fixed_point(vocab: int) -> tuple[int, float]:
    """(bits, cutoff) of `exp_sums` over rows of `vocab` values: each term is counted in units of 2**-bits, so
    that a row sums below 2**62; a value further than `cutoff` below the row's maximum counts 0."""
    bits = 62 - vocab.bit_length()
    return bits, -(bits + 2) * math.log(2)


def exp_sums(x: np.ndarray) -> np.ndarray:
    """[R, V] float32 -> [R] int64: sum over each row of floor(exp(x - max(x)) * 2**bits) (`fixed_point`,
    `fixed_exp`).

    An integer sum is the same in any order, and the exp is made of correctly rounded float64 operations only, so
    a GPU computes the same bits (top_candidates in kernels/sampling.cu). Computed in pieces of EXP_CHUNK values
    in the same three buffers, to stay in cache."""
    rows, vocab = x.shape
    bits, cutoff = fixed_point(vocab)
    top = x.max(axis=1, keepdims=True).astype(np.float64)  # [R, 1]
    sums = np.zeros(rows, dtype=np.int64)  # [R]
    per = max(1, EXP_CHUNK // vocab)  # rows per piece
    buffers = np.empty((3, min(per, rows), min(vocab, EXP_CHUNK)))  # y and fixed_exp's two
    for r0 in range(0, rows, per):
        for c0 in range(0, vocab, EXP_CHUNK):
            piece = x[r0:r0 + per, c0:c0 + EXP_CHUNK]  # [r, c]
            y, k, t = buffers[:, :piece.shape[0], :piece.shape[1]]
            np.subtract(piece, top[r0:r0 + per], out=y)
            sums[r0:r0 + per] += fixed_exp(y, bits, cutoff, (k, t)).sum(axis=1)
    return sums


def fixed_exp(y: np.ndarray, bits: int, cutoff: float, scratch: tuple[np.ndarray, np.ndarray] | None = None):
    """floor(exp(y) * 2**bits) [...] int64 of float64 values y <= 0, 0 where y < cutoff (`fixed_point`); y is
    overwritten, and so are the two scratch arrays of y's shape if given (fixed_exp in kernels/sampling.cu):
    exp(y) = 2**k * exp(r), k = rint(y * LOG2E), r = y - k * (LN2_HI + LN2_LO), exp(r) by Horner over its Taylor
    series.

    A value below the cutoff is raised to it, where exp(y) * 2**bits is about 1/4: it floors to 0. Scaling by
    2**(k + bits) (built from its exponent bits) is exact, and so is the conversion to int64 (a float64 of at
    most 2**62, not negative: truncation is floor)."""
    k, t = (np.empty_like(y), np.empty_like(y)) if scratch is None else scratch
    np.copyto(y, cutoff, where=y < cutoff)  # np.maximum(y, cutoff), three times faster
    np.rint(np.multiply(y, LOG2E, out=k), out=k)
    r = np.subtract(y, np.multiply(k, LN2_HI, out=t), out=y)
    r -= np.multiply(k, LN2_LO, out=t)  # |r| <= log(2) / 2
    p = np.multiply(r, EXP_TAYLOR[-1], out=t)  # Horner: (((c11 r + c10) r + ...) r + c1) r + c0
    for c in EXP_TAYLOR[-2:0:-1]:
        p += c
        p *= r
    p += EXP_TAYLOR[0]
    k += 2.0**52 + (1023 + bits)  # an integer of 52 bits: 2**52 + the biased exponent of 2**(k + bits)
    scale = k.view(np.int64)
    scale <<= 52  # its low bits to the exponent field: k is 2**(k + bits)
    p *= k
    return p.astype(np.int64)


def log_normaliser(top: np.ndarray, sums: np.ndarray, vocab: int) -> np.ndarray:
    """log(sum(exp(x))) [R] float64 of rows given their maximum [R] and `exp_sums` [R]."""
    return top.astype(np.float64) + (np.log(sums.astype(np.float64)) - fixed_point(vocab)[0] * math.log(2))
