"""The CPU expert kernel for the formats with scales per group or tile (int4, fp8; experts/codecs.py).

`grouped_expert_kernel` computes down(silu(gate x) * up x) straight from the stored bytes: each thread takes a
range of weight rows; for each row it decodes the row into a float32 buffer of one row (L1-resident: int4 codes
minus the group's zero point, fp8 bytes through a 256-entry table, times the scale of the group or tile), then
multiplies it with every token. Each weight byte is read once per call, and no float32 copy of the expert is made.
Every matrix is passed as a 2D uint8 view of its bytes, [out, stored bytes per row], with its scales as
[scale rows, scale columns] float32 and zero points as [out, groups] uint8 ([0, 0]: none). A weight (o, c) takes
scale[o // rows_per_scale, c // cols_per_scale]: int4 1 x group width, fp8 tiles 128 x 128, fp8 channels
1 x (any width; CHANNEL_COLUMNS).
"""

from __future__ import annotations

import numpy as np

from .codecs import FP8, FP8_BLOCK, INT4_SYMMETRIC_ZERO, ExpertCodec, Fp8Codec, Int4Codec
from .jit import CHUNKS_PER_THREAD, FASTMATH, jit, numba

INT4, FP8_CODES = 0, 1  # `kind`: how a row's bytes hold its values
CHANNEL_COLUMNS = 1 << 30  # cols_per_scale of a per-row scale: every column of a row shares it
FP8_VALUES = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)  # [256] e4m3 byte -> float32


def kernel_arguments(codec: ExpertCodec, tensors: dict[str, np.ndarray]) -> tuple:
    """The kernel's arguments for one expert's tensors: kind, then per matrix (gate, up, down) its bytes, scales,
    zero points, rows and columns per scale."""
    if isinstance(codec, Int4Codec):
        kind = INT4
    elif isinstance(codec, Fp8Codec):
        kind = FP8_CODES
    else:
        raise ValueError(f"the grouped CPU kernel does not compute {codec.describe()} experts")
    arguments: list = [kind]
    no_zero = np.zeros((0, 0), np.uint8)
    for name in ("gate", "up", "down"):
        weight, scale = tensors[name], tensors[name + "_scale"]
        rows = weight.shape[0]
        data = weight.reshape(rows, -1).view(np.uint8)  # [out, bytes per row]
        if kind == INT4:  # [out, groups, width / 2]: a scale per group of `width` columns
            per_scale = (1, 2 * weight.shape[2])
        elif scale.ndim == 2:
            per_scale = (FP8_BLOCK, FP8_BLOCK)
        else:
            per_scale, scale = (1, CHANNEL_COLUMNS), scale.reshape(rows, 1)
        arguments += [data, scale, tensors.get(name + "_zero", no_zero), *per_scale]
    return tuple(arguments)


@jit(inline="always", fastmath=FASTMATH)
def _decode_row(kind, w, scale, zero, rows_per_scale, cols_per_scale, o, c0, c1, buf):
    """buf[c - c0] = the value of weight (o, c) for c0 <= c < c1, as float32."""
    scale_row = o // rows_per_scale
    for group in range(c0 // cols_per_scale, (c1 - 1) // cols_per_scale + 1):
        a, b = max(c0, group * cols_per_scale), min(c1, (group + 1) * cols_per_scale)
        s = scale[scale_row, group]
        if kind == INT4:
            z = np.float32(zero[o, group]) if zero.shape[0] else np.float32(INT4_SYMMETRIC_ZERO)
            for c in range(a, b):
                code = (w[o, c >> 1] >> ((c & 1) << 2)) & 15
                buf[c - c0] = (np.float32(code) - z) * s
        else:
            for c in range(a, b):
                buf[c - c0] = FP8_VALUES[w[o, c]] * s


@jit(inline="always", fastmath=FASTMATH)
def _dot(buf, x, t, width):
    acc = np.float32(0.0)
    for c in range(width):
        acc += buf[c] * x[t, c]
    return acc


@jit(parallel=True, fastmath=FASTMATH, nogil=True)
def grouped_expert_kernel(kind, gate, gate_scale, gate_zero, gate_rows, gate_cols, up, up_scale, up_zero, up_rows,
                          up_cols, down, down_scale, down_zero, down_rows, down_cols, x, first, last, h, y, threads):
    """The expert's part over intermediate rows first .. last - 1 (all of it: 0 .. I) on `threads` threads.
    x [n, H] float32 in; h [n, last - first] float32 scratch; y [n, H] float32 out."""
    n, width = x.shape
    hidden = y.shape[1]
    rows = last - first
    chunks = max(1, min(rows, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        g = np.empty(width, np.float32)  # one decoded gate row [H]
        u = np.empty(width, np.float32)  # and up row [H]
        for o in range(first + chunk * rows // chunks, first + (chunk + 1) * rows // chunks):
            _decode_row(kind, gate, gate_scale, gate_zero, gate_rows, gate_cols, o, 0, width, g)
            _decode_row(kind, up, up_scale, up_zero, up_rows, up_cols, o, 0, width, u)
            for t in range(n):
                gv, uv = _dot(g, x, t, width), _dot(u, x, t, width)
                h[t, o - first] = gv / (np.float32(1.0) + np.exp(-gv)) * uv
    chunks = max(1, min(hidden, threads * CHUNKS_PER_THREAD))
    for chunk in numba.prange(chunks):
        d = np.empty(rows, np.float32)  # one decoded down row's columns first .. last - 1
        for o in range(chunk * hidden // chunks, (chunk + 1) * hidden // chunks):
            _decode_row(kind, down, down_scale, down_zero, down_rows, down_cols, o, first, last, d)
            for t in range(n):
                y[t, o] = _dot(d, h, t, rows)
