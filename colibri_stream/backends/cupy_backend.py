"""The GPU backend: CuPy arrays and our own CUDA kernels (kernels/*.cu, compiled at run time by kernels.py).

Numerics: activations and every accumulation are float32; the KV cache is in its own dtype (bfloat16 by default,
float16, fp8 e4m3 as uint8 bits, float32), rounded when written and widened when attention loads it. Weight
matrices stay in their storage dtype (bfloat16, float16, float32; routed experts also int8 with per-row float32
scales) and are widened in registers as they are loaded; vectors (norm weights, biases) are held as float32.
bfloat16 arrays are CuPy uint16 arrays of the same bits (CuPy has no bfloat16 arithmetic); `storage_type` names
their CUDA type for the kernels.

Dense projections of up to SMALL_BATCH tokens run on our GEMV kernel (linear.cu), which reads each weight once for
all the tokens; larger ones go to cuBLAS on tensor cores: float32 activations are split into a bf16 (or fp16) high
and low part (x = hi + lo to about 16 significant bits) multiplied as one GEMM of twice the rows, so the result
stays within about 1e-5 of float32 while each weight is still read once. CuPy refuses cuBLAS calls while a stream
captures a CUDA graph, so inside a capture bf16/fp16 projections of DENSE_MMA_MIN_TOKENS tokens or more run on our
tensor-core kernel (linear_mma.cu: the same hi/lo split, the columns split over enough blocks to fill the GPU),
except lm_head-sized ones, which call cuBLAS through ctypes (captured_cublas.py), and the others on linear_rows.
Routed experts are held per layer as stacked device arrays (DeviceExpertStore), and the MoE kernels read the
routing from device memory, so a decode step needs no host synchronisation and can be captured in a CUDA graph
(cuda_graph.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..config import QK_NORMS, ModelConfig
from ..experts.store import ExpertStore
from ..model.batch import ForwardBatch
from ..memory import MemoryInfo
from .base import Array, Backend
from .cupy_flash_attention import (FLASH_FILE, FLASH_THREADS, FlashTileCache, flash_attention_launch,
                                   flash_instantiations, takes_flash_attention)
from .kernels import get_kernel
from .launch import launch_programmatic, programmatic_active

SMALL_BATCH = 4  # up to this many tokens (or in a graph capture off tensor cores), projections use linear_rows
TOKEN_TILES = (1, 2, 4, 8)  # linear_rows instantiations: tokens per block
MOE_TILES = (1, 2, 4, 8)  # moe_gate_up / moe_down instantiations: pairs of one expert per pass
LINEAR_ROWS_PER_BLOCK = 2  # LINEAR_ROWS in linear.cu
MOE_WARPS = 4  # warps per block of the MoE kernels (moe.cu)
MOE_ROWS_PER_WARP = (1, 2, 4)  # moe_gate_up / moe_down instantiations: weight rows per warp
# A warp of moe.cu takes rows of its matrix until they hold this many bytes (up to 4 rows): moe_gate_up (gate and
# up rows each) and moe_down. H200 graph replays at batch 1 (decode_h200_row_bytes.json): Mixtral's down rows two
# at a time (56 KiB) 1983 -> 1935 us; gate/up rows up to 16 KiB 1.5-2.1 % slower on both shapes.
MOE_UP_ROW_BYTES = 8192
MOE_DOWN_ROW_BYTES = 65536
MMA_MIN_TOKENS = 8  # from this many tokens a step, bf16/fp16 routed experts run on tensor cores (moe_mma.cu)
MMA_TILES = (1, 2, 4)  # moe_gate_up_mma / moe_down_mma instantiations: n-tiles of 8 pairs per pass over the weights
MMA_THREADS = 128  # MMA_WARPS * 32 in moe_mma.cu
MMA_GATE_UP_ROWS = 64  # gate (and up) rows per block of moe_gate_up_mma: 4 warps x 16
MMA_DOWN_ROWS = 128  # down rows per block of moe_down_mma: 4 warps x 32
ATTENTION_WARPS = 16  # ATTN_WARPS in attention.cu
GQA_WARPS = 4  # GQA_WARPS in attention.cu: warps per block of paged_attention_gqa
GQA_GROUPS = (1, 2, 4, 8, 16)  # paged_attention_gqa instantiations: query heads per KV head, rounded up to one
GQA_MAX_LANE_FLOATS = 64  # G * DPL (q floats per lane, as many accumulators) above this: paged_attention instead
GQA_MAX_SPLITS = 16  # paged_attention_gqa splits a context over at most this many blocks (then a merge launch)
GQA_BLOCKS_PER_SM = 2  # ... and over as many as make T * K * splits about this many blocks per multiprocessor
GQA_MIN_SPLIT_KEYS = 16  # ... with at least this many keys per split at the tables' full width
GQA_MIN_TOKENS = 2  # a single token takes paged_attention: 8.4 against 9.0-9.6 us a layer on the H200 (batch 16:
# 25-27 against 14-15 us; eadfe2f's decode run)
DENSE_MMA_MIN_TOKENS = 4  # from this many tokens, captured bf16/fp16 projections run on linear_mma (H200: from 4)
CAPTURED_CUBLAS_MIN_TOKENS = 8  # ... and from this many, those of CAPTURED_CUBLAS_MIN_ROWS rows or more (lm_head) on
CAPTURED_CUBLAS_MIN_ROWS = 16384  # cuBLAS (captured_cublas.py; H200: 1.05-1.95x linear_mma at 8-16 tokens, 5.5x at 64)
CAPTURED_CUBLAS_ALL_MIN_TOKENS = 32  # ... and from this many, every captured bf16/fp16 projection (H200 graph
# replays, decode_h200_row_bytes.json and decode_h200_cublas_all.json: steps 5.9-6.1 % faster at 64 tokens, 0.8-3.7 %
# at 32, 1-5 % slower at 16)
LINEAR_MMA_TILES = (1, 2, 4, 8)  # linear_mma instantiations: n-tiles of 8 tokens per pass over the weights
LINEAR_MMA_ROWS = 128  # output rows per block of linear_mma: 4 warps x 32
LINEAR_MMA_BLOCKS_PER_SM = 4  # blocks of 48 KiB shared memory a multiprocessor runs at once: what the splits fill
LINEAR_MMA_MIN_SPAN = 128  # columns per split at least (four 32-column chunks)
ROUTER_SPLIT_TOKENS = 64  # up to this many tokens, route_split spreads the router's rows over the GPU
ROUTER_TILE = 4  # route_split's tokens per block at most: its last block of a tile selects for them, a warp a token,
# so 4 (ROUTER_WARPS) select in one round. H200 at 16 tokens: 14.5 -> 9.5 us a layer (Qwen3), 8.3 -> 5.6 (Mixtral)
ROUTER_WARPS = 4  # ROUTER_WARPS in router.cu
PROLOGUE_WARPS = 4  # warps per block of qk_norm_rope_write (attention_prologue.cu) without a full-width qk norm
NULL = np.uint64(0)  # a null pointer kernel argument

_CTYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.uint16): "__nv_bfloat16",
    np.dtype(np.float16): "__half",
    np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "__nv_fp8_e4m3",  # KV caches only
}
_DEVICE_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16, "float8_e4m3": np.uint8}

# The instantiations compiled together with a kernel of each templated file, for weight type w.
_FAMILIES = {
    "linear.cu": lambda w: (*(f"linear_rows<{w}, {tt}>" for tt in TOKEN_TILES), f"to_storage<{w}>",
                            f"to_storage_split<{w}>"),
    "embedding.cu": lambda w: (f"embedding<{w}>",),
    "router.cu": lambda w: (f"route_topk<{w}>", *(f"route_split<{w}, {tt}>" for tt in TOKEN_TILES)),
    # w None: moe_align and moe_sum only
    "moe.cu": lambda w: () if w is None else tuple(f"{k}<{w}, {tt}, {r}>" for k in ("moe_gate_up", "moe_down")
                                                   for tt in MOE_TILES for r in MOE_ROWS_PER_WARP),
    "moe_mma.cu": lambda w: tuple(f"{k}<{w}, {nt}>" for k in ("moe_gate_up_mma", "moe_down_mma")
                                  for nt in MMA_TILES) if w in ("__nv_bfloat16", "__half") else (),
    "linear_mma.cu": lambda w: tuple(f"linear_mma<{w}, {nt}>" for nt in LINEAR_MMA_TILES)
    if w in ("__nv_bfloat16", "__half") else (),
    # w: the KV cache's element type (float, __nv_bfloat16, __half, __nv_fp8_e4m3)
    "attention.cu": lambda w: (*(f"paged_attention<{w}, {d}>" for d in (1, 2, 4, 8)),
                               *(f"paged_attention_gqa<{w}, {d}, {g}>" for d in (1, 2, 4, 8) for g in GQA_GROUPS
                                 if g * d <= GQA_MAX_LANE_FLOATS), "paged_attention_merge"),
    "attention_prologue.cu": lambda w: (f"qk_norm_rope_write<{w}>",),
    "kv_cache.cu": lambda w: (f"write_kv<{w}>",),
    FLASH_FILE: flash_instantiations,  # w: the KV cache's element type
}


def cuda_available() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False


def storage_type(array: Array) -> str:
    """The CUDA type of a device weight array's elements."""
    return _CTYPES[np.dtype(array.dtype)]


