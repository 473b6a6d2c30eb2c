"""Routed experts stored as int4 or fp8 on the GPU: how kernels/moe_quant.cu addresses their codes and scales,
and its launches.

A launch's experts (experts/device.py's LayerExperts, resident stacks or GPU slots in experts.bin's layout) hold
each matrix as codes plus float32 scales (and, asymmetric int4, uint8 zero points), as expert_codecs.py lays them
out. `QuantMatrix` reads that layout off the arrays' shapes: the kernel's codes type (its chunk of columns), the
bytes of a row, and where a row's scale for a column lies. The kernels dequantize in registers on tensor cores at
every batch size, so the same launches serve decode and prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..experts.device import LayerExperts, device_pointer, slot_stride
from .cupy_launch import Array, ceil_div, launch, smallest_tile
from .tuning import MMA_DOWN_ROWS, MMA_GATE_UP_ROWS, MMA_THREADS, MMA_TILES

FP8_TILE = 128  # rows and columns of an fp8 scale tile (expert_codecs.FP8_BLOCK)
INT4_CHUNKS = (128, 64, 32)  # = Int4Codes<B>::CHUNK for B = 16, 8, 4 in moe_quant.cu
FP8_CHUNK = 64  # = Fp8Codes::CHUNK
FP8_LANE_COLS = 16  # = Fp8Codes::LANE_COLS
CODES_TYPES = tuple(f"Int4Codes<{chunk // 8}>" for chunk in INT4_CHUNKS) + ("Fp8Codes",)  # moe_quant.cu's F


@dataclass(frozen=True)
class QuantMatrix:
    """One kind of matrix (gate and up, or down) of a launch's quantized experts as moe_quant.cu reads it."""

    codes_type: str  # the kernel's F: "Int4Codes<16>", "Int4Codes<8>", "Int4Codes<4>" or "Fp8Codes"
    chunk: int  # columns per chunk (F::CHUNK)
    row_bytes: int  # bytes of codes per row
    row_block: int  # scale of row r, column c: entry (r / row_block) * scale_cols + c / col_block of the slot's
    col_block: int  # scales
    scale_cols: int

    @classmethod
    def of(cls, codes: Array, scale: Array, cols: int, what: str) -> QuantMatrix:
        """The layout of codes [S, rows, ...] uint8 with scales [S, ...] float32 of matrices of `cols` columns:
        int4 codes [S, rows, groups, width / 2] with scales [S, rows, groups]; fp8 codes [S, rows, cols] with
        scales [S, ceil(rows / 128), ceil(cols / 128)] (tiles) or [S, rows] (channels). Shapes the kernels cannot
        read (rows or groups that are not whole chunks of their 16-byte loads) are refused, naming `what`."""
        if codes.dtype != np.uint8 or scale.dtype != np.float32:
            raise ValueError(f"{what}: quantized experts are uint8 codes with float32 scales, got {codes.dtype} "
                             f"codes and {scale.dtype} scales")
        if codes.ndim == 4:  # int4
            groups, width = codes.shape[2], 2 * codes.shape[3]
            chunk = next((c for c in INT4_CHUNKS if width % c == 0), None)
            if chunk is None or cols % 32:
                raise ValueError(f"{what}: int4 rows of {cols} columns in groups of {width} are not whole 32-column "
                                 "chunks (the GPU kernels read 16 codes at a time); run this model with --device cpu")
            return cls(f"Int4Codes<{chunk // 8}>", chunk, groups * width // 2, 1, width, groups)
        if cols % FP8_LANE_COLS:
            raise ValueError(f"{what}: fp8 rows of {cols} columns are not a multiple of {FP8_LANE_COLS} (the GPU "
                             "kernels read 16 codes at a time); run this model with --device cpu")
        if scale.ndim == 3:  # a scale per 128 x 128 tile
            return cls("Fp8Codes", FP8_CHUNK, cols, FP8_TILE, FP8_TILE, scale.shape[2])
        return cls("Fp8Codes", FP8_CHUNK, cols, 1, max(cols, 1), 1)  # a scale per output channel

    def scale_args(self) -> tuple:
        return np.int32(self.row_block), np.int32(self.col_block), np.int32(self.scale_cols)


def is_block_scaled(experts: LayerExperts) -> bool:
    """Whether a launch's experts are int4 or fp8 (codes with float32 scales, moe_quant.cu), not bf16/fp16/float32
    or int8 (moe.cu, moe_mma.cu)."""
    return experts.gate.dtype == np.uint8 and experts.gate_scale is not None


def quant_experts(experts: LayerExperts, x: Array, act: Array, y: Array, route_weights: Array, routing: tuple,
                  tokens: int, top_k: int, groups: int, column_splits) -> None:
    """moe_gate_up_quant then moe_down_quant over one launch's experts: act [P, I] from x [T, H], then y [P, H],
    added into (the caller zeroes it: the down product may be split over `column_splits(I, blocks)` column spans
    that add with atomics). `routing`: moe_align's (group_expert, group_start, sorted_pairs, num_groups)."""
    h = x.shape[1]
    i = experts.gate.shape[1]
    up_layout = QuantMatrix.of(experts.gate, experts.gate_scale, h, "experts (hidden size)")
    down_layout = QuantMatrix.of(experts.down, experts.down_scale, i, "experts (intermediate size)")
    if experts.gate.strides != experts.up.strides or experts.gate_scale.strides != experts.up_scale.strides:
        raise ValueError("gate and up of a layer's experts must share their strides")
    slot_of = device_pointer(experts.slot_of)
    n_tiles = smallest_tile(ceil_div(tokens, 8), MMA_TILES)  # a group holds at most T pairs
    gate_up = (x, device_pointer(experts.gate), device_pointer(experts.up), slot_stride(experts.gate),
               np.int64(up_layout.row_bytes), device_pointer(experts.gate_scale), device_pointer(experts.up_scale),
               slot_stride(experts.gate_scale), device_pointer(experts.gate_zero), device_pointer(experts.up_zero),
               slot_stride(experts.gate_zero), *up_layout.scale_args(), slot_of, *routing, act, np.int32(h),
               np.int32(i), np.int32(top_k))
    launch("moe_quant.cu", f"moe_gate_up_quant<{up_layout.codes_type}, {n_tiles}>",
           (ceil_div(i, MMA_GATE_UP_ROWS), groups), MMA_THREADS, gate_up, weight_type=up_layout.codes_type)
    splits = column_splits(i, ceil_div(h, MMA_DOWN_ROWS) * groups)
    span = down_layout.chunk * ceil_div(i, down_layout.chunk * splits)
    down = (act, device_pointer(experts.down), slot_stride(experts.down), np.int64(down_layout.row_bytes),
            device_pointer(experts.down_scale), slot_stride(experts.down_scale), device_pointer(experts.down_zero),
            slot_stride(experts.down_zero), *down_layout.scale_args(), slot_of, route_weights, *routing, y,
            np.int32(h), np.int32(i), np.int32(span))
    launch("moe_quant.cu", f"moe_down_quant<{down_layout.codes_type}, {n_tiles}>",
           (ceil_div(h, MMA_DOWN_ROWS), groups, ceil_div(i, span)), MMA_THREADS, down,
           weight_type=down_layout.codes_type)
