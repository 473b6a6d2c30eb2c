"""Routed experts on the GPU: the MoE kernels over a store's device experts, and the store of resident experts.

`routed_experts` sorts a step's (token, expert) pairs into groups per expert on the device (moe_align), launches
moe_gate_up and moe_down (or their tensor-core forms, moe_mma.cu; or, for prefill-sized groups, a grouped GEMM,
cupy_moe_gemm.py, or cuBLAS GEMMs per expert, cupy_expert_gemm.py; int4 and fp8 experts on moe_int4.cu and
moe_fp8.cu, cupy_quant_moe.py) once per pass the store yields (experts/device.py), and sums each token's experts
(moe_sum). `DeviceExpertStore` holds every expert resident, stacked per MoE layer: one pass, no host work, so a
decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np

from ..config import ClampedSwiglu
from ..expert_codecs import MATRICES
from ..experts.device import DeviceExperts, LayerExperts
from ..experts.store import ExpertStore
from .cupy_expert_gemm import GroupedTokens, expert_gemms, takes_expert_gemms
from .cupy_launch import Array, ceil_div, check_row_width, launch, smallest_tile, storage_type, to_device_storage
from .cupy_moe_gemm import GemmTokens, grouped_gemm, takes_grouped_gemm
from .cupy_quant_moe import is_block_scaled, quant_experts
from .tuning import (MMA_DOWN_ROWS, MMA_GATE_UP_ROWS, MMA_MIN_TOKENS, MMA_THREADS, MMA_TILES, MOE_DOWN_ROW_BYTES,
                     MOE_ROWS_PER_WARP, MOE_TILES, MOE_UP_ROW_BYTES, MOE_WARPS)


def moe_rows_per_warp(row_bytes: int, budget: int) -> int:
    """Weight rows each warp of moe.cu takes: as many of MOE_ROWS_PER_WARP as hold `budget` bytes together."""
    return max([r for r in MOE_ROWS_PER_WARP if r == 1 or r * row_bytes <= budget])


def on_tensor_cores(weight: Array, tokens: int) -> bool:
    """Whether a step's routed experts run on moe_mma.cu (tensor cores) instead of moe.cu (CUDA cores).

    moe.cu reads each weight once per group of up to 8 pairs but multiplies in float32 on CUDA cores, so once the
    experts' groups hold several pairs it is bound by FMAs and activation loads, not by reading the weights. The
    mma kernels need bf16 or fp16 weights (the tensor cores'
    operand types; float32 and int8 experts stay on moe.cu) and pay a fixed cost per 8-pair tile, which only
    several pairs per expert repay: at T tokens a group averages T * k / E pairs, so below MMA_MIN_TOKENS the
    GEMV, already near the copy bandwidth at batch 1, keeps them.
    """
    return tokens >= MMA_MIN_TOKENS and np.dtype(weight.dtype) in (np.dtype(np.uint16), np.dtype(np.float16))


def activation_args(swiglu: ClampedSwiglu | None) -> tuple:
    """(limit, alpha, up_shift) of common.cuh's GatedActivation: silu(gate) * up, or gpt-oss's clamped SwiGLU."""
    if swiglu is None:
        return np.float32(np.inf), np.float32(1.0), np.float32(0.0)
    return np.float32(swiglu.limit), np.float32(swiglu.alpha), np.float32(1.0)


def routed_experts(backend, x: Array, weights: Array, expert_ids: Array, layer: int, store: ExpertStore,
                   swiglu: ClampedSwiglu | None = None) -> Array:
    """The MoE kernels once per launch the store's device experts ask for (`passes(layer)`: one when every
    expert is resident; with GPU slots, one per group of experts that fit the layer's slots), then the sum over
    each token's experts, plus what `finish_layer` returns (experts the store computed on the CPU meanwhile).
    Experts' biases (where they have them) and the activation (`swiglu`, else silu(gate) * up) are applied inside
    the kernels. `backend` is the CupyBackend (its CuPy module and column splits).  # x [T, H] -> [T, H]"""
    device = store.device_experts()
    if device is None:
        raise TypeError("the CuPy backend computes routed experts from a device store (prepare_experts)")
    cp = backend.cp
    x = cp.ascontiguousarray(x)
    t, h = x.shape
    top_k = expert_ids.shape[1]
    pairs = t * top_k
    num_experts = device.num_experts
    ids = cp.ascontiguousarray(expert_ids, dtype=np.int32).reshape(pairs)  # [P]
    route_weights = cp.ascontiguousarray(weights, dtype=np.float32).reshape(pairs)  # [P]
    group_expert = cp.empty(num_experts, np.int32)  # [E]
    group_start = cp.empty(num_experts + 1, np.int32)  # [E+1]
    sorted_pairs = cp.empty(pairs, np.int32)  # [P]
    num_groups = cp.empty(1, np.int32)
    launch("moe.cu", "moe_align", (1,), 1024,
            (ids, np.int32(pairs), np.int32(num_experts), group_expert, group_start, sorted_pairs, num_groups),
            shared_mem=8 * num_experts)
    groups = min(num_experts, pairs)
    tile = smallest_tile(t, MOE_TILES)  # a group holds at most T pairs
    routing = (group_expert, group_start, sorted_pairs, num_groups)
    act = y = grouped = gemm_tokens = None
    activation = activation_args(swiglu)
    quantized_x = {}  # int4's cut of x (cupy_quant_moe.QuantizedRows by chunk width), made once for every launch
    for experts in device.passes(layer):
        if is_block_scaled(experts):  # int4, fp8: moe_int4.cu / moe_fp8.cu, whose split down product adds into y
            i = experts.gate.shape[1]
            if act is None or act.shape[1] != i:
                act = cp.empty((pairs, i), np.float32)  # [P, I]
            if y is None:
                y = cp.zeros((pairs, h), np.float32)  # [P, H]
            quant_experts(experts, x, act, y, route_weights, routing, t, top_k, groups, backend.column_splits,
                          backend.multiprocessors, quantized_x, activation)
            continue
        if takes_expert_gemms(experts, pairs, num_experts):
            if grouped is None:  # the tokens in group order, for every launch of the layer
                grouped = GroupedTokens.gather(x, routing, top_k, experts.gate, backend.activation_parts)
            if y is None:
                y = (cp.empty if device.resident else cp.zeros)((pairs, h), np.float32)  # [P, H]
            expert_gemms(grouped, experts, route_weights, y, device.resident, backend.silu_mul, swiglu)
            continue
        if takes_grouped_gemm(experts, pairs, num_experts):
            if gemm_tokens is None:  # the tokens' parts and the groups' tiles, for every launch of the layer
                gemm_tokens = GemmTokens.prepare(x, routing, experts.gate, backend.activation_parts)
            if y is None:
                y = (cp.empty if device.resident else cp.zeros)((pairs, h), np.float32)  # [P, H]
            grouped_gemm(experts, gemm_tokens, routing, route_weights, y, top_k, activation)
            continue
        i = experts.gate.shape[1]  # a cut expert's GPU part (experts/cut_layout.py) has fewer rows than the others
        if act is None or act.shape[1] != i:
            check_row_width(h, experts.gate, "experts (hidden size)")
            check_row_width(i, experts.down, "experts (intermediate size)")
            act = cp.empty((pairs, i), np.float32)  # [P, I]
        mma = on_tensor_cores(experts.gate, t)
        # moe_down_mma adds partial products of `splits` column spans when its row blocks leave the GPU idle
        splits = backend.column_splits(i, ceil_div(h, MMA_DOWN_ROWS) * groups) if mma else 1
        span = 32 * ceil_div(i, 32 * splits)
        if y is None:
            # [P, H]; pairs skipped by every launch (experts computed on the CPU) must add nothing, and column
            # spans add into it
            y = (cp.empty if device.resident and splits == 1 else cp.zeros)((pairs, h), np.float32)
        w = storage_type(experts.gate)
        gate_up_args, down_args = experts.kernel_args(activation)
        gate_up = (x, *gate_up_args, *routing, act, np.int32(h), np.int32(i), np.int32(top_k))
        down = (act, *down_args, route_weights, *routing, y, np.int32(h), np.int32(i))
        if mma:
            n_tiles = smallest_tile(ceil_div(t, 8), MMA_TILES)  # 8 pairs per n-tile; a group holds at most T pairs
            launch("moe_mma.cu", f"moe_gate_up_mma<{w}, {n_tiles}>", (ceil_div(i, MMA_GATE_UP_ROWS), groups),
                    MMA_THREADS, gate_up, weight_type=w)
            launch("moe_mma.cu", f"moe_down_mma<{w}, {n_tiles}>",
                    (ceil_div(h, MMA_DOWN_ROWS), groups, ceil_div(i, span)), MMA_THREADS, (*down, np.int32(span)),
                    weight_type=w)
        else:
            item = experts.gate.itemsize
            r_up = moe_rows_per_warp(h * item, MOE_UP_ROW_BYTES)
            r_down = moe_rows_per_warp(i * item, MOE_DOWN_ROW_BYTES)
            launch("moe.cu", f"moe_gate_up<{w}, {tile}, {r_up}>", (ceil_div(i, MOE_WARPS * r_up), groups),
                    32 * MOE_WARPS, gate_up, weight_type=w)
            launch("moe.cu", f"moe_down<{w}, {tile}, {r_down}>", (ceil_div(h, MOE_WARPS * r_down), groups),
                    32 * MOE_WARPS, down, weight_type=w)
    out = cp.empty((t, h), np.float32)  # [T, H]
    if y is None:  # no launch: every expert of the step was computed on the CPU
        out.fill(0)
    else:
        launch("moe.cu", "moe_sum", (ceil_div(t * h, 256),), 256,
                (y, out, np.int32(t), np.int32(top_k), np.int32(h)))
    from_host = device.finish_layer(layer)  # [T, H]: experts the store computed on the CPU meanwhile, or None
    if from_host is not None:
        out += from_host
    return out