def to_device_storage(array) -> Array:
    """A weight (host NumPy in any storage dtype, or already a device array) as a contiguous device array of a
    kernel-readable dtype (bfloat16 as uint16 bits, fp8 e4m3 as uint8 bits)."""
    import cupy

    if isinstance(array, np.ndarray):
        if array.dtype == ml_dtypes.bfloat16:
            array = array.view(np.uint16)
        elif array.dtype == ml_dtypes.float8_e4m3fn:
            array = array.view(np.uint8)
        return cupy.asarray(np.ascontiguousarray(array))
    return cupy.ascontiguousarray(array)


def _check_row_width(cols: int, array: Array, what: str) -> None:
    vector = 16 // np.dtype(array.dtype).itemsize
    if cols % vector:
        raise ValueError(f"{what}: rows of {cols} {storage_type(array)} elements are not a multiple of {vector} "
                         "(the kernels read 16 bytes at a time)")


def _launch(file: str, expression: str, grid: tuple[int, ...], block: int, args: tuple, shared_mem: int = 0,
            weight_type: str | None = None) -> None:
    if 0 in grid:
        return
    family = _FAMILIES[file](weight_type) if file in _FAMILIES else ()
    kernel = get_kernel(file, expression, family)
    if programmatic_active():  # a decode graph's capture (launch.py)
        launch_programmatic(kernel, grid, (block,), args, shared_mem)
    else:
        kernel(grid, (block,), args, shared_mem=shared_mem)


