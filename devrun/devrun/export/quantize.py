"""Symmetric per-output-channel int8 quantisation of routed-expert weights.

Each row of a weight matrix [out, in] (one output channel) gets its own float32 scale, max|row| / 127, so the
row's largest magnitude maps to ±127; an all-zero row gets scale 1. Dequantised weight = q * scale, and the
error of every element is at most scale / 2.
"""

from __future__ import annotations

import numpy as np

QMAX = 127


def quantize_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise float32 rows.  weight [rows, cols] -> (q [rows, cols] int8, scale [rows] float32)"""
    amax = np.max(np.abs(weight), axis=1)  # [rows]
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)  # [rows]
    q = np.clip(np.rint(weight / scale[:, None]), -QMAX, QMAX).astype(np.int8)  # [rows, cols]
    return q, scale

