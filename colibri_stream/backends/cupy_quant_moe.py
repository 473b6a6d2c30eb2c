"""Routed experts stored as int4, mxfp4 or fp8 on the GPU: how kernels/moe_int4.cu and moe_fp8.cu address their
codes and scales, and their launches.

A launch's experts (experts/device.py's LayerExperts, resident stacks or GPU slots in experts.bin's layout) hold
each matrix as codes plus float32 scales (asymmetric int4: and uint8 zero points; mxfp4: uint8 exponents instead),
as expert_codecs.py lays them out. `QuantMatrix` reads that layout off the arrays' shapes: the format, its chunk of
columns, the bytes of a row, and where a row's scale for a column lies. The kernels dequantize on tensor cores at
every batch size, so the same launches serve decode and prefill. int4 and mxfp4 (moe_int4.cu's two codes policies)
multiply int8 parts of the activations (`QuantizedRows`, cut once per launch for all its blocks); fp8 multiplies
their bf16 parts, split in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..experts.device import LayerExperts, device_pointer, slot_stride
from .cupy_launch import Array, ceil_div, launch, smallest_tile
from .tuning import (INT4_GEMV_MAX_TOKENS, INT4_GEMV_ROWS, INT4_GEMV_TILES, INT4_SHARED_ROWS_BELOW_BLOCKS_PER_SM,
                     INT4_ROW_SHARING, MMA_DOWN_ROWS, MMA_GATE_UP_ROWS, MMA_THREADS, MMA_TILES)

FP8_TILE = 128  # rows and columns of an fp8 scale tile (expert_codecs.FP8_BLOCK)
INT4_LANE_BYTES = (16, 8, 4)  # moe_int4.cu's B: codes a lane reads per chunk of 8 * B columns
FP8_CHUNK = 64  # = FP8_CHUNK in moe_fp8.cu
FP8_LANE_COLS = 16  # = FP8_LANE_COLS in moe_fp8.cu
QUANTIZE_COLUMNS = 1024  # columns per block of quantize_activations (128 threads of 8)
GEMV_FILE = "moe_int4_gemv.cu"
GEMV_LANE_BYTES = 4  # moe_int4_gemv.cu's activations: chunks of 32 columns, a lane's 16 bytes of codes
GEMV_WARPS = 4  # = GEMV_WARPS in moe_int4_gemv.cu


@dataclass(frozen=True)
class QuantMatrix:
    """One kind of matrix (gate and up, or down) of a launch's quantized experts as the kernels read it."""

    format: str  # "int4", "mxfp4" or "fp8"
    lane_bytes: int  # int4 and mxfp4: moe_int4.cu's B (16, 8 or 4); fp8: 16
    chunk: int  # columns per chunk
    row_bytes: int  # bytes of codes per row
    row_block: int  # scale of row r, column c: entry (r / row_block) * scale_cols + c / col_block of the slot's
    col_block: int  # scales
    scale_cols: int

    @classmethod
    def of(cls, codes: Array, scale: Array, cols: int, what: str) -> QuantMatrix:
        """The layout of codes [S, rows, ...] uint8 with scales [S, ...] of matrices of `cols` columns: int4
        codes [S, rows, groups, width / 2] with float32 scales [S, rows, groups]; mxfp4 codes [S, rows, cols / 32,
        16] with uint8 exponents [S, rows, cols / 32]; fp8 codes [S, rows, cols] with float32 scales [S, ceil(rows
        / 128), ceil(cols / 128)] (tiles) or [S, rows] (channels). Shapes the kernels cannot read (rows or groups
        that are not whole chunks of their loads) are refused, naming `what`."""
        scale_types = (np.float32, np.uint8) if codes.ndim == 4 else (np.float32,)
        if codes.dtype != np.uint8 or scale.dtype not in scale_types:
            raise ValueError(f"{what}: quantized experts are uint8 codes with float32 scales (mxfp4: uint8 "
                             f"exponents), got {codes.dtype} codes and {scale.dtype} scales")
        if codes.ndim == 4:  # int4, mxfp4
            four_bit = "mxfp4" if scale.dtype == np.uint8 else "int4"
            groups, width = codes.shape[2], 2 * codes.shape[3]
            lane_bytes = next((b for b in INT4_LANE_BYTES if width % (8 * b) == 0), None)
            if lane_bytes is None or cols % 32:
                raise ValueError(f"{what}: {four_bit} rows of {cols} columns in groups of {width} are not whole "
                                 "32-column chunks (the GPU kernels read 8 codes a lane at a time); run this model "
                                 "with --device cpu")
            # the scales' own width: a cut expert's part (experts/cut_layout.py) keeps down's scales whole
            return cls(four_bit, lane_bytes, 8 * lane_bytes, groups * width // 2, 1, width, scale.shape[2])
        if cols % FP8_LANE_COLS:
            raise ValueError(f"{what}: fp8 rows of {cols} columns are not a multiple of {FP8_LANE_COLS} (the GPU "
                             "kernels read 16 codes at a time); run this model with --device cpu")
        if scale.ndim == 3:  # a scale per 128 x 128 tile
            return cls("fp8", FP8_LANE_COLS, FP8_CHUNK, cols, FP8_TILE, FP8_TILE, scale.shape[2])
        return cls("fp8", FP8_LANE_COLS, FP8_CHUNK, cols, 1, max(cols, 1), 1)  # a scale per output channel

    def scale_args(self) -> tuple:
        if self.format in ("int4", "mxfp4"):  # one row per scale row
            return np.int32(self.col_block), np.int32(self.scale_cols)
        return np.int32(self.row_block), np.int32(self.col_block), np.int32(self.scale_cols)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows of float32 activations as moe_int4.cu multiplies them: per chunk of columns a scale and two int8
    parts, x = scale * (254 * hi + lo), each 8 columns stored in the kernels' k order (quantize_activations)."""

    hi: Array  # [rows, W] int8
    lo: Array  # [rows, W] int8
    scale: Array  # [rows, chunks] float32: the chunk's largest |x| / (127 * 254)
    corr: Array  # [rows, chunks] int32: 254 * sum hi + sum lo

    @classmethod
    def of(cls, x: Array, lane_bytes: int, file: str = "moe_int4.cu", weight_type: str | None = None
           ) -> QuantizedRows:
        """x [rows, W] float32 cut in chunks of 8 * lane_bytes columns, by the quantize_activations compiled with
        `file`'s family for `weight_type` (default: the lane bytes, moe_int4.cu's)."""
        import cupy

        rows, width = x.shape
        chunks = ceil_div(width, 8 * lane_bytes)
        quantized = cls(cupy.empty((rows, width), np.int8), cupy.empty((rows, width), np.int8),
                        cupy.empty((rows, chunks), np.float32), cupy.empty((rows, chunks), np.int32))
        launch(file, f"quantize_activations<{lane_bytes}>", (ceil_div(width, QUANTIZE_COLUMNS), rows), 128,
               (x, np.int32(width), quantized.hi, quantized.lo, quantized.scale, quantized.corr),
               weight_type=weight_type or str(lane_bytes))
        return quantized

    def args(self) -> tuple:
        return self.hi, self.lo, self.scale, self.corr


def is_block_scaled(experts: LayerExperts) -> bool:
    """Whether a launch's experts are int4 or fp8 (codes with float32 scales, moe_int4.cu / moe_fp8.cu), not
    bf16/fp16/float32 or int8 (moe.cu, moe_mma.cu)."""
    return experts.gate.dtype == np.uint8 and experts.gate_scale is not None


def quant_experts(experts: LayerExperts, x: Array, act: Array, y: Array, route_weights: Array, routing: tuple,
                  tokens: int, top_k: int, groups: int, column_splits, multiprocessors: int,
                  quantized_x: dict[int, QuantizedRows], activation: tuple) -> None:
    """The gate/up kernel then the down kernel over one launch's experts: act [P, I] from x [T, H], then y
    [P, H], added into (the caller zeroes it: the down product may be split over `column_splits(I, blocks)`
    column spans that add with atomics). `routing`: moe_align's (group_expert, group_start, sorted_pairs,
    num_groups). `quantized_x`: int4's cut of x by chunk width, kept by the caller for the layer's later launches
    (filled here on first use). `activation`: (limit, alpha, up_shift) of common.cuh's GatedActivation, applied with
    the experts' biases (where they have them)."""
    h = x.shape[1]
    i = experts.gate.shape[1]
    up_layout = QuantMatrix.of(experts.gate, experts.gate_scale, h, "experts (hidden size)")
    down_layout = QuantMatrix.of(experts.down, experts.down_scale, i, "experts (intermediate size)")
    if experts.gate.strides != experts.up.strides or experts.gate_scale.strides != experts.up_scale.strides:
        raise ValueError("gate and up of a layer's experts must share their strides")
    int4 = up_layout.format in ("int4", "mxfp4")  # moe_int4.cu, its codes policy per format
    slot_of = device_pointer(experts.slot_of)
    # the launches' arguments, in the kernels' order: the weights' codes and scales, (int4: their zero points,) the
    # rest; the activations' parts go first
    gate_up_codes = (device_pointer(experts.gate), device_pointer(experts.up), slot_stride(experts.gate),
                     np.int64(up_layout.row_bytes), device_pointer(experts.gate_scale),
                     device_pointer(experts.up_scale), slot_stride(experts.gate_scale))
    gate_up_zeros = (device_pointer(experts.gate_zero), device_pointer(experts.up_zero), slot_stride(experts.gate_zero))
    gate_up_rest = (*up_layout.scale_args(), *experts.gate_up_bias_args(), *activation, slot_of, *routing, act,
                    np.int32(h), np.int32(i), np.int32(top_k))
    down_codes = (device_pointer(experts.down), slot_stride(experts.down), np.int64(down_layout.row_bytes),
                  device_pointer(experts.down_scale), slot_stride(experts.down_scale))
    down_zeros = (device_pointer(experts.down_zero), slot_stride(experts.down_zero))
    down_rest = (*down_layout.scale_args(), *experts.down_bias_args(), slot_of, route_weights, *routing, y,
                 np.int32(h), np.int32(i))
    if int4 and tokens <= INT4_GEMV_MAX_TOKENS:
        # moe_int4_gemv.cu: CUDA cores, a warp's lanes along each row, activations in chunks of 32 columns; the
        # down product stored into y whole
        policy = f"{'Mxfp4Codes' if up_layout.format == 'mxfp4' else 'Int4Codes'}, "
        policy += f"{smallest_tile(tokens, INT4_GEMV_TILES)}, {INT4_GEMV_ROWS}"  # a group holds at most T pairs
        rows = GEMV_WARPS * INT4_GEMV_ROWS  # a block's
        if GEMV_LANE_BYTES not in quantized_x:
            quantized_x[GEMV_LANE_BYTES] = QuantizedRows.of(x, GEMV_LANE_BYTES, GEMV_FILE, up_layout.format)
        launch(GEMV_FILE, f"moe_gate_up_int4_gemv<{policy}>", (ceil_div(i, rows), groups), 32 * GEMV_WARPS,
               (*quantized_x[GEMV_LANE_BYTES].args(), *gate_up_codes, *gate_up_zeros, *gate_up_rest),
               weight_type=up_layout.format)
        act_parts = QuantizedRows.of(act, GEMV_LANE_BYTES, GEMV_FILE, up_layout.format)
        launch(GEMV_FILE, f"moe_down_int4_gemv<{policy}>", (ceil_div(h, rows), groups), 32 * GEMV_WARPS,
               (*act_parts.args(), *down_codes, *down_zeros, *down_rest), weight_type=up_layout.format)
        return
    codes = ", Mxfp4Codes" if up_layout.format == "mxfp4" else ""
    weight_type = ("mxfp4" if codes else str(up_layout.lane_bytes)) if int4 else None
    n_tiles = smallest_tile(ceil_div(tokens, 8), MMA_TILES)  # a group holds at most T pairs
    if int4:
        # Too few blocks of 64 rows to keep every multiprocessor reading: each block's warps share 16 rows
        row_blocks = ceil_div(i, MMA_GATE_UP_ROWS) * groups
        sharing = INT4_ROW_SHARING if row_blocks < INT4_SHARED_ROWS_BELOW_BLOCKS_PER_SM * multiprocessors else 1
        if up_layout.lane_bytes not in quantized_x:
            quantized_x[up_layout.lane_bytes] = QuantizedRows.of(x, up_layout.lane_bytes)
        gate_up = (*quantized_x[up_layout.lane_bytes].args(), *gate_up_codes, *gate_up_zeros)
        kernel = f"moe_gate_up_int4<{up_layout.lane_bytes}, {n_tiles}, {sharing}{codes}>"
        grid = (ceil_div(i, MMA_GATE_UP_ROWS // sharing), groups)
    else:
        gate_up = (x, *gate_up_codes)
        kernel = f"moe_gate_up_fp8<{n_tiles}>"
        grid = (ceil_div(i, MMA_GATE_UP_ROWS), groups)
    file = "moe_int4.cu" if int4 else "moe_fp8.cu"
    launch(file, kernel, grid, MMA_THREADS, (*gate_up, *gate_up_rest), weight_type=weight_type)
    splits = column_splits(i, ceil_div(h, MMA_DOWN_ROWS) * groups)
    span = down_layout.chunk * ceil_div(i, down_layout.chunk * splits)
    if int4:
        down = (*QuantizedRows.of(act, down_layout.lane_bytes).args(), *down_codes, *down_zeros)
        kernel = f"moe_down_int4<{down_layout.lane_bytes}, {n_tiles}{codes}>"
        # down's own family: its lane bytes differ from gate and up's where their rows' groups differ in width
        # (H = 96 in one group read 4 bytes a lane, I = 160 in groups of 128 read 16)
        weight_type = "mxfp4" if codes else str(down_layout.lane_bytes)
    else:
        down = (act, *down_codes)
        kernel = f"moe_down_fp8<{n_tiles}>"
    launch(file, kernel, (ceil_div(h, MMA_DOWN_ROWS), groups, ceil_div(i, span)), MMA_THREADS,
           (*down, *down_rest, np.int32(span)), weight_type=weight_type)