class DeviceExpertStore(DeviceExperts):
    """Every routed expert resident in GPU memory, stacked per MoE layer (`passes(l)` gives the one launch's view)."""

    resident = True  # every expert computed in one launch, on the GPU
    capturable = True

    def __init__(self, layers: dict[int, LayerExperts]):
        self.layers = layers
        self.num_experts = next(iter(layers.values())).gate.shape[0] if layers else 0

    @classmethod
    def upload(cls, store: ExpertStore, layers: Iterable[int], num_experts: int) -> DeviceExpertStore:
        """Copy experts 0..num_experts-1 of each layer from `store` (host or device arrays) into stacked arrays:
        bf16/fp16/float32/int8 experts as gate and up rows of one [E, 2I, H] array (cuBLAS multiplies both at once,
        cupy_expert_gemm.py), the block-scaled formats (int4, fp8) tensor by tensor as the block holds them."""
        stacked = {}
        for layer in layers:
            first = store.expert(layer, 0)
            experts = (first if e == 0 else store.expert(layer, e) for e in range(num_experts))
            block_scaled = "gate_zero" in first or np.dtype(first["gate"].dtype) in _BLOCK_SCALED
            stacked[layer] = (_stack_by_name if block_scaled else _stack_gate_up)(experts, layer, num_experts)
        return cls(stacked)

    def passes(self, layer: int) -> Iterable[LayerExperts]:
        """The launches of the MoE kernels for `layer`'s step: one, over every expert."""
        return (self.layers[layer],)

    def finish_layer(self, layer: int) -> None:
        """Nothing is computed elsewhere: every expert is resident (returns None)."""

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """One expert's tensors copied back to the host, in the storage layout ExpertStore promises."""
        import cupy

        tensors = {}
        for name, array in self.layers[layer].named().items():
            values = cupy.asnumpy(array[expert])
            if values.dtype == np.uint16:
                values = values.view(ml_dtypes.bfloat16)
            elif name in MATRICES and array.ndim == 3 and values.dtype == np.uint8:  # fp8 codes [rows, cols]
                values = values.view(ml_dtypes.float8_e4m3fn)
            tensors[name] = values
        return tensors


