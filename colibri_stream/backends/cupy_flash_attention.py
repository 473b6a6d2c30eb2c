"""Attention on tensor cores: when the CuPy backend takes kernels/flash_attention.cu, and the prefill launch.

flash_attention.cu computes the attention of prefill chunks over the paged KV cache in tiles of FLASH_ROWS query
rows ((token, group head) pairs of one KV head) by tiles of keys on mma.sync (bf16 operands, float32
accumulation); attention.cu's paged_attention (float32 on CUDA cores, a block per (token, query head)) keeps decode
steps, short chunks and head dims the flash kernel is not built for. Split (the backend's matmul precision "high"),
the products take each float32 operand as a high and a low bf16 part (as the backend's projections do), so the
result is within about 1e-5 of float32 attention; unsplit ("medium"), bf16 operands alone (about 1e-3, up to 3x
fewer products). docs/PREFILL_ATTENTION.md gives the choice of our own kernel over FlashInfer and cuDNN.

flash_decode, the same file's decode kernel, takes decode launches (one token per sequence) of bf16, fp16 and fp8
caches (`takes_flash_decode`): the query group of a KV head as the rows of one m-tile, the context split over
blocks as attention.cu's paged_attention_gqa splits it, and that file's merge.

The tile list is built on the host from the batch's query_start (a prefill step is never captured in a CUDA graph,
so the batch holds real values there) and uploaded when it changes: the layers of a step share one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import tuning

if TYPE_CHECKING:
    from ..batch import ForwardBatch

FLASH_FILE = "flash_attention.cu"
FLASH_ROWS = 64  # FLASH_ROWS in flash_attention.cu: query rows per block
FLASH_THREADS = 128  # FLASH_THREADS in flash_attention.cu
FLASH_PAD = 8  # = FLASH_PAD in flash.cuh: elements of padding per shared row
FLASH_STAGES = 2  # FLASH_STAGES in flash_attention.cu: ring slots of a bf16 cache's key and value tiles
FLASH_HEAD_DIMS = (64, 96, 128)  # flash_attention instantiations: head dims
FLASH_KV_TYPES = ("float", "__nv_bfloat16", "__half")  # ... and KV cache element types
FLASH_KV_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16), np.dtype(np.float16))  # the same as device dtypes
FLASH_MIN_TOKENS = 32  # a step takes the flash kernel when one of its sequences computes this many tokens or more


DECODE_WARPS = 2  # DECODE_WARPS in flash_attention.cu: warps per block of flash_decode
DECODE_THREADS = 32 * DECODE_WARPS
DECODE_KEYS = 16  # DECODE_KEYS in flash_attention.cu: keys per tile of flash_decode
# flash_decode instantiations: KV cache element types (the 16-bit ones are its mma operands, fp8 is widened to fp16)
DECODE_KV_TYPES = ("__nv_bfloat16", "__half", "__nv_fp8_e4m3")
DECODE_KV_DTYPES = (np.dtype(np.uint16), np.dtype(np.float16), np.dtype(np.uint8))  # the same as device dtypes
DECODE_MAX_GROUP = 16  # query heads per KV head at most: the rows of one m-tile


def flash_instantiations(kv_type: str | None) -> tuple[str, ...]:
    """The flash_attention.cu instantiations compiled together for a KV cache of CUDA type `kv_type`."""
    prefill = tuple(f"flash_attention<{kv_type}, {d}, {split}>" for d in FLASH_HEAD_DIMS for split in ("true", "false")
                    ) if kv_type in FLASH_KV_TYPES else ()
    decode = tuple(decode_expression(kv_type, d) for d in FLASH_HEAD_DIMS) if kv_type in DECODE_KV_TYPES else ()
    return prefill + decode


def decode_expression(kv_type: str, head_dim: int) -> str:
    """The flash_decode instantiation of a cache type and head dim, with tuning's FLASH_DECODE_STAGES (read at
    each call, so a benchmark that sets it compiles and launches the same instantiation)."""
    return f"flash_decode<{kv_type}, {head_dim}, {tuning.FLASH_DECODE_STAGES}>"


def decode_shared_bytes(head_dim: int) -> int:
    """flash_decode's dynamic shared memory: each warp's ring of FLASH_DECODE_STAGES key and value tiles of
    DECODE_KEYS bf16/fp16 rows of head_dim + FLASH_PAD elements."""
    return DECODE_WARPS * tuning.FLASH_DECODE_STAGES * 2 * DECODE_KEYS * (head_dim + FLASH_PAD) * 2


def takes_flash_decode(query, key_cache, value_cache, tables, min_keys: int) -> bool:
    """Whether a decode launch (one query token per sequence: T == B, from shapes only, as a captured graph sees
    them) runs on flash_decode: a bf16, fp16 or fp8 cache, a head dim the kernel is built for, whole query groups of
    at most DECODE_MAX_GROUP heads, contiguous 16-byte aligned arrays, and tables holding at least `min_keys`
    keys."""
    t, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if t != tables.shape[0] or head_dim not in FLASH_HEAD_DIMS or num_heads % num_kv_heads:
        return False
    if num_heads // num_kv_heads > DECODE_MAX_GROUP or tables.shape[1] * block_size < min_keys:
        return False
    if np.dtype(key_cache.dtype) not in DECODE_KV_DTYPES or value_cache.dtype != key_cache.dtype:
        return False
    return not any(array.data.ptr % 16 or not array.flags.c_contiguous for array in (query, key_cache, value_cache))


def takes_flash_attention(query, key_cache, value_cache, batch: ForwardBatch | None) -> bool:
    """Whether a step's attention runs on flash_attention.cu: a prefill step (more tokens than sequences, so never a
    captured decode graph) with a chunk of FLASH_MIN_TOKENS or more, a head dim and cache type the kernel is built
    for, whole query groups per KV head, and contiguous 16-byte aligned arrays (the kernel reads 16 bytes at a
    time)."""
    t, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if batch is None or t <= batch.num_seqs or head_dim not in FLASH_HEAD_DIMS or num_heads % num_kv_heads:
        return False
    if np.dtype(key_cache.dtype) not in FLASH_KV_DTYPES or value_cache.dtype != key_cache.dtype:
        return False
    if any(array.data.ptr % 16 or not array.flags.c_contiguous for array in (query, key_cache, value_cache)):
        return False
    return int(np.diff(batch.query_start).max()) >= FLASH_MIN_TOKENS


def flash_tiles(query_start: np.ndarray, positions: np.ndarray, group: int) -> np.ndarray:
    """int32 [N, 2]: (sequence, first row) of each block of FLASH_ROWS query rows, sequence b holding
    (query_start[b + 1] - query_start[b]) * group rows; the blocks whose last token sits furthest into its context
    (the most keys to read) come first."""
    return row_tiles(query_start[:-1], np.diff(query_start), positions, group)


def row_tiles(starts: np.ndarray, tokens: np.ndarray, positions: np.ndarray, group: int) -> np.ndarray:
    """int32 [N, 2]: (index into starts, first row) of each block of FLASH_ROWS query rows over sequences whose
    tokens are positions[starts[i] : starts[i] + tokens[i]], tokens[i] * group rows each; the blocks whose last token
    sits furthest into its context come first."""
    rows = tokens * group  # [B]
    counts = -(-rows // FLASH_ROWS)  # [B] blocks per sequence
    seqs = np.repeat(np.arange(len(rows)), counts)  # [N]
    first_block = np.concatenate([[0], np.cumsum(counts)[:-1]])  # [B]
    row0 = (np.arange(len(seqs)) - first_block[seqs]) * FLASH_ROWS  # [N]
    last_row = np.minimum(row0 + FLASH_ROWS, rows[seqs]) - 1  # [N]
    last_pos = positions[starts[seqs] + last_row // group]  # [N]
    order = np.argsort(-last_pos, kind="stable")
    return np.stack([seqs[order], row0[order]], axis=1).astype(np.int32)


@dataclass
class FlashLaunch:
    """One launch of flash_attention.cu, for the backend's launcher: the instantiation, grid and arguments, and the
    output array the kernel fills."""

    expression: str
    grid: tuple[int, int]
    args: tuple
    shared_mem: int  # bytes of dynamic shared memory
    out: object  # float32 [T, Q, D] device array


class FlashTileCache:
    """The device copy of the last tile list: the layers of a step share one, so it is uploaded once a step."""

    def __init__(self):
        self._host: np.ndarray | None = None  # [N, 2] int32
        self._device = None

    def tiles(self, cp, batch: ForwardBatch, group: int):
        host = flash_tiles(batch.query_start, batch.positions, group)
        if self._host is None or not np.array_equal(host, self._host):
            self._host, self._device = host, cp.asarray(host)
        return self._device


def flash_attention_launch(cp, tile_cache: FlashTileCache, query, key_cache, value_cache, batch: ForwardBatch,
                           device_batch, kv_type: str, scale: float, sliding_window: int | None,
                           split: bool, sink_logits) -> FlashLaunch:
    """The launch of flash_attention<kv_type, D, split> over a step that takes_flash_attention accepted (split:
    products of high and low bf16 parts, float32-close; else of bf16 operands only); sink_logits: a float32 [Q]
    device array or NULL."""
    t, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    tables = device_batch["block_tables"]  # [B, max_blocks] int64
    tiles = tile_cache.tiles(cp, batch, num_heads // num_kv_heads)  # [N, 2] int32
    out = cp.empty((t, num_heads, head_dim), np.float32)  # [T, Q, D]
    args = (query, key_cache, value_cache, tables, device_batch["query_start"], device_batch["positions"], tiles, out,
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(block_size), np.int32(tables.shape[1]),
            np.float32(scale), np.int32(sliding_window or 0), sink_logits)
    expression = f"flash_attention<{kv_type}, {head_dim}, {'true' if split else 'false'}>"
    return FlashLaunch(expression, (tiles.shape[0], num_kv_heads), args, flash_shared_bytes(kv_type, head_dim), out)


def flash_shared_bytes(kv_type: str, head_dim: int) -> int:
    """flash_attention's dynamic shared memory: bf16 rows of head_dim + FLASH_PAD, a ring of FLASH_STAGES tiles of
    64 keys and values for a bf16 cache, else the block's FLASH_ROWS queries' two parts (the tiles reuse them)."""
    rows = FLASH_STAGES * 2 * 64 if kv_type == "__nv_bfloat16" else 2 * FLASH_ROWS
    return rows * (head_dim + FLASH_PAD) * 2