def moe_rows_per_warp(row_bytes: int, budget: int) -> int:
    """Weight rows each warp of moe.cu takes: as many of MOE_ROWS_PER_WARP as hold `budget` bytes together."""
    return max([r for r in MOE_ROWS_PER_WARP if r == 1 or r * row_bytes <= budget])


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tile(count: int, tiles: tuple[int, ...]) -> int:
    """The smallest tile that holds `count` rows (the largest tile when none does)."""
    return next((tile for tile in tiles if tile >= count), tiles[-1])


def _on_tensor_cores(weight: Array, tokens: int) -> bool:
    """Whether a step's routed experts run on moe_mma.cu (tensor cores) instead of moe.cu (CUDA cores).

    moe.cu reads each weight once per group of up to 8 pairs but multiplies in float32 on CUDA cores, so once the
    experts' groups hold several pairs it is bound by FMAs and activation loads, not HBM (BENCHMARKS.md: Mixtral at
    batch 16 and 64 streams experts at 1.4 TB/s). The mma kernels need bf16 or fp16 weights (the tensor cores'
    operand types; float32 and int8 experts stay on moe.cu) and pay a fixed cost per 8-pair tile, which only
    several pairs per expert repay: at T tokens a group averages T * k / E pairs, so below MMA_MIN_TOKENS the
    GEMV, already near the copy bandwidth at batch 1, keeps them.
    """
    return tokens >= MMA_MIN_TOKENS and np.dtype(weight.dtype) in (np.dtype(np.uint16), np.dtype(np.float16))


