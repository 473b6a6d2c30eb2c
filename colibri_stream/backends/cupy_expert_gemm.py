"""Routed experts of a prefill-sized step as cuBLAS GEMMs, one set per expert: the same job as moe_mma.cu.

moe_mma.cu reads each weight once per 32 pairs of its expert's group, which suits decode and short chunks. A
prefill chunk of a model with few, large experts (Mixtral: 8 experts, a 2048-token chunk gives ~512 pairs each)
makes groups of hundreds of pairs, where a tiled GEMM reuses every weight across the whole group. Each GEMM is
one host call, so models of many small experts stay on moe_mma.cu (`takes_expert_gemms`). Here the step's
tokens are gathered in group order (moe_align's sorted pairs), cut into bf16/fp16 parts (cublas_gemm.py), and
each expert's group is multiplied by its matrices in place: gate and up (one GEMM when up's rows follow gate's in
memory), SiLU-mul, then down; each pair's row is scaled by its route weight and scattered back to pair order.

The group sizes decide the GEMMs' shapes, so the routing is copied to the host once per layer (a synchronisation,
acceptable in an eager prefill step; a captured decode step never comes here, `takes_expert_gemms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ClampedSwiglu
from ..experts.cpu_executor import clamped_swiglu
from ..experts.device import LayerExperts
from .cublas_gemm import activation_parts, weight_product
from .cupy_launch import Array
from .tuning import EXPERT_GEMM_MIN_WORK


def takes_expert_gemms(experts: LayerExperts, pairs: int, num_experts: int) -> bool:
    """Whether a step's routed experts run as per-expert cuBLAS GEMMs: bf16/fp16 experts without scales, outside
    a graph capture, when one expert's gate product at the average group size (pairs / E groups of an [I, H]
    matrix) is EXPERT_GEMM_MIN_WORK multiply-adds or more."""
    import cupy

    _, i, h = experts.gate.shape
    return (np.dtype(experts.gate.dtype) in (np.dtype(np.uint16), np.dtype(np.float16))
            and experts.gate_scale is None and pairs >= min_gemm_pairs(i, h, num_experts)
            and not cupy.cuda.get_current_stream().is_capturing())


def min_gemm_pairs(rows: int, cols: int, num_experts: int) -> int:
    """The fewest (token, expert) pairs of a step for which its experts' [rows, cols] gate products go to cuBLAS:
    one expert's product at the average group size (pairs / num_experts) is EXPERT_GEMM_MIN_WORK multiply-adds."""
    return -(-EXPERT_GEMM_MIN_WORK * num_experts // (rows * cols))


@dataclass
class GroupedTokens:
    """A step's (token, slot) pairs in moe_align's group order, with the groups on the host."""

    group_expert: np.ndarray  # [G] int64: the expert of each group
    group_start: np.ndarray  # [G+1] int64: group g holds sorted positions group_start[g] .. group_start[g+1]-1
    sorted_pairs: Array  # [P] int32 (device): the pair at each sorted position
    parts: Array  # [N * P, H] bf16/fp16 (device): the pairs' tokens in sorted order, each of N parts in turn
    num_parts: int  # N: 2 (high parts, then low parts) or 1 (cublas_gemm.activation_parts)

    @classmethod
    def gather(cls, x: Array, routing: tuple, top_k: int, like: Array, num_parts: int) -> GroupedTokens:
        """From moe_align's device outputs (group_expert, group_start, sorted_pairs, num_groups) and x [T, H]."""
        import cupy

        group_expert, group_start, sorted_pairs, num_groups = routing
        host = cupy.asnumpy(cupy.concatenate([num_groups, group_expert, group_start])).astype(np.int64)
        groups, num_experts = int(host[0]), group_expert.shape[0]
        tokens = cupy.take(x, sorted_pairs // top_k, axis=0)  # [P, H] float32
        return cls(host[1:1 + groups], host[1 + num_experts:2 + num_experts + groups], sorted_pairs,
                   activation_parts(tokens, like, num_parts), num_parts)

    @property
    def pairs(self) -> int:
        return self.sorted_pairs.shape[0]


def expert_gemms(grouped: GroupedTokens, experts: LayerExperts, route_weights: Array, y: Array, resident: bool,
                 silu_mul, swiglu: ClampedSwiglu | None = None) -> None:
    """y[p] = route_weight[p] * expert_e(x[p / k]) for every pair p of a group whose expert this launch computes
    (`experts.slot_of`, or every expert when it has no table); with `resident` false the other rows of y keep
    their values (several launches add into a zeroed y). `silu_mul(gate, up)` is the backend's elementwise
    kernel, the activation unless `swiglu` gives gpt-oss's clamped SwiGLU; experts with biases add each group's
    expert's biases to its products.  # y [P, H] float32"""
    import cupy

    gate, up, down = experts.gate, experts.up, experts.down  # [S, I, H], [S, I, H], [S, H, I]
    _, i, h = gate.shape
    item = gate.itemsize
    p = grouped.pairs
    slots = None if experts.slot_of is None else cupy.asnumpy(experts.slot_of)
    groups = []  # (slot, first sorted position, pairs) of the groups this launch computes
    for g, expert in enumerate(grouped.group_expert):
        slot = expert if slots is None else int(slots[expert])
        start, count = int(grouped.group_start[g]), int(grouped.group_start[g + 1] - grouped.group_start[g])
        if slot >= 0 and count > 0:
            groups.append((slot, start, count))
    gate_rows, down_rows = gate.strides[1] // item, down.strides[1] // item  # row strides in elements
    # gate and up as one [2I, H] matrix when up's rows follow gate's (stacked experts, experts.bin's blocks)
    fused = up.strides == gate.strides and up.data.ptr == gate.data.ptr + i * gate.strides[1]
    matrices = [(gate, 2 * i, 0)] if fused else [(gate, i, 0), (up, i, i)]  # (matrix, rows, first output column)
    gate_up = cupy.empty((p, 2 * i), np.float32)  # [P, 2I] in sorted order: gate, then up
    _group_products(gate_up, 2 * i, grouped.parts, grouped.num_parts, h, groups, matrices, gate_rows, gate.dtype)
    if experts.gate_bias is not None:
        _add_group_biases(gate_up[:, :i], experts.gate_bias, groups)
        _add_group_biases(gate_up[:, i:], experts.up_bias, groups)
    if swiglu is None:
        act = silu_mul(gate_up[:, :i], gate_up[:, i:])  # [P, I]
    else:
        act = clamped_swiglu(gate_up[:, :i], gate_up[:, i:], swiglu.limit, swiglu.alpha)  # [P, I]
    del gate_up
    act_parts = activation_parts(act, gate, grouped.num_parts)  # [N * P, I]
    del act
    out = (cupy.empty if resident else cupy.zeros)((p, h), np.float32)  # [P, H] in sorted order
    _group_products(out, h, act_parts, grouped.num_parts, i, groups, [(down, h, 0)], down_rows, down.dtype)
    if experts.down_bias is not None:
        _add_group_biases(out, experts.down_bias, groups)
    weighted = out * route_weights[grouped.sorted_pairs][:, None]  # [P, H]
    if resident:
        y[grouped.sorted_pairs] = weighted
    else:
        y[grouped.sorted_pairs] += weighted


def _add_group_biases(rows: Array, bias: Array, groups: list[tuple[int, int, int]]) -> None:
    """rows[s:s+n] += bias[slot] for each group (slot, s, n).  # rows [P, C] in sorted order, bias [S, C]"""
    for slot, start, count in groups:
        rows[start:start + count] += bias[slot]


def _group_products(out: Array, out_width: int, parts: Array, num_parts: int, n_in: int,
                    groups: list[tuple[int, int, int]], matrices: list[tuple[Array, int, int]], row_stride: int,
                    dtype) -> None:
    """out[s:s+n, c:c+rows] = (sum of the parts)[s:s+n] . matrix[slot]^T for each group (slot, s, n) and each
    matrix (matrix by slot, rows, c): the first part's product, then each other part's added to it."""
    p = parts.shape[0] // num_parts
    item = parts.itemsize
    for matrix, rows, column in matrices:
        for slot, start, count in groups:
            weight = matrix.data.ptr + slot * matrix.strides[0]
            target = out.data.ptr + (start * out_width + column) * out.itemsize
            for part in range(num_parts):
                inputs = parts.data.ptr + (part * p + start) * n_in * item
                weight_product(target, out_width, weight, row_stride, dtype, rows, n_in, inputs, n_in, count,
                               accumulate=part > 0)
