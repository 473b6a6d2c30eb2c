"""One routed expert's SiLU-gated MLP on the host CPU, reading the weights in their storage dtype.

`CpuExpertExecutor.run(x, tensors)` computes down(silu(gate x) * up x) for the tokens routed to one expert. With
numba installed (the `cpu` extra) it runs one compiled kernel over a pool of threads: each thread widens a chunk
of weight rows (bf16 bits shifted into float32, int8 times its row scale) into a row buffer in L1 and takes the
dot products with every token there, so the weights are read once, at memory bandwidth, and never converted as a
whole matrix. Without numba, or for fp16 experts, it dequantises to float32 and multiplies with NumPy.
Measurements and the choice: docs/CPU_EXPERTS.md.
"""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np

try:
    import numba
except ImportError:  # the `cpu` extra is not installed: the NumPy path serves every expert
    numba = None

from .stats import ComputeStats

CHUNKS_PER_THREAD = 4  # row chunks per thread, so uneven thread speeds even out
# Below this many weight bytes NumPy is as fast: the kernel's call and thread start cost more than the reads
# (the default model's 49 KB experts ran 25 % slower end to end through the kernel; docs/CPU_EXPERTS.md).
MIN_KERNEL_BYTES = 1 << 20
KERNEL_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8), np.dtype(np.float32))


def dequantize(weight: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """A stored weight as float32: a cast, times the per-row scale for int8.  # [Out, In]"""
    if scale is None:
        return weight.astype(np.float32)
    return weight.astype(np.float32) * scale[:, None]


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, elementwise in float32."""
    return gate / (1.0 + np.exp(-gate)) * up


def numpy_expert(x: np.ndarray, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The reference: dequantise the three matrices to float32, multiply with NumPy.  x [n, H] -> [n, H]"""
    gate = dequantize(tensors["gate"], tensors.get("gate_scale"))  # [I, H]
    up = dequantize(tensors["up"], tensors.get("up_scale"))  # [I, H]
    down = dequantize(tensors["down"], tensors.get("down_scale"))  # [H, I]
    return silu_mul(x @ gate.T, x @ up.T) @ down.T


def _jit(**options):
    """numba.njit(**options), compiled on first call; the plain function when numba is missing."""
    return numba.njit(cache=True, **options) if numba is not None else (lambda function: function)


@_jit(inline="always", fastmath=True)
def _widen_row(w, row, bits, o, bf16):
    """Row o of w as float32 into `row` (bf16: the bits shifted into `bits`, the same memory)."""
    if bf16:
        for i in range(w.shape[1]):
            bits[i] = np.uint32(w[o, i]) << np.uint32(16)
    else:
        for i in range(w.shape[1]):
            row[i] = np.float32(w[o, i])


@_jit(inline="always", fastmath=True)
def _dot(row, x, t):
    """row · x[t] with a float32 accumulator (reassociated into SIMD lanes)."""
    acc = np.float32(0.0)
    for i in range(row.shape[0]):
        acc += row[i] * x[t, i]
    return acc


@_jit(parallel=True, fastmath=True, nogil=True)
def _expert_kernel(gate, up, down, gate_scale, up_scale, down_scale, bf16, x, h, y, threads):
    """threads: how many threads run it; gate, up [I, H], down [H, I] (uint16 bf16 bits, int8 or float32);
    scales [rows] float32 or [0];    x [n, H] float32 in; h [n, I] float32 scratch; y [n, H] float32 out."""
    inter, hidden = gate.shape
    n = x.shape[0]
    chunks = min(inter, threads * CHUNKS_PER_THREAD)
    for c in numba.prange(chunks):
        bits = np.empty(hidden, np.uint32)
        row = bits.view(np.float32)
        g = np.empty(n, np.float32)
        for o in range(c * inter // chunks, (c + 1) * inter // chunks):
            gs = gate_scale[o] if gate_scale.shape[0] else np.float32(1.0)
            us = up_scale[o] if up_scale.shape[0] else np.float32(1.0)
            _widen_row(gate, row, bits, o, bf16)
            for t in range(n):
                g[t] = _dot(row, x, t) * gs
            _widen_row(up, row, bits, o, bf16)
            for t in range(n):
                h[t, o] = g[t] / (np.float32(1.0) + np.exp(-g[t])) * (_dot(row, x, t) * us)
    chunks = min(hidden, threads * CHUNKS_PER_THREAD)
    for c in numba.prange(chunks):
        bits = np.empty(inter, np.uint32)
        row = bits.view(np.float32)
        for o in range(c * hidden // chunks, (c + 1) * hidden // chunks):
            ds = down_scale[o] if down_scale.shape[0] else np.float32(1.0)
            _widen_row(down, row, bits, o, bf16)
            for t in range(n):
                y[t, o] = _dot(row, h, t) * ds


class CpuExpertExecutor:
    """Computes routed experts on host threads from weights in their storage dtype.

    num_threads: threads of the kernel (default: every core numba sees). Experts of fewer than min_kernel_bytes,
    fp16 experts, use_kernel=False or a missing numba take the NumPy path. `stats` counts the experts it
    computed, their seconds and the weight bytes read.
    """

    def __init__(self, num_threads: int | None = None, use_kernel: bool = True,
                 min_kernel_bytes: int = MIN_KERNEL_BYTES):
        self.kernel = _expert_kernel if use_kernel and numba is not None else None
        limit = numba.config.NUMBA_NUM_THREADS if numba is not None else os.cpu_count() or 1
        self.num_threads = min(num_threads or limit, limit)
        self.min_kernel_bytes = min_kernel_bytes
        self.stats = ComputeStats()

    @property
    def library(self) -> str:
        return "numba" if self.kernel is not None else "numpy"

    def run(self, x: np.ndarray, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """x [n, H] float32 -> down(silu(gate x) * up x) [n, H] float32, for one expert's tensors
        (gate [I, H], up [I, H], down [H, I], plus *_scale float32 rows for int8)."""
        start = time.perf_counter()
        nbytes = sum(a.nbytes for a in tensors.values())
        y = self._compute(x, tensors, nbytes)
        self.stats.cpu_experts += 1
        self.stats.cpu_seconds += time.perf_counter() - start
        self.stats.cpu_bytes_read += nbytes
        return y

    def _compute(self, x: np.ndarray, tensors: dict[str, np.ndarray], nbytes: int) -> np.ndarray:
        gate, up, down = tensors["gate"], tensors["up"], tensors["down"]
        if self.kernel is None or gate.dtype not in KERNEL_DTYPES or nbytes < self.min_kernel_bytes:
            return numpy_expert(x, tensors)
        bf16 = gate.dtype == KERNEL_DTYPES[0]
        if bf16:
            gate, up, down = gate.view(np.uint16), up.view(np.uint16), down.view(np.uint16)
        no_scale = np.empty(0, np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        h = np.empty((x.shape[0], gate.shape[0]), np.float32)  # [n, I]
        y = np.empty_like(x)  # [n, H]
        numba.set_num_threads(self.num_threads)
        self.kernel(gate, up, down, tensors.get("gate_scale", no_scale), tensors.get("up_scale", no_scale),
                    tensors.get("down_scale", no_scale), bf16, x, h, y, self.num_threads)
        return y
