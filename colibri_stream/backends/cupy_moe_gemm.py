"""Routed experts of a prefill-sized step as one grouped GEMM per matrix on tensor cores (kernels/moe_gemm.cu).

moe_mma.cu reads each weight once per 32 pairs of its expert's group and every warp loads the float32 activations
itself, which suits decode; a prefill chunk over many experts (DeepSeek-V3's 256, Qwen3-MoE's 128: tens to
hundreds of pairs each) wants a tiled GEMM. Here the step's tokens are cut once into the backend's activation
parts (cublas_gemm.activation_parts: one part at matmul precision medium, two at high), every group is cut into
tiles of GEMM_PAIRS pairs (moe_gemm_tiles, on the device), and two launches cover every tile of every expert:
gate and up with the activation applied (the intermediate activation written in the same parts, in moe_align's
sorted order), then down, each pair's row scaled by its route weight and written in pair order. No host
synchronisation: the grid is sized for the most tiles a step can have, and the blocks past its tiles exit.
"""

from __future__ import annotations

import numpy as np

from ..experts.device import LayerExperts
from .cupy_launch import Array, ceil_div, check_row_width, launch, storage_type
from .tuning import GEMM_FEATURES, GEMM_MAX_GROUPS, GEMM_PAIRS, GEMM_ROWS, GEMM_THREADS, GROUPED_GEMM_MIN_PAIRS


def takes_grouped_gemm(experts: LayerExperts, pairs: int, num_experts: int) -> bool:
    """Whether a step's routed experts run on moe_gemm.cu: bf16/fp16 experts without scales, at most
    GEMM_MAX_GROUPS experts, and GROUPED_GEMM_MIN_PAIRS pairs per expert or more on average."""
    return (np.dtype(experts.gate.dtype) in (np.dtype(np.uint16), np.dtype(np.float16))
            and experts.gate_scale is None and num_experts <= GEMM_MAX_GROUPS
            and pairs >= GROUPED_GEMM_MIN_PAIRS * num_experts)


def grouped_gemm(experts: LayerExperts, x_parts: Array, routing: tuple, route_weights: Array, y: Array, tokens: int,
                 top_k: int, activation: tuple, num_parts: int) -> None:
    """y[p] = route_weight[p] * expert_e(x[p / k]) for every pair p of a group whose expert this launch computes
    (`experts.slot_of`, or every expert without a table); the other rows of y keep their values. x_parts: the
    step's tokens as `num_parts` parts of the experts' dtype; routing: moe_align's (group_expert, group_start,
    sorted_pairs, num_groups); activation: common.cuh's GatedActivation (limit, alpha, up_shift).
    # x_parts [N * T, H], route_weights [P], y [P, H] float32"""
    import cupy

    group_expert, group_start, sorted_pairs, num_groups = routing
    _, i, h = experts.gate.shape
    check_row_width(h, experts.gate, "experts (hidden size)")
    check_row_width(i, experts.down, "experts (intermediate size)")
    pairs = sorted_pairs.shape[0]
    tile_start = cupy.empty(group_expert.shape[0] + 1, np.int32)  # [E+1]
    launch("moe_gemm.cu", "moe_gemm_tiles", (1,), GEMM_MAX_GROUPS, (group_start, num_groups, tile_start))
    tiles = ceil_div(pairs, GEMM_PAIRS) + min(group_expert.shape[0], pairs)  # a group adds at most one partial tile
    w = storage_type(experts.gate)
    act_parts = cupy.empty((num_parts, pairs, i), experts.gate.dtype)  # [N, P, I] in sorted order
    gate_up_args, down_args = experts.kernel_args(activation)
    launch("moe_gemm.cu", f"moe_gemm_gate_up<{w}, {num_parts}>", (ceil_div(i, GEMM_FEATURES), tiles), GEMM_THREADS,
           (x_parts, *gate_up_args, *routing, act_parts, np.int32(h), np.int32(i), np.int32(top_k), tile_start,
            np.int32(tokens), np.int32(pairs)), weight_type=w)
    launch("moe_gemm.cu", f"moe_gemm_down<{w}, {num_parts}>", (ceil_div(h, GEMM_ROWS), tiles), GEMM_THREADS,
           (act_parts, *down_args, route_weights, *routing, y, np.int32(h), np.int32(i), tile_start,
            np.int32(pairs)), weight_type=w)
