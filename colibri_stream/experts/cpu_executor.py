"""One routed expert's SiLU-gated MLP on the host CPU, reading the weights in their storage dtype.

`CpuExpertExecutor.run(x, tensors)` computes down(silu(gate x) * up x) for the tokens routed to one expert. With
numba installed (the `cpu` extra) it runs one compiled kernel over a pool of threads: each thread takes a
contiguous range of weight rows, 6 at a time, and multiplies them with 4 tokens at a time in registers (24 float32
accumulators; a single token with short rows: one row at a time), widening each weight to float32 inside the
multiply-add loop (bf16: the bits shifted into a float32; int8: a cast, the row scale applied to the dot product).
int4, fp8 and mxfp4 experts take cpu_grouped.grouped_expert_kernel, which decodes one weight row at a time. The
weights are read once, straight from their storage, and no float32 copy of them is made. Both kernels add the gate
and up biases of experts that have them before the activation (silu, or gpt-oss's clamped SwiGLU: jit.gated), the
down bias after. Without numba, or for fp16 experts, it dequantises to float32 and multiplies with NumPy. Measurements and the choice: docs/CPU_EXPERTS.md.
"""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np

from ..config import ClampedSwiglu
from ..expert_codecs import ExpertCodec, codec_of, dequantize_expert
from .cpu_grouped import grouped_expert_kernel, kernel_arguments
from .jit import CHUNKS_PER_THREAD, FASTMATH, activation_of, gated, numba
from .jit import jit as _jit
from .stats import ComputeStats