_BLOCK_SCALED = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn))  # int4 / mxfp4 codes, fp8 codes


def _stack_gate_up(experts: Iterable[dict], layer: int, num_experts: int) -> LayerExperts:
    """A layer's experts (each one's tensors, in expert order) as w13 [E, 2I, H] (gate rows, then up rows), w2
    [E, H, I], int8's per-row scales and biased experts' biases."""
    import cupy

    w13 = w2 = s13 = s2 = b13 = b2 = None
    for expert, tensors in enumerate(experts):
        gate, up, down = (to_device_storage(tensors[n]) for n in MATRICES)  # [I, H], [I, H], [H, I]
        if w13 is None:
            i, h = gate.shape
            quantized = "gate_scale" in tensors
            w13 = cupy.empty((num_experts, 2 * i, h), gate.dtype)  # [E, 2I, H]: gate rows, then up rows
            w2 = cupy.empty((num_experts, h, i), gate.dtype)  # [E, H, I]
            s13 = cupy.empty((num_experts, 2 * i), np.float32) if quantized else None  # [E, 2I]
            s2 = cupy.empty((num_experts, h), np.float32) if quantized else None  # [E, H]
            biased = "down_bias" in tensors
            b13 = cupy.empty((num_experts, 2 * i), np.float32) if biased else None  # [E, 2I]: gate's, then up's
            b2 = cupy.empty((num_experts, h), np.float32) if biased else None  # [E, H]
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
        if b13 is not None:
            b13[expert, :i] = cupy.asarray(tensors["gate_bias"], dtype=np.float32)
            b13[expert, i:] = cupy.asarray(tensors["up_bias"], dtype=np.float32)
            b2[expert] = cupy.asarray(tensors["down_bias"], dtype=np.float32)
    return LayerExperts.stacked(w13, w2, s13, s2, b13, b2)


def _stack_by_name(experts: Iterable[dict], layer: int, num_experts: int) -> LayerExperts:
    """A layer's experts (each one's tensors, in expert order) as one [E, *shape] device array per block tensor
    (codes, scales, zero points)."""
    import cupy

    arrays = {}
    for expert, tensors in enumerate(experts):
        for name, tensor in tensors.items():
            value = to_device_storage(tensor)
            if name not in arrays:
                arrays[name] = cupy.empty((num_experts, *value.shape), value.dtype)
            if arrays[name].shape[1:] != value.shape or arrays[name].dtype != value.dtype:
                raise ValueError(f"expert ({layer}, {expert}) has {name} {value.dtype}{list(value.shape)}, expert 0 "
                                 f"{arrays[name].dtype}{list(arrays[name].shape[1:])}")
            arrays[name][expert] = value
    return LayerExperts.from_arrays(arrays, None)
