"""Routed experts of a prefill-sized step as one grouped GEMM per matrix on tensor cores (kernels/moe_gemm.cu).

moe_mma.cu reads each weight once per 32 pairs of its expert's group and every warp loads the float32 activations
itself, which suits decode; a prefill chunk over many experts (DeepSeek-V3's 256, Qwen3-MoE's 128: tens to
hundreds of pairs each) wants a tiled GEMM. Once a layer (`GemmTokens`), the step's tokens are cut into the
backend's activation parts (cublas_gemm.activation_parts: one part at matmul precision medium, two at high) and
every group into tiles of GEMM_PAIRS pairs (moe_gemm_tiles, on the device). Two launches a pass of the store's
experts cover every tile of every expert: gate and up with the activation applied (the intermediate activation
written in the same parts, in moe_align's sorted order), then down, each pair's row scaled by its route weight and
written in pair order. No host synchronisation: the grid is sized for the most tiles a step can have, and the
blocks past its tiles exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..experts.device import LayerExperts
from .cublas_gemm import activation_parts
from .cupy_launch import Array, ceil_div, check_row_width, launch, storage_type
from .tuning import GEMM_FEATURES, GEMM_MAX_GROUPS, GEMM_PAIRS, GEMM_ROWS, GEMM_THREADS, GROUPED_GEMM_MIN_PAIRS


def takes_grouped_gemm(experts: LayerExperts, pairs: int, num_experts: int) -> bool:
    """Whether a step's routed experts run on moe_gemm.cu: bf16/fp16 experts without scales, at most
    GEMM_MAX_GROUPS experts, and GROUPED_GEMM_MIN_PAIRS pairs per expert or more on average."""
    return (np.dtype(experts.gate.dtype) in (np.dtype(np.uint16), np.dtype(np.float16))
            and experts.gate_scale is None and num_experts <= GEMM_MAX_GROUPS
            and pairs >= GROUPED_GEMM_MIN_PAIRS * num_experts)


@dataclass
class GemmTokens:
    """A step's inputs to the grouped GEMM, made once for every launch of a layer: the tokens in the backend's
    activation parts and the first tile of each of moe_align's groups."""

    parts: Array  # [N * T, H] of the experts' dtype: x's N parts (cublas_gemm.activation_parts)
    num_parts: int  # N: 1 at matmul precision medium, 2 at high
    tile_start: Array  # [E + 1] int32 (device): group g's tiles start at tile_start[g]; the last entry, their total

    @classmethod
    def prepare(cls, x: Array, routing: tuple, like: Array, num_parts: int) -> GemmTokens:
        """From x [T, H] float32 and moe_align's device outputs (group_expert, group_start, sorted_pairs,
        num_groups); `like`: an experts' array of the weights' dtype."""
        import cupy

        group_expert, group_start, _, num_groups = routing
        tile_start = cupy.empty(group_expert.shape[0] + 1, np.int32)  # [E+1]
        launch("moe_gemm.cu", "moe_gemm_tiles", (1,), GEMM_MAX_GROUPS, (group_start, num_groups, tile_start))
        return cls(activation_parts(x, like, num_parts), num_parts, tile_start)


def grouped_gemm(experts: LayerExperts, tokens: GemmTokens, routing: tuple, route_weights: Array, y: Array,
                 top_k: int, activation: tuple) -> None:
    """y[p] = route_weight[p] * expert_e(x[p / k]) for every pair p of a group whose expert this launch computes
    (`experts.slot_of`, or every expert without a table); the other rows of y keep their values. routing: moe_align's
    (group_expert, group_start, sorted_pairs, num_groups); activation: common.cuh's GatedActivation (limit, alpha,
    up_shift).  # route_weights [P], y [P, H] float32"""
    import cupy

    group_expert, _, sorted_pairs, _ = routing
    _, i, h = experts.gate.shape
    check_row_width(h, experts.gate, "experts (hidden size)")
    check_row_width(i, experts.down, "experts (intermediate size)")
    pairs, num_parts = sorted_pairs.shape[0], tokens.num_parts
    t = tokens.parts.shape[0] // num_parts
    tiles = ceil_div(pairs, GEMM_PAIRS) + min(group_expert.shape[0], pairs)  # a group adds at most one partial tile
    w = storage_type(experts.gate)
    act_parts = cupy.empty((num_parts, pairs, i), experts.gate.dtype)  # [N, P, I] in sorted order
    gate_up_args, down_args = experts.kernel_args(activation)
    launch("moe_gemm.cu", f"moe_gemm_gate_up<{w}, {num_parts}>", (ceil_div(i, GEMM_FEATURES), tiles), GEMM_THREADS,
           (tokens.parts, *gate_up_args, *routing, act_parts, np.int32(h), np.int32(i), np.int32(top_k),
            tokens.tile_start, np.int32(t), np.int32(pairs)), weight_type=w)
    launch("moe_gemm.cu", f"moe_gemm_down<{w}, {num_parts}>", (ceil_div(h, GEMM_ROWS), tiles), GEMM_THREADS,
           (act_parts, *down_args, route_weights, *routing, y, np.int32(h), np.int32(i), tokens.tile_start,
            np.int32(pairs)), weight_type=w)