ROWS = 6  # weight rows per register tile (the hand-written _tile_* functions below)
# One token whose row is at most this long (16 KiB of float32, stays in L1) is multiplied one weight row at a
# time: a single sequential stream through each matrix, which the hardware prefetcher follows best (1.4-1.6x the
# 6-row tiles on Mixtral's gate/up, H 4096); longer rows (Mixtral's down, I 14336) take the tiles, which read
# the token once per 6 rows.
SINGLE_ROW_K = 4096
# Below this many weight bytes NumPy is as fast: the kernel's call and thread start cost more than the reads
# (the default model's small experts run faster end to end in NumPy; docs/CPU_EXPERTS.md).
MIN_KERNEL_BYTES = 1 << 20
KERNEL_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8), np.dtype(np.float32))


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, elementwise in float32."""
    return gate / (1.0 + np.exp(-gate)) * up


def intermediate_rows(tensors: dict[str, np.ndarray], first: int, last: int) -> dict[str, np.ndarray]:
    """One expert's tensors over intermediate rows first .. last - 1: gate and up rows (and their scales), down
    columns; down's per-row scales whole. Views where the format slices by rows (codecs.ExpertCodec.sliceable),
    else the rows of the float32 reference (dequantize_expert)."""
    if not codec_of(tensors).sliceable:
        tensors = dequantize_expert(tensors)
    sliced = {name: tensors[name][first:last] for name in ("gate", "up", "gate_scale", "up_scale") if name in tensors}
    sliced["down"] = tensors["down"][:, first:last]
    if "down_scale" in tensors:
        sliced["down_scale"] = tensors["down_scale"]
    return sliced


def expert_bytes(tensors: dict[str, np.ndarray], first: int, last: int) -> int:
    """The stored bytes an expert's part over intermediate rows first .. last - 1 reads: its share of the
    weights, and down's per-row scales whole."""
    share = (last - first) / tensors["gate"].shape[0]
    whole = sum(tensors[name].nbytes for name in ("down_scale", "down_zero") if name in tensors and
                tensors[name].ndim == 1)
    return int(round(share * (sum(t.nbytes for t in tensors.values()) - whole))) + whole


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's activation: g * sigmoid(alpha g) * (u + 1), g = gate clamped above at limit, u = up clamped to
    +-limit; elementwise in float32."""
    gate = np.minimum(gate, np.float32(limit))
    up = np.clip(up, -np.float32(limit), np.float32(limit))
    return gate / (1.0 + np.exp(-np.float32(alpha) * gate)) * (up + 1.0)


def numpy_expert(x: np.ndarray, tensors: dict[str, np.ndarray], swiglu: ClampedSwiglu | None = None) -> np.ndarray:
    """The reference: dequantise the three matrices to float32, multiply with NumPy, adding the expert's biases
    where it has them.  x [n, H] -> [n, H]"""
    weights = dequantize_expert(tensors)  # gate, up [I, H], down [H, I]; gate_bias, up_bias [I], down_bias [H]
    gate, up = x @ weights["gate"].T, x @ weights["up"].T  # [n, I] each
    if "gate_bias" in weights:
        gate, up = gate + weights["gate_bias"], up + weights["up_bias"]
    hidden = silu_mul(gate, up) if swiglu is None else clamped_swiglu(gate, up, swiglu.limit, swiglu.alpha)
    y = hidden @ weights["down"].T  # [n, H]
    return y + weights["down_bias"] if "down_bias" in weights else y


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _as_f32(typingctx, value):
        """One stored weight as float32: uint16 (bf16 bits) shifted into the high half of a float32's bits,
        int8 converted, float32 unchanged. One or two vector instructions once the loop is vectorised."""
        if value == types.uint16:
            def codegen(context, builder, signature, args):
                bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
                return builder.bitcast(bits, ir.FloatType())
        elif value == types.int8:
            def codegen(context, builder, signature, args):
                return builder.sitofp(args[0], ir.FloatType())
        elif value == types.float32:
            def codegen(context, builder, signature, args):
                return args[0]
        else:
            return None
        return types.float32(value), codegen

    @intrinsic
    def _claim(typingctx, counter):
        """counter[0] += 1, atomically; returns the value before (an int64 array shared by the threads)."""
        if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
            return None

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "monotonic")

        return types.int64(counter), codegen


# Register tiles: dot products of ROWS weight rows from o with tokens t.. of x, the weights widened inside the
# loop, which LLVM vectorises over i (AVX-512: 16 lanes per accumulator; 6x4 = 24 accumulators + 6 weights, no
# spills). Results in row-major order (row r, token k at r * tokens + k).
@_jit(inline="always", fastmath=FASTMATH)
def _tile_6x4(w, o, x, t, lo, hi):
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = np.float32(0.0)
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = np.float32(0.0)
    for i in range(lo, hi):
        w0, w1, w2 = _as_f32(w[o, i]), _as_f32(w[o + 1, i]), _as_f32(w[o + 2, i])
        w3, w4, w5 = _as_f32(w[o + 3, i]), _as_f32(w[o + 4, i]), _as_f32(w[o + 5, i])
        x0, x1, x2, x3 = x[t, i - lo], x[t + 1, i - lo], x[t + 2, i - lo], x[t + 3, i - lo]
        a00 += w0 * x0
        a01 += w0 * x1
        a02 += w0 * x2
        a03 += w0 * x3
        a10 += w1 * x0
        a11 += w1 * x1
        a12 += w1 * x2
        a13 += w1 * x3
        a20 += w2 * x0
        a21 += w2 * x1
        a22 += w2 * x2
        a23 += w2 * x3
        a30 += w3 * x0
        a31 += w3 * x1
        a32 += w3 * x2
        a33 += w3 * x3
        a40 += w4 * x0
        a41 += w4 * x1
        a42 += w4 * x2
        a43 += w4 * x3
        a50 += w5 * x0
        a51 += w5 * x1
        a52 += w5 * x2
        a53 += w5 * x3
    return (a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23,
            a30, a31, a32, a33, a40, a41, a42, a43, a50, a51, a52, a53)


@_jit(inline="always", fastmath=FASTMATH)
def _tile_6x2(w, o, x, t, lo, hi):
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = np.float32(0.0)
    for i in range(lo, hi):
        w0, w1, w2 = _as_f32(w[o, i]), _as_f32(w[o + 1, i]), _as_f32(w[o + 2, i])
        w3, w4, w5 = _as_f32(w[o + 3, i]), _as_f32(w[o + 4, i]), _as_f32(w[o + 5, i])
        x0, x1 = x[t, i - lo], x[t + 1, i - lo]
        a00 += w0 * x0
        a01 += w0 * x1
        a10 += w1 * x0
        a11 += w1 * x1
        a20 += w2 * x0
        a21 += w2 * x1
        a30 += w3 * x0
        a31 += w3 * x1
        a40 += w4 * x0
        a41 += w4 * x1
        a50 += w5 * x0
        a51 += w5 * x1
    return a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51


@_jit(inline="always", fastmath=FASTMATH)
def _tile_6x1(w, o, x, t, lo, hi):
    a0 = a1 = a2 = a3 = a4 = a5 = np.float32(0.0)
    for i in range(lo, hi):
        xi = x[t, i - lo]
        a0 += _as_f32(w[o, i]) * xi
        a1 += _as_f32(w[o + 1, i]) * xi
        a2 += _as_f32(w[o + 2, i]) * xi
        a3 += _as_f32(w[o + 3, i]) * xi
        a4 += _as_f32(w[o + 4, i]) * xi
        a5 += _as_f32(w[o + 5, i]) * xi
    return a0, a1, a2, a3, a4, a5


@_jit(inline="always", fastmath=FASTMATH)
def _dot(w, o, x, t, lo, hi):
    """w[o] · x[t]: the rows left over after the 6-row tiles."""
    acc = np.float32(0.0)
    for i in range(lo, hi):
        acc += _as_f32(w[o, i]) * x[t, i - lo]
    return acc


@_jit(fastmath=FASTMATH)
def _dots(w, o, rows, lo, hi, x, out):
    """out[t, r] = w[o + r, lo:hi] · x[t] for r < rows (ROWS, or fewer at the end) and every token t (x [n, hi - lo]).

    Tokens go 4 at a time, then 2, then 1: each weight row tile comes from RAM once and is re-read from L1/L2
    for the later token tiles. One token with rows of at most SINGLE_ROW_K goes one row at a time. (Not inlined
    into the kernel: its three call sites share one compiled copy of the tiles, 3 s of compile time per dtype
    instead of 8.)"""
    n = x.shape[0]
    if rows < ROWS or (n == 1 and hi - lo <= SINGLE_ROW_K):
        for r in range(rows):
            for t in range(n):
                out[t, r] = _dot(w, o + r, x, t, lo, hi)
        return
    t = 0
    while t + 4 <= n:
        a = _tile_6x4(w, o, x, t, lo, hi)
        for r in range(ROWS):
            for k in range(4):
                out[t + k, r] = a[r * 4 + k]
        t += 4
    if t + 2 <= n:
        a = _tile_6x2(w, o, x, t, lo, hi)
        for r in range(ROWS):
            for k in range(2):
                out[t + k, r] = a[r * 2 + k]
        t += 2
    if t < n:
        a = _tile_6x1(w, o, x, t, lo, hi)
        for r in range(ROWS):
            out[t, r] = a[r]


@_jit(parallel=True, fastmath=FASTMATH, nogil=True)
def expert_kernel(gate, up, down, gate_scale, up_scale, down_scale, gate_bias, up_bias, activation, x, first, last,
                  h, y, threads):
    """The expert's part over intermediate rows first .. last - 1 (all of it: 0 .. I), on `threads` threads, without
    the down projection's bias. gate, up [I, H], down [H, I] (uint16 bf16 bits, int8 or float32); scales [rows]
    float32 or [0]; gate_bias, up_bias [I] float32 or [0]; activation: jit.SILU or another (limit, alpha,
    up_shift); x [n, H] float32 in; h [n, last - first] float32 scratch; y [n, H] float32 out."""
    hidden = down.shape[0]
    width = x.shape[1]
    # Column bounds go to _dots as uint64: with a signed index numba checks for negative (wrap-around) indices in
    # the inner loop, which stops LLVM vectorising it (1.5x slower).
    n = x.shape[0]
    tiles = (last - first + ROWS - 1) // ROWS
    chunks = min(tiles, threads * CHUNKS_PER_THREAD)
    # Chunks handed out so far, one counter per pass: numba does not see _claim write them, so a reset between the
    # passes is a store it could move.
    claimed_gate_up = np.zeros(1, np.int64)
    claimed_down = np.zeros(1, np.int64)
    for _ in numba.prange(min(threads, chunks)):
        g = np.empty((n, ROWS), np.float32)
        u = np.empty((n, ROWS), np.float32)
        c = _claim(claimed_gate_up)
        while c < chunks:
            for tile in range(c * tiles // chunks, (c + 1) * tiles // chunks):
                o = first + tile * ROWS
                rows = min(ROWS, last - o)
                _dots(gate, o, rows, np.uint64(0), np.uint64(width), x, g)
                _dots(up, o, rows, np.uint64(0), np.uint64(width), x, u)
                for r in range(rows):
                    gs = gate_scale[o + r] if gate_scale.shape[0] else np.float32(1.0)
                    us = up_scale[o + r] if up_scale.shape[0] else np.float32(1.0)
                    gb = gate_bias[o + r] if gate_bias.shape[0] else np.float32(0.0)
                    ub = up_bias[o + r] if up_bias.shape[0] else np.float32(0.0)
                    for t in range(n):
                        h[t, o - first + r] = gated(g[t, r] * gs + gb, u[t, r] * us + ub, activation)
            c = _claim(claimed_gate_up)
    tiles = (hidden + ROWS - 1) // ROWS
    chunks = min(tiles, threads * CHUNKS_PER_THREAD)
    for _ in numba.prange(min(threads, chunks)):
        a = np.empty((n, ROWS), np.float32)
        c = _claim(claimed_down)
        while c < chunks:
            for tile in range(c * tiles // chunks, (c + 1) * tiles // chunks):
                o = tile * ROWS
                rows = min(ROWS, hidden - o)
                _dots(down, o, rows, np.uint64(first), np.uint64(last), h, a)
                for r in range(rows):
                    ds = down_scale[o + r] if down_scale.shape[0] else np.float32(1.0)
                    for t in range(n):
                        y[t, o + r] = a[t, r] * ds
            c = _claim(claimed_down)


def threads_beside_gpu() -> int:
    """The executor's threads where the thread that drives the GPU runs beside it (GPU expert slots): every core
    numba sees but one. On every core the step thread and the job's threads take turns on them, and batch-1
    offload decode is slower than with one core left to the step thread (BENCHMARKS.md)."""
    limit = numba.config.NUMBA_NUM_THREADS if numba is not None else os.cpu_count() or 1
    return max(1, limit - 1)


class CpuExpertExecutor:
    """Computes routed experts on host threads from weights in their storage dtype.

    num_threads: threads of the kernel (default: every core numba sees). Experts of fewer than min_kernel_bytes,
    fp16 experts, use_kernel=False or a missing numba take the NumPy path. `stats` counts the experts it
    computed, their seconds and the weight bytes read.
    """

    def __init__(self, num_threads: int | None = None, use_kernel: bool = True,
                 min_kernel_bytes: int = MIN_KERNEL_BYTES):
        self.kernel = expert_kernel if use_kernel and numba is not None else None
        limit = numba.config.NUMBA_NUM_THREADS if numba is not None else os.cpu_count() or 1
        self.num_threads = min(num_threads or limit, limit)
        self.min_kernel_bytes = min_kernel_bytes
        self.stats = ComputeStats()

    @property
    def library(self) -> str:
        return "numba" if self.kernel is not None else "numpy"

    def run(self, x: np.ndarray, tensors: dict[str, np.ndarray], rows: tuple[int, int] | None = None,
            swiglu: ClampedSwiglu | None = None) -> np.ndarray:
        """x [n, H] float32 -> down(silu(gate x) * up x) [n, H] float32, for one expert's tensors
        (gate [I, H], up [I, H], down [H, I], plus *_scale float32 rows for int8). rows (first, last): only the
        part over intermediate rows first .. last - 1 (gate and up rows, down columns); the parts over a
        partition of 0 .. I sum to the whole. Experts with biases (gate_bias, up_bias [I], down_bias [H] float32)
        or `swiglu` (gpt-oss's clamped SwiGLU in place of silu(gate) * up) are computed whole (no rows)."""
        if x.ndim != 2 or x.shape[1] != tensors["down"].shape[0]:
            raise ValueError(f"expert input of shape {x.shape} for an expert of hidden size {tensors['down'].shape[0]}")
        if rows is not None and (swiglu is not None or "down_bias" in tensors):
            raise ValueError("experts with biases or a clamped SwiGLU are computed whole, not by rows")
        start = time.perf_counter()
        first, last = rows or (0, tensors["gate"].shape[0])
        nbytes = expert_bytes(tensors, first, last)
        y = self._compute(x, tensors, first, last, nbytes, swiglu)
        self.record(1, time.perf_counter() - start, nbytes)
        return y

    def record(self, experts: int, seconds: float, nbytes: int) -> None:
        """Count expert computations done with this executor's kernel (`run`, or a CpuLayerWorker's job)."""
        self.stats.cpu_experts += experts
        self.stats.cpu_seconds += seconds
        self.stats.cpu_bytes_read += nbytes

    def _compute(self, x: np.ndarray, tensors: dict[str, np.ndarray], first: int, last: int, nbytes: int,
                 swiglu: ClampedSwiglu | None) -> np.ndarray:
        codec = codec_of(tensors)
        if not self.computes(codec, tensors["gate"].dtype, nbytes):
            whole = (first, last) == (0, tensors["gate"].shape[0])
            return numpy_expert(x, tensors if whole else intermediate_rows(tensors, first, last), swiglu)
        x = np.ascontiguousarray(x, dtype=np.float32)
        h = np.empty((x.shape[0], last - first), np.float32)  # [n, last - first]
        y = np.empty_like(x)  # [n, H]
        numba.set_num_threads(self.num_threads)
        none = np.empty(0, np.float32)  # no scales or biases
        gating = tensors.get("gate_bias", none), tensors.get("up_bias", none), activation_of(swiglu)
        if codec.cpu_kernel == "grouped":
            grouped_expert_kernel(*kernel_arguments(codec, tensors), *gating, x, first, first + h.shape[1], h, y,
                                  self.num_threads)
        else:
            gate, up, down = tensors["gate"], tensors["up"], tensors["down"]
            if gate.dtype == KERNEL_DTYPES[0]:  # bf16: the kernel reads the bits
                gate, up, down = gate.view(np.uint16), up.view(np.uint16), down.view(np.uint16)
            self.kernel(gate, up, down, tensors.get("gate_scale", none), tensors.get("up_scale", none),
                        tensors.get("down_scale", none), *gating, x, first, first + h.shape[1], h, y, self.num_threads)
        if "down_bias" in tensors:  # whole experts only (run): added once
            y += tensors["down_bias"]
        return y

    def computes(self, codec: ExpertCodec, dtype: np.dtype, nbytes: int) -> bool:
        """Whether experts of `codec` (stored as `dtype`) of `nbytes` weight bytes take a compiled kernel here:
        numba is there, the format has a kernel, and they are at least min_kernel_bytes."""
        has_kernel = codec.cpu_kernel == "grouped" or (codec.cpu_kernel == "plain" and dtype in KERNEL_DTYPES)
        return self.kernel is not None and has_kernel and nbytes >= self.min_kernel_bytes
