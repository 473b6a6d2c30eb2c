"""Multi-head Latent Attention on the GPU (DeepSeek-V3, Kimi K2) in the absorbed form, and the CuPy backend's
attention from array operations for what its kernels do not take.

Latent attention runs on kernels that read the batch on the device, so its decode steps are captured in CUDA
graphs: the rope parts and the cache rows (latent_attention.cu's latent_rope_write), each head's up-projection
(linear.cu's per_head_rows, for decode-sized steps; larger steps take cuBLAS's batched GEMM, cublas_gemm.py), and
attention over the rows [latent | rope key] on tensor cores (latent_attention: every query token over its own
causal range, decode tokens and prefill chunks alike; a decode token's context split over the GPU, the splits
combined by attention.cu's paged_attention_merge). Prefill chunks at matmul precision medium take the
decompressed form where they can (cupy_latent_prefill.py). Latent widths and cache dtypes the kernel is not compiled for
(`takes_latent_kernel`) attend through sequence_attention.py's array operations, a sequence at a time, reading the
batch on the host (never captured); `KvRows` widens cache rows of any storage dtype to float32 for that path (and
for sink logits' attention where a head is wider than the kernels take).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..batch import ForwardBatch
from .cublas_gemm import activation_parts, per_head_products
from .cupy_flash_attention import FLASH_PAD
from .cupy_launch import NULL, Array, ceil_div, launch, smallest_tile, storage_type
from .sequence_attention import paged_attention_rows
from .tuning import (LATENT_BLOCKS_PER_SM, LATENT_HEAD_TILES, LATENT_KERNEL_SHAPES, LATENT_MAX_SPLITS,
                     LATENT_SPLIT_KEYS, PER_HEAD_ROWS_MAX_TOKENS, TOKEN_TILES)

LATENT_FILE = "latent_attention.cu"
LATENT_KERNEL_TYPES = ("bfloat16", "float16", "float8_e4m3")  # cache storage dtypes latent_attention takes
LATENT_HEADS = 16  # = LATENT_HEADS in latent_attention.cu: query heads per block
LATENT_THREADS = 128  # = LATENT_THREADS in latent_attention.cu
LATENT_KEYS = 32  # = LATENT_KEYS in latent_attention.cu: keys per tile
LATENT_STAGES = 2  # = LATENT_STAGES in latent_attention.cu
ROPE_HEADS = 2  # = ROPE_HEADS in latent_attention.cu: query heads per block of latent_rope_write
HEAD_ROWS = 32  # = HEAD_ROWS in linear.cu: rows per block of per_head_rows

# the storage dtype of a device array -> its name for CupyBackend.from_float32
STORAGE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16",
                 np.dtype(np.uint8): "float8_e4m3"}


def takes_latent_kernel(kv_lora_rank: int, rotary_dim: int, kv_dtype: str) -> bool:
    """Whether the latent_attention kernel takes a latent cache of these widths and storage dtype."""
    return (kv_lora_rank, rotary_dim) in LATENT_KERNEL_SHAPES and kv_dtype in LATENT_KERNEL_TYPES


def latent_shared_bytes(rank: int, rope: int, kv_itemsize: int) -> int:
    """latent_attention's dynamic shared memory: tiles of LATENT_KEYS rows of rank + rope + FLASH_PAD 16-bit elements
    (LATENT_STAGES of them; an fp8 cache: one, and LATENT_STAGES tiles of its bytes as copied)."""
    tile = LATENT_KEYS * (rank + rope + FLASH_PAD) * 2
    if kv_itemsize == 1:
        return tile + LATENT_STAGES * LATENT_KEYS * (rank + rope)
    return LATENT_STAGES * tile


class KvRows:
    """Device arrays of any storage dtype (float32, bf16 bits as uint16, float16, fp8 e4m3 bits as uint8) widened
    to float32."""

    def __init__(self, cp: Any):
        self.cp = cp
        self._fp8_values: Any = None  # [256] float32: the value of each fp8 e4m3 code, made on first use

    def widen(self, rows: Any, scale: float = 1.0) -> Any:
        """rows as float32, times `scale`."""
        cp = self.cp
        dtype = np.dtype(rows.dtype)
        if dtype == np.uint16:
            out = (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif dtype == np.uint8:
            if self._fp8_values is None:
                codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                self._fp8_values = cp.asarray(codes.astype(np.float32))
            out = self._fp8_values[rows.astype(np.int32)]
        else:
            out = rows.astype(np.float32)
        return out if scale == 1.0 else out * np.float32(scale)


def per_head_linear(cp: Any, rows: KvRows, x: Any, weight: Any, num_parts: int) -> Any:
    """x [T, H, In] float32 (rows of In contiguous floats), weight [H, Out, In] (a storage dtype) -> [T, H, Out]:
    each head through its own matrix. Up to PER_HEAD_ROWS_MAX_TOKENS tokens, and inside a graph capture, one
    launch of per_head_rows that reads x in place; otherwise, for bf16 / fp16 weights, cuBLAS's batched GEMM on
    tensor cores over x's `num_parts` parts (the backend's matmul precision), for others one batched product of
    the widened weights."""
    t, heads, n_in = x.shape
    vector = 16 // np.dtype(weight.dtype).itemsize
    token_stride, head_stride = (s // 4 for s in x.strides[:2])
    in_place = (x.strides[2] == 4 and n_in % vector == 0 and x.data.ptr % 16 == 0 and token_stride % 4 == 0
                and head_stride % 4 == 0)
    capturing = cp.cuda.get_current_stream().is_capturing()
    if in_place and (t <= PER_HEAD_ROWS_MAX_TOKENS or capturing):
        n_out = weight.shape[1]
        out = cp.empty((t, heads, n_out), np.float32)  # [T, H, Out]
        tile = smallest_tile(t, TOKEN_TILES)
        w = storage_type(weight)
        launch("linear.cu", f"per_head_rows<{w}, {tile}>", (ceil_div(t, tile) * ceil_div(n_out, HEAD_ROWS), heads),
               128, (x, np.int64(token_stride), np.int64(head_stride), weight, out, np.int32(t), np.int32(heads),
                     np.int32(n_in), np.int32(n_out)), weight_type=w)
        return out
    if np.dtype(weight.dtype) in (np.dtype(np.uint16), np.dtype(np.float16)):
        parts = activation_parts(cp.ascontiguousarray(x).reshape(t, heads * n_in), weight, num_parts)  # [N*T, H*In]
        return per_head_products(parts, weight, num_parts)
    w = rows.widen(weight)  # [H, Out, In]
    return cp.ascontiguousarray(cp.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2))


def latent_rope_write(cp: Any, q: Any, latent: Any, k_rope: Any, cos: Any, sin: Any, positions: Any,
                      interleaved: bool, cache: Any, slot_mapping: Any, scale: float = 1.0) -> Any:
    """`Backend.latent_rope_write` in one launch of latent_rope_write: q's rope parts and k_rope rotated, the rows
    [latent | rotated k_rope] divided by `scale` and rounded into cache [num_blocks, block_size, 1, R + r] at
    slot_mapping (a negative slot stores nothing), and the query [q_nope | rotated q_rope] [T, Q, N + r] returned."""
    q, latent, k_rope = (cp.ascontiguousarray(a) for a in (q, latent, k_rope))
    t, heads, width = q.shape
    rank, rope = latent.shape[1], k_rope.shape[1]
    query = cp.empty((t, heads, width), np.float32)  # [T, Q, N + r]
    kv_type = storage_type(cache)
    launch(LATENT_FILE, f"latent_rope_write<{kv_type}>", (t, ceil_div(heads, ROPE_HEADS)), 256,
           (q, latent, k_rope, cos, sin, positions, slot_mapping, query, cache, np.int32(heads),
            np.int32(width - rope), np.int32(rank), np.int32(rope), np.int32(interleaved), np.float32(scale)),
           weight_type=kv_type)
    return query


def absorbed_latent_attention(backend: Any, q_latent: Array, q_rope: Array, cache: Array, batch: ForwardBatch,
                              device_batch: dict[str, Array], scale: float, kv_scale: float) -> Array:
    """`Backend.absorbed_latent_attention` on the GPU.  # q_latent [T, Q, R], q_rope [T, Q, r] -> [T, Q, R]

    Over a cache the latent_attention kernel takes: one launch (its q and probabilities in two bf16 parts at matmul
    precision high, one at medium), split over the context as flash_decode's are, from shapes only (inside a graph
    capture `batch` holds shapes): enough blocks to fill the GPU at the tables' full width, each token using as
    many splits as its own context fills, then paged_attention_merge (a prefill step's many tokens fill the GPU
    unsplit, its blocks taking two m-tiles of heads each). q_rope is read in place where its heads' rows are evenly
    strided (a view of latent_rope_write's query). Otherwise sequence_attention.py's array operations (host reads,
    never captured)."""
    cp = backend.cp
    t, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    kv_dtype = STORAGE_NAMES[np.dtype(cache.dtype)]
    if not takes_latent_kernel(rank, rope, kv_dtype):
        query = cp.concatenate([q_latent, q_rope], axis=2)  # [T, Q, R + r]
        return paged_attention_rows(cp, backend.kv_rows.widen, query, cache, cache, batch, scale, None,
                                    (kv_scale, kv_scale))[..., :rank]
    q_latent = cp.ascontiguousarray(q_latent)
    if q_rope.strides[2] != 4 or q_rope.strides[0] != heads * q_rope.strides[1] or q_rope.data.ptr % 8:
        q_rope = cp.ascontiguousarray(q_rope)
    tables = device_batch["block_tables"]  # [B, max_blocks] int64
    block_size = cache.shape[1]
    head_tiles = ceil_div(heads, LATENT_HEADS)  # a token's blocks a split, as flash_decode's KV heads
    split = backend.decode_splits(q_latent, head_tiles, tables.shape[1] * block_size, LATENT_MAX_SPLITS,
                                  LATENT_BLOCKS_PER_SM, LATENT_SPLIT_KEYS, rank)
    # m-tiles a block: the widest where the tokens alone fill the GPU (then unsplit), else one
    filled = t * head_tiles >= LATENT_BLOCKS_PER_SM * backend.multiprocessors
    m_tiles = LATENT_HEAD_TILES[-1] if filled else LATENT_HEAD_TILES[0]
    out = cp.empty((t, heads, rank), np.float32)  # [T, Q, R]
    kv_type = storage_type(cache)
    two_parts = "true" if backend.activation_parts == 2 else "false"
    launch(LATENT_FILE, f"latent_attention<{kv_type}, {rank}, {rope}, {two_parts}, {m_tiles}>",
           (t, ceil_div(heads, m_tiles * LATENT_HEADS), split.splits), m_tiles * LATENT_THREADS,
           (q_latent, q_rope, np.int32(q_rope.strides[1] // 4), cache, tables, device_batch["query_start"],
            device_batch["positions"], out, split.acc, split.ml, np.int32(tables.shape[0]), np.int32(heads),
            np.int32(block_size), np.int32(tables.shape[1]), np.float32(scale * kv_scale), np.float32(kv_scale),
            np.int32(split.split_keys)),
           shared_mem=latent_shared_bytes(rank, rope, cache.itemsize), weight_type=kv_type)
    backend.merge_splits(split, out, device_batch, np.int32(0), kv_type, NULL)
    return out