@dataclass
class LayerExperts:
    """A MoE layer's experts on the device as one launch of the MoE kernels sees them: matrices indexed by slot.

    Resident experts are views of stacked [E, 2I, H] and [E, H, I] arrays (slot = expert id, no table); experts
    in GPU slots are views of the slot arena in experts.bin's block layout, and `slot_of` maps expert ids to slots
    (negative: not computed by this launch). Rows are contiguous; gate and up share one stride per slot.
    """

    gate: Array  # [S, I, H] storage dtype
    up: Array  # [S, I, H]
    down: Array  # [S, H, I]
    gate_scale: Array | None  # [S, I] float32 per-row scales (int8 experts), else None
    up_scale: Array | None  # [S, I]
    down_scale: Array | None  # [S, H]
    slot_of: Array | None = None  # [E] int32

    @classmethod
    def stacked(cls, w13: Array, w2: Array, s13: Array | None, s2: Array | None) -> LayerExperts:
        """Views of stacked arrays w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], s13 [E, 2I], s2 [E, H]."""
        i = w2.shape[2]
        return cls(w13[:, :i], w13[:, i:], w2, None if s13 is None else s13[:, :i],
                   None if s13 is None else s13[:, i:], s2)

    def kernel_args(self) -> tuple[tuple, tuple]:
        """(gate/up arguments, down arguments) of moe_gate_up and moe_down: pointers and strides per slot."""
        def stride(array: Array | None) -> np.int64:
            return np.int64(0 if array is None else array.strides[0] // array.itemsize)

        def pointer(array: Array | None):
            return NULL if array is None else np.uint64(array.data.ptr)

        if self.gate.strides != self.up.strides:
            raise ValueError("gate and up of a layer's experts must share their strides")
        slot_of = pointer(self.slot_of)
        gate_up = (pointer(self.gate), pointer(self.up), stride(self.gate), pointer(self.gate_scale),
                   pointer(self.up_scale), stride(self.gate_scale), slot_of)
        down = (pointer(self.down), stride(self.down), pointer(self.down_scale), stride(self.down_scale), slot_of)
        return gate_up, down


class DeviceExpertStore(ExpertStore):
    """Every routed expert resident in GPU memory, stacked per MoE layer (`passes(l)` gives the one launch's view)."""

    resident = True  # every expert computed in one launch, on the GPU

    def __init__(self, layers: dict[int, LayerExperts]):
        self.layers = layers
        self.num_experts = next(iter(layers.values())).gate.shape[0] if layers else 0

    @classmethod
    def upload(cls, store: ExpertStore, layers: Iterable[int], num_experts: int) -> DeviceExpertStore:
        """Copy experts 0..num_experts-1 of each layer from `store` (host or device arrays) into stacked arrays."""
        import cupy

        stacked = {}
        for layer in layers:
            w13 = w2 = s13 = s2 = None
            for expert in range(num_experts):
                tensors = store.expert(layer, expert)
                gate, up, down = (to_device_storage(tensors[n]) for n in ("gate", "up", "down"))  # [I, H], [I, H], [H, I]
                if w13 is None:
                    i, h = gate.shape
                    quantized = "gate_scale" in tensors
                    w13 = cupy.empty((num_experts, 2 * i, h), gate.dtype)  # [E, 2I, H]: gate rows, then up rows
                    w2 = cupy.empty((num_experts, h, i), gate.dtype)  # [E, H, I]
                    s13 = cupy.empty((num_experts, 2 * i), np.float32) if quantized else None  # [E, 2I]
                    s2 = cupy.empty((num_experts, h), np.float32) if quantized else None  # [E, H]
                if not gate.dtype == up.dtype == down.dtype == w13.dtype:
                    raise ValueError(f"expert ({layer}, {expert}) has tensors of another dtype than expert 0")
                i = gate.shape[0]
                w13[expert, :i] = gate
                w13[expert, i:] = up
                w2[expert] = down
                if s13 is not None:
                    s13[expert, :i] = cupy.asarray(tensors["gate_scale"], dtype=np.float32)
                    s13[expert, i:] = cupy.asarray(tensors["up_scale"], dtype=np.float32)
                    s2[expert] = cupy.asarray(tensors["down_scale"], dtype=np.float32)
            stacked[layer] = LayerExperts.stacked(w13, w2, s13, s2)
        return cls(stacked)

    def passes(self, layer: int) -> Iterable[LayerExperts]:
        """The launches of the MoE kernels for `layer`'s step: one, over every expert."""
        return (self.layers[layer],)

    def finish_layer(self, layer: int) -> None:
        """Nothing is computed elsewhere: every expert is resident (returns None)."""

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """One expert's tensors copied back to the host, in the storage layout ExpertStore promises."""
        import cupy

        arrays = self.layers[layer]

        def host(array: Array) -> np.ndarray:
            values = cupy.asnumpy(array)
            return values.view(ml_dtypes.bfloat16) if values.dtype == np.uint16 else values

        tensors = {"gate": host(arrays.gate[expert]), "up": host(arrays.up[expert]), "down": host(arrays.down[expert])}
        if arrays.gate_scale is not None:
            tensors.update(gate_scale=host(arrays.gate_scale[expert]), up_scale=host(arrays.up_scale[expert]),
                           down_scale=host(arrays.down_scale[expert]))
        return tensors


class CupyBackend(Backend):
    """CuPy arrays on the current CUDA device, computed with the kernels of kernels/*.cu."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        self._silu_mul = cupy.ElementwiseKernel("float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u",
                                                "colibri_silu_mul")
        self._sigmoid = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 1.0f / (1.0f + expf(-x))",
                                               "colibri_sigmoid")
        self.multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # [token tiles] route_split's block counters (tiles of one token up): zero between launches (each launch
        # resets what it counted)
        self._route_counters = cupy.zeros(ROUTER_SPLIT_TOKENS, np.uint32)
        self.captured_cublas = True  # lm_head-sized projections of a capture on cuBLAS (off: on linear_mma)
        self._flash_tiles = FlashTileCache()

    # ---- memory -------------------------------------------------------------------------------------------
    def prepare_weight(self, host) -> Array:
        if host.ndim == 1:  # norm weights and biases: float32
            if isinstance(host, np.ndarray):
                host = host.astype(np.float32)
            return self.cp.asarray(host, dtype=np.float32)
        return to_device_storage(host)

    def upload(self, host: np.ndarray) -> Array:
        return self.cp.asarray(host)

    def to_host(self, array: Array) -> np.ndarray:
        return self.cp.asnumpy(array)

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array:
        return self.cp.zeros(shape, dtype=_DEVICE_DTYPES[dtype])

    def memory_info(self) -> MemoryInfo:
        """The current GPU's free and total bytes, counting blocks CuPy's memory pool holds unused as free."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return MemoryInfo(free + self.cp.get_default_memory_pool().free_bytes(), total, host=False)

    def random_weight(self, shape: tuple[int, ...], std: float, seed: int, dtype: str) -> Array:
        values = self.cp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)  # [shape]
        values *= np.float32(std)
        return self.from_float32(values, dtype)

    def from_float32(self, values: Array, dtype: str) -> Array:
        """float32 device values rounded to a storage dtype (float32, bfloat16 as uint16 bits, float16)."""
        if dtype == "float32":
            return values
        out = self.cp.empty(values.shape, _DEVICE_DTYPES[dtype])
        w = storage_type(out)
        _launch("linear.cu", f"to_storage<{w}>", (_ceil(values.size, 256),), 256,
                (self.cp.ascontiguousarray(values), out, np.int64(values.size)), weight_type=w)
        return out

    # ---- dense layers -------------------------------------------------------------------------------------
    def embedding(self, table: Array, token_ids: Array) -> Array:
        t, h = token_ids.shape[0], table.shape[1]
        out = self.cp.empty((t, h), np.float32)  # [T, H]
        w = storage_type(table)
        _launch("embedding.cu", f"embedding<{w}>", (t,), 256, (table, token_ids, out, np.int32(h)), weight_type=w)
        return out

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        return self._rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm(x, residual, weight, eps)

    def _rms_norm(self, x: Array, residual: Array | None, weight: Array, eps: float) -> tuple[Array, Array | None]:
        x = self.cp.ascontiguousarray(x)
        n = x.shape[-1]
        out = self.cp.empty_like(x)  # [..., N]
        summed = None if residual is None else self.cp.empty_like(x)  # [..., N]
        args = (x, NULL if residual is None else self.cp.ascontiguousarray(residual), weight, out,
                NULL if summed is None else summed, np.int32(n), np.float32(eps))
        threads = min(1024, 32 * _ceil(n, 4 * 32))  # about four elements per thread
        _launch("norm.cu", "rms_norm", (x.size // n,), threads, args)
        return out, summed

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        return self.linears(x, [weight], [bias])[0]

    def linears(self, x, weights, biases):
        """Up to three matrices of one dtype on the same path are one launch (linear_rows or linear_mma)."""
        x = self.cp.ascontiguousarray(x)
        paths = {self._dense_path(x, w) for w in weights}
        if not weights or len(weights) > 3 or len({w.dtype for w in weights}) > 1 or len(paths) > 1:
            return super().linears(x, weights, biases)
        path = paths.pop()
        if path == "gemv":
            return self._linear_rows(x, weights, biases)
        if path == "mma":
            return self._linear_mma(x, weights, biases)
        outs = [self._gemm(x, weight) for weight in weights]  # [T, Out_m] each
        for out, bias in zip(outs, biases):
            if bias is not None:
                out += bias
        return outs

    def _dense_path(self, x: Array, weight: Array) -> str:
        """How x [T, In] is multiplied by `weight`: "mma" (linear_mma) inside a graph capture from
        DENSE_MMA_MIN_TOKENS tokens with bf16/fp16 weights, except lm_head-sized ones from CAPTURED_CUBLAS_MIN_TOKENS
        and every one from CAPTURED_CUBLAS_ALL_MIN_TOKENS (cuBLAS, while `captured_cublas` is on); eager steps of
        that size compile linear_mma, for the capture.
        "gemv" (linear_rows) for few tokens or other captures, "cublas" otherwise."""
        tokens, capturing = x.shape[0], self.cp.cuda.get_current_stream().is_capturing()
        if tokens >= DENSE_MMA_MIN_TOKENS and np.dtype(weight.dtype) in (np.dtype(np.uint16), np.dtype(np.float16)):
            if capturing:
                large = weight.shape[0] >= CAPTURED_CUBLAS_MIN_ROWS or tokens >= CAPTURED_CUBLAS_ALL_MIN_TOKENS
                if self.captured_cublas and tokens >= CAPTURED_CUBLAS_MIN_TOKENS and large:
                    return "cublas"
                return "mma"
            w = storage_type(weight)  # an eager step (a graph's warm-up) compiles it for the capture
            get_kernel("linear_mma.cu", f"linear_mma<{w}, 1>", _FAMILIES["linear_mma.cu"](w))
        return "gemv" if tokens <= SMALL_BATCH or capturing else "cublas"

    def column_splits(self, n_in: int, row_blocks: int) -> int:
        """Column spans of linear_mma for `row_blocks` blocks of output rows: enough blocks to fill every
        multiprocessor (LINEAR_MMA_BLOCKS_PER_SM each), each span at least LINEAR_MMA_MIN_SPAN columns."""
        wanted = round(self.multiprocessors * LINEAR_MMA_BLOCKS_PER_SM / row_blocks)
        return max(1, min(wanted, n_in // LINEAR_MMA_MIN_SPAN))

    def _linear_mma(self, x: Array, weights, biases) -> list[Array]:
        """x [T, In] times one to three bf16/fp16 weights [Out_m, In] of one dtype (+ biases) in one launch of
        linear_mma, split over the columns.  # [T, Out_m] each"""
        t, n_in = x.shape
        n_outs = [weight.shape[0] for weight in weights]
        for weight in weights:
            _check_row_width(n_in, weight, "linear")
        row_blocks = sum(_ceil(n, LINEAR_MMA_ROWS) for n in n_outs)
        splits = self.column_splits(n_in, row_blocks)
        span = 32 * _ceil(n_in, 32 * splits)
        splits = _ceil(n_in, span)
        # [T * sum(Out_m)]: several splits add into it, so it starts at zero
        flat = (self.cp.zeros if splits > 1 else self.cp.empty)(t * sum(n_outs), np.float32)
        outs, matrices, start = [], [], 0
        for weight, bias, n_out in zip(weights, biases, n_outs):
            outs.append(flat[start:start + t * n_out].reshape(t, n_out))  # [T, Out_m]
            start += t * n_out
            matrices += [weight, NULL if bias is None else bias, outs[-1], np.int32(n_out)]
        matrices += [NULL, NULL, NULL, np.int32(0)] * (3 - len(weights))
        w = storage_type(weights[0])
        n_tiles = _tile(_ceil(t, 8), LINEAR_MMA_TILES)
        _launch("linear_mma.cu", f"linear_mma<{w}, {n_tiles}>", (row_blocks, splits), MMA_THREADS,
                (x, np.int32(t), np.int32(n_in), np.int32(span), *matrices), weight_type=w)
        return outs

    def _linear_rows(self, x: Array, weights, biases) -> list[Array]:
        """x [T, In] times one to three weights [Out_m, In] of one dtype (+ biases) in one launch.  # [T, Out_m] each"""
        t, n_in = x.shape
        outs, matrices, blocks = [], [], 0
        tile = _tile(t, TOKEN_TILES)
        for weight, bias in zip(weights, biases):
            _check_row_width(n_in, weight, "linear")
            n_out = weight.shape[0]
            outs.append(self.cp.empty((t, n_out), np.float32))  # [T, Out_m]
            matrices += [weight, NULL if bias is None else bias, outs[-1], np.int32(n_out)]
            blocks += _ceil(t, tile) * _ceil(n_out, LINEAR_ROWS_PER_BLOCK)
        matrices += [NULL, NULL, NULL, np.int32(0)] * (3 - len(weights))
        w = storage_type(weights[0])
        _launch("linear.cu", f"linear_rows<{w}, {tile}>", (blocks,), 128, (x, np.int32(t), np.int32(n_in), *matrices),
                weight_type=w)
        return outs

    def _gemm(self, x: Array, weight: Array) -> Array:
        """x [T, In] @ weight [Out, In]^T through cuBLAS, float32 accumulation and output.  # [T, Out]"""
        t, n_in = x.shape
        n_out = weight.shape[0]
        if weight.dtype == np.float32:
            return self.cp.matmul(x, weight.T)
        from cupy.cuda import runtime
        from cupy_backends.cuda.libs import cublas

        w = storage_type(weight)
        halves = self.cp.empty((2 * t, n_in), weight.dtype)  # [2T, In]: x rounded, then the rounding error
        _launch("linear.cu", f"to_storage_split<{w}>", (_ceil(x.size, 256),), 256, (x, halves, np.int64(x.size)),
                weight_type=w)
        both = self.cp.empty((2 * t, n_out), np.float32)  # [2T, Out]
        code = runtime.CUDA_R_16BF if weight.dtype == np.uint16 else runtime.CUDA_R_16F
        handle = self.cp.cuda.device.get_cublas_handle()
        # Column-major view: both^T [Out, 2T] = weight [Out, In] (row-major, so transposed) times halves^T [In, 2T].
        shape = (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n_out, 2 * t, n_in)
        if self.cp.cuda.get_current_stream().is_capturing():  # CuPy's wrappers refuse; cuBLAS records into it
            from .captured_cublas import gemm_ex

            gemm_ex(handle, self.cp.cuda.get_current_stream().ptr, *shape, weight.data.ptr, code, n_in,
                    halves.data.ptr, code, n_in, both.data.ptr, runtime.CUDA_R_32F, n_out,
                    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        else:
            one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
            cublas.gemmEx(handle, *shape, one.ctypes.data, weight.data.ptr, code, n_in, halves.data.ptr, code, n_in,
                          zero.ctypes.data, both.data.ptr, runtime.CUDA_R_32F, n_out,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        return self.cp.add(both[:t], both[t:])

    def silu_mul(self, gate: Array, up: Array) -> Array:
        return self._silu_mul(gate, up)

    def sigmoid(self, x: Array) -> Array:
        return self._sigmoid(x)

    def clip(self, x: Array, limit: float) -> Array:
        return self.cp.clip(x, -limit, limit)

    # ---- attention ----------------------------------------------------------------------------------------
    def rotary(self, x: Array, cos: Array, sin: Array, positions: Array) -> Array:
        x = self.cp.ascontiguousarray(x)
        t, heads, d = x.shape
        out = self.cp.empty_like(x)  # [T, heads, D]
        _launch("rope.cu", "rotary", (t,), 256, (x, out, cos, sin, positions, np.int32(heads), np.int32(d // 2)))
        return out

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping, kv_scales=(1.0, 1.0)) -> None:
        t = key.shape[0]
        width = key_cache.shape[2] * key_cache.shape[3]
        kv_type = storage_type(key_cache)
        _launch("kv_cache.cu", f"write_kv<{kv_type}>", (t,), 128,
                (self.cp.ascontiguousarray(key), self.cp.ascontiguousarray(value), key_cache, value_cache,
                 slot_mapping, np.int32(width), np.float32(kv_scales[0]), np.float32(kv_scales[1])),
                weight_type=kv_type)

    def qk_norm_rope_write(self, q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, positions, key_cache,
                           value_cache, slot_mapping, kv_scales=(1.0, 1.0)):
        """One launch of qk_norm_rope_write: a warp per head (q, k and v heads). Without a full-width norm the
        heads spread over blocks of PROLOGUE_WARPS warps; with one, a token's heads share one block, which first
        sums the squares of the token's whole q and k."""
        q, k, v = (self.cp.ascontiguousarray(a) for a in (q, k, v))
        t = q.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        num_heads = q.shape[1] // head_dim
        out = self.cp.empty((t, num_heads, head_dim), np.float32)  # [T, Q, D]
        heads = num_heads + 2 * num_kv_heads
        if qk_norm == "full":
            warps, groups = min(32, heads), 1
        else:
            warps, groups = PROLOGUE_WARPS, _ceil(heads, PROLOGUE_WARPS)
        args = (q, k, v, NULL if q_norm is None else q_norm, NULL if k_norm is None else k_norm, cos, sin, positions,
                slot_mapping, out, key_cache, value_cache, np.int32(num_heads), np.int32(num_kv_heads),
                np.int32(head_dim // 2), np.int32(QK_NORMS.index(qk_norm)), np.float32(eps), np.float32(clip or 0),
                np.float32(kv_scales[0]), np.float32(kv_scales[1]))
        kv_type = storage_type(key_cache)
        _launch("attention_prologue.cu", f"qk_norm_rope_write<{kv_type}>", (t, groups), 32 * warps, args,
                weight_type=kv_type)
        return out

    def paged_attention(self, query, key_cache, value_cache, batch: ForwardBatch, device_batch, scale,
                        sliding_window, kv_scales=(1.0, 1.0)):
        """One query token per sequence and at least GQA_MIN_TOKENS of them (T == B, decided from shapes only:
        inside a captured graph `batch` holds shapes, and decode.py's profile passes None): paged_attention_gqa, a
        block per (token, KV head, split) computing the KV head's whole query group, so each key and value row is
        read once for the group; the context is split over enough blocks to fill the GPU, and
        paged_attention_merge combines the splits.
        Prefill steps with a chunk of FLASH_MIN_TOKENS or more: flash_attention.cu on tensor cores
        (cupy_flash_attention.py; caches of float, bf16 or fp16 without scales).
        Otherwise (short chunks, or head layouts or caches the other kernels do not take): paged_attention, a block
        per (token, query head). k_scale is folded into the score scale; the kernels multiply their outputs by
        v_scale."""
        query = self.cp.ascontiguousarray(query)
        if kv_scales == (1.0, 1.0) and takes_flash_attention(query, key_cache, value_cache, batch):
            kv_type = storage_type(key_cache)
            flash = flash_attention_launch(self.cp, self._flash_tiles, query, key_cache, value_cache, batch,
                                           device_batch, kv_type, scale, sliding_window)
            _launch(FLASH_FILE, flash.expression, flash.grid, FLASH_THREADS, flash.args, weight_type=kv_type)
            return flash.out
        t, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        tables = device_batch["block_tables"]  # [B, max_blocks] int64
        per_lane = next((d for d in (1, 2, 4, 8) if 32 * d >= head_dim), None)
        if per_lane is None:
            raise ValueError(f"head_dim {head_dim} is above the attention kernel's 256")
        out = self.cp.empty_like(query)  # [T, Q, D]
        common = (query, key_cache, value_cache, tables, device_batch["query_start"], device_batch["positions"], out)
        sizes = (np.int32(tables.shape[0]), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                 np.int32(block_size), np.int32(tables.shape[1]), np.float32(scale * kv_scales[0]),
                 np.int32(sliding_window or 0), np.float32(kv_scales[1]))
        group = num_heads // num_kv_heads
        padded = next((g for g in GQA_GROUPS if g >= group), None)
        kv_type = storage_type(key_cache)
        vector = min(per_lane, 4)  # elements per load of a key or value row
        load_bytes = vector * key_cache.itemsize
        if (t == tables.shape[0] and t >= GQA_MIN_TOKENS and num_heads % num_kv_heads == 0 and padded is not None
                and padded * per_lane <= GQA_MAX_LANE_FLOATS and head_dim % vector == 0
                and key_cache.data.ptr % load_bytes == 0 and value_cache.data.ptr % load_bytes == 0):
            pairs = t * num_kv_heads
            capacity = tables.shape[1] * block_size  # the longest context the tables hold
            splits = max(1, min(GQA_MAX_SPLITS, GQA_BLOCKS_PER_SM * self.multiprocessors // max(pairs, 1),
                                _ceil(capacity, GQA_MIN_SPLIT_KEYS)))
            if splits > 1:
                partial_acc = self.cp.empty((t, num_heads, splits, head_dim), np.float32)  # [T, Q, S, D]
                partial_ml = self.cp.empty((t, num_heads, splits, 2), np.float32)  # [T, Q, S, (m, l)]
            else:
                partial_acc = partial_ml = NULL
            _launch("attention.cu", f"paged_attention_gqa<{kv_type}, {per_lane}, {padded}>",
                    (t, num_kv_heads, splits), 32 * GQA_WARPS, (*common, partial_acc, partial_ml, *sizes),
                    shared_mem=GQA_WARPS * padded * head_dim * 4, weight_type=kv_type)
            if splits > 1:
                _launch("attention.cu", "paged_attention_merge", (t, num_heads), 32 * per_lane,
                        (partial_acc, partial_ml, out, np.int32(head_dim), np.int32(splits)), weight_type=kv_type)
            return out
        _launch("attention.cu", f"paged_attention<{kv_type}, {per_lane}>", (t, num_heads), 32 * ATTENTION_WARPS,
                (*common, *sizes), shared_mem=ATTENTION_WARPS * head_dim * 4, weight_type=kv_type)
        return out

    # ---- mixture of experts -------------------------------------------------------------------------------
    def route(self, x, router, top_k, renormalize):
        """Up to ROUTER_SPLIT_TOKENS tokens: route_split, a block per (expert, token tile) and the selection in
        each tile's last block (a batch-1 step reads the router on many SMs instead of one); more tokens:
        route_topk, a block per token, each reading the whole router (mostly from L2)."""
        x = self.cp.ascontiguousarray(x)
        t, h = x.shape
        num_experts = router.shape[0]
        _check_row_width(h, router, "router")
        weights = self.cp.empty((t, top_k), np.float32)  # [T, k]
        expert_ids = self.cp.empty((t, top_k), np.int32)  # [T, k]
        w = storage_type(router)
        selection = (weights, expert_ids, np.int32(h), np.int32(num_experts), np.int32(top_k),
                     np.int32(bool(renormalize)))
        if t <= ROUTER_SPLIT_TOKENS:
            tile = _tile(min(t, ROUTER_TILE), TOKEN_TILES)
            logits = self.cp.empty((t, num_experts), np.float32)  # [T, E]
            _launch("router.cu", f"route_split<{w}, {tile}>", (num_experts, _ceil(t, tile)), 32 * ROUTER_WARPS,
                    (x, router, *selection, logits, self._route_counters, np.int32(t)),
                    shared_mem=4 * ROUTER_WARPS * num_experts, weight_type=w)
        else:
            _launch("router.cu", f"route_topk<{w}>", (t,), 1024, (x, router, *selection),
                    shared_mem=4 * num_experts, weight_type=w)
        return weights, expert_ids

    def prepare_experts(self, store: ExpertStore, config: ModelConfig) -> ExpertStore:
        from ..experts.trace import RoutingRecorder

        if isinstance(store, RoutingRecorder):  # records around the device store
            store.inner = self.prepare_experts(store.inner, config)
            return store
        if hasattr(store, "passes"):  # already on the device: resident, or GPU slots (experts/gpu_tier.py)
            return store
        return DeviceExpertStore.upload(store, config.moe_layers, config.num_experts)

    def routed_experts(self, x, weights, expert_ids, layer, store: ExpertStore):
        """The MoE kernels once per launch the store asks for (`store.passes(layer)`: one when every expert is
        resident; with GPU slots, one per group of experts that fit the layer's slots), then the sum over each
        token's experts, plus what the store's `finish_layer` returns (experts it computed on the CPU meanwhile)."""
        if not hasattr(store, "passes"):
            raise TypeError("the CuPy backend computes routed experts from a device store (prepare_experts)")
        cp = self.cp
        x = cp.ascontiguousarray(x)
        t, h = x.shape
        top_k = expert_ids.shape[1]
        pairs = t * top_k
        num_experts = store.num_experts
        ids = cp.ascontiguousarray(expert_ids, dtype=np.int32).reshape(pairs)  # [P]
        route_weights = cp.ascontiguousarray(weights, dtype=np.float32).reshape(pairs)  # [P]
        group_expert = cp.empty(num_experts, np.int32)  # [E]
        group_start = cp.empty(num_experts + 1, np.int32)  # [E+1]
        sorted_pairs = cp.empty(pairs, np.int32)  # [P]
        num_groups = cp.empty(1, np.int32)
        _launch("moe.cu", "moe_align", (1,), 1024,
                (ids, np.int32(pairs), np.int32(num_experts), group_expert, group_start, sorted_pairs, num_groups),
                shared_mem=8 * num_experts)
        groups = min(num_experts, pairs)
        tile = _tile(t, MOE_TILES)  # a group holds at most T pairs
        routing = (group_expert, group_start, sorted_pairs, num_groups)
        act = y = None
        for experts in store.passes(layer):
            i = experts.gate.shape[1]  # a cut expert's GPU part (experts/partial.py) has fewer rows than the others
            if act is None or act.shape[1] != i:
                _check_row_width(h, experts.gate, "experts (hidden size)")
                _check_row_width(i, experts.down, "experts (intermediate size)")
                act = cp.empty((pairs, i), np.float32)  # [P, I]
            mma = _on_tensor_cores(experts.gate, t)
            # moe_down_mma adds partial products of `splits` column spans when its row blocks leave the GPU idle
            splits = self.column_splits(i, _ceil(h, MMA_DOWN_ROWS) * groups) if mma else 1
            span = 32 * _ceil(i, 32 * splits)
            if y is None:
                # [P, H]; pairs skipped by every launch (experts computed on the CPU) must add nothing, and column
                # spans add into it
                y = (cp.empty if store.resident and splits == 1 else cp.zeros)((pairs, h), np.float32)
            w = storage_type(experts.gate)
            gate_up_args, down_args = experts.kernel_args()
            gate_up = (x, *gate_up_args, *routing, act, np.int32(h), np.int32(i), np.int32(top_k))
            down = (act, *down_args, route_weights, *routing, y, np.int32(h), np.int32(i))
            if mma:
                n_tiles = _tile(_ceil(t, 8), MMA_TILES)  # 8 pairs per n-tile; a group holds at most T pairs
                _launch("moe_mma.cu", f"moe_gate_up_mma<{w}, {n_tiles}>", (_ceil(i, MMA_GATE_UP_ROWS), groups),
                        MMA_THREADS, gate_up, weight_type=w)
                _launch("moe_mma.cu", f"moe_down_mma<{w}, {n_tiles}>",
                        (_ceil(h, MMA_DOWN_ROWS), groups, _ceil(i, span)), MMA_THREADS, (*down, np.int32(span)),
                        weight_type=w)
            else:
                item = experts.gate.itemsize
                r_up = moe_rows_per_warp(h * item, MOE_UP_ROW_BYTES)
                r_down = moe_rows_per_warp(i * item, MOE_DOWN_ROW_BYTES)
                _launch("moe.cu", f"moe_gate_up<{w}, {tile}, {r_up}>", (_ceil(i, MOE_WARPS * r_up), groups),
                        32 * MOE_WARPS, gate_up, weight_type=w)
                _launch("moe.cu", f"moe_down<{w}, {tile}, {r_down}>", (_ceil(h, MOE_WARPS * r_down), groups),
                        32 * MOE_WARPS, down, weight_type=w)
        out = cp.empty((t, h), np.float32)  # [T, H]
        if y is None:  # no launch: every expert of the step was computed on the CPU
            out.fill(0)
        else:
            _launch("moe.cu", "moe_sum", (_ceil(t * h, 256),), 256,
                    (y, out, np.int32(t), np.int32(top_k), np.int32(h)))
        from_host = store.finish_layer(layer)  # [T, H]: experts the store computed on the CPU meanwhile, or None
        if from_host is not None:
            out += from_host
        return out

    # ---- output -------------------------------------------------------------------------------------------
    def gather_rows(self, x: Array, rows: Array) -> Array:
        return x[rows]

    def greedy(self, logits: Array, out: Array | None = None) -> Array:
        """The argmax of each row of logits [B, V] (lowest id among ties), on the device, into `out` [B] int64
        when given.  # [B] int64"""
        logits = self.cp.ascontiguousarray(logits)
        ids = self.cp.empty(logits.shape[0], np.int64) if out is None else out
        if ids.shape != (logits.shape[0],) or ids.dtype != np.int64 or not ids.flags.c_contiguous:
            raise ValueError(f"greedy writes [{logits.shape[0]}] contiguous int64 ids, got {ids.shape} {ids.dtype}")
        _launch("sampling.cu", "argmax_rows", (logits.shape[0],), 1024, (logits, ids, np.int32(logits.shape[1])))
        return ids

    def feed_tokens(self, token_ids: Array, feed_rows: Array, feedback: Array) -> None:
        """Replace token_ids[b] [B] int64 by feedback[feed_rows[b]] wherever feed_rows[b] [B] >= 0, in place: a
        step's inputs that an earlier step sampled on the device (feed_rows[b] < len(feedback))."""
        b = token_ids.shape[0]
        _launch("sampling.cu", "feed_tokens", (_ceil(b, 256),), 256, (token_ids, feed_rows, feedback, np.int32(b)))
