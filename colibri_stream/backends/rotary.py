"""Rotary position embedding written once for any array module (`xp`: NumPy or CuPy): the NumPy backend's rotary,
and the CuPy backend's for latent attention's rope parts (the other heads' rotate inside attention_prologue.cu)."""

from __future__ import annotations

from typing import Any


def rotate(xp: Any, x: Any, cos: Any, sin: Any, positions: Any, interleaved: bool = False) -> Any:
    """x [T, heads, D], cos/sin tables [P, R/2], positions [T] -> x with its first R dimensions rotated ("rotate
    half" pairing within them: i with i + R/2) and the other D - R as they were. `interleaved` pairs 2i with
    2i + 1 instead, and lays the rotated pairs out as the rotate-half form does (first elements, then seconds),
    as transformers' interleaved rotary does: queries and keys alike, so their products are the same."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # [T, 1, R/2]
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]  # [T, heads, R/2] each
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]  # [T, heads, R/2] each
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1)
