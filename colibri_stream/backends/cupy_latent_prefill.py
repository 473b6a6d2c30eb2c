"""Multi-head Latent Attention's prefill chunks in the decompressed form (kernels/latent_prefill.cu).

The absorbed form (cupy_latent.py) attends with every query head over the cached latent rows themselves: R + r
multiply-adds a key for the score and R for the output (576 + 512 for DeepSeek-V3). A prefill chunk has many query
tokens over the same context, so it pays to take that context back through kv_b_proj once a layer, to each head's
key no-rope part and value, and attend with N + r and Dv (192 + 128), as vLLM's and SGLang's prefill do:

1. `latent_gather` copies the cached rows of the chosen sequences' whole contexts (every position up to the chunk's
   last, the chunk's own rows included: latent_rope_write stored them first) into contiguous rows, latent and rope
   parts apart, widened from the cache's dtype and scale to bf16;
2. two strided batched GEMMs on cuBLAS (cublas_gemm.per_head_expansion) give every head's key no-rope part (k_up)
   and value (v_up) of each row, [C, Q, N + Dv] bf16;
3. `latent_prefill_attention` attends flash-style on tensor cores, every query token over its causal range.

Which sequences (`plan_latent_prefill`, on the host, once a step): those computing LATENT_PREFILL_MIN_TOKENS tokens
or more, in batch order while their contexts' rows fit LATENT_PREFILL_MAX_BYTES; the step's other sequences (decode
tokens, short chunks) keep the absorbed form as a batch of their own. The operands are bf16, so the form is taken at
matmul precision medium only (high keeps the absorbed form's split products, within about 1e-5 of float32), for
bf16 up-projections and the widths the kernel is built for (tuning.LATENT_PREFILL_SHAPES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batch import ForwardBatch
from . import tuning
from .cublas_gemm import per_head_expansion
from .cupy_flash_attention import FLASH_PAD, row_tiles
from .cupy_launch import Array, launch, storage_type

PREFILL_FILE = "latent_prefill.cu"
PREFILL_THREADS = 128  # = PREFILL_THREADS in latent_prefill.cu
PREFILL_KEYS = 64  # = PREFILL_KEYS in latent_prefill.cu: keys per tile
PREFILL_STAGES = 2  # = PREFILL_STAGES in latent_prefill.cu


@dataclass
class LatentPrefillPlan:
    """A prefill step's split between the two forms of latent attention, on the host."""

    decompressed: np.ndarray  # [S] int64: batch indices of the sequences taking the decompressed form
    key_start: np.ndarray  # [S + 1] int64: row key_start[s] + j of the decompressed arrays is position j of seq s
    tiles: np.ndarray  # [M, 2] int32: (decompressed sequence, first query row) of each block, longest first
    absorbed: np.ndarray  # [B'] int64: batch indices of the other sequences

    @property
    def context_rows(self) -> int:
        return int(self.key_start[-1])


def plan_latent_prefill(batch: ForwardBatch, min_tokens: int, max_rows: int) -> LatentPrefillPlan | None:
    """The sequences of `batch` computing `min_tokens` tokens or more, in batch order while their contexts hold at
    most `max_rows` rows in all, take the decompressed form; None when none does."""
    tokens = np.diff(batch.query_start)  # [B]
    chosen = np.flatnonzero(tokens >= min_tokens)
    chosen = chosen[np.cumsum(batch.context_lens[chosen]) <= max_rows]
    if not len(chosen):
        return None
    key_start = np.concatenate([[0], np.cumsum(batch.context_lens[chosen])]).astype(np.int64)
    tiles = row_tiles(batch.query_start[chosen], tokens[chosen], batch.positions, 1)
    return LatentPrefillPlan(chosen, key_start, tiles, np.setdiff1d(np.arange(batch.num_seqs), chosen))


def sequences_batch(batch: ForwardBatch, seqs: np.ndarray) -> tuple[ForwardBatch, np.ndarray]:
    """The batch of sequences `seqs` alone (no logits rows), and the rows of their tokens in `batch` [T'] int64."""
    starts, ends = batch.query_start[seqs], batch.query_start[seqs + 1]
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]).astype(np.int64)  # [T']
    query_start = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)  # [B' + 1]
    return ForwardBatch(token_ids=batch.token_ids[rows], positions=batch.positions[rows], query_start=query_start,
                        context_lens=batch.context_lens[seqs], block_tables=batch.block_tables[seqs],
                        slot_mapping=batch.slot_mapping[rows], logits_indices=np.zeros(0, np.int64)), rows


@dataclass
class AbsorbedPart:
    """The sequences of a prefill step that keep the absorbed form: their batch, its arrays on the device, and the
    rows of their tokens in the step."""

    batch: ForwardBatch
    device_batch: dict[str, Array]  # block_tables, query_start, positions
    rows: Array  # [T'] int64


@dataclass
class DevicePlan:
    """A LatentPrefillPlan's arrays on the device."""

    decompressed: Array  # [S] int32
    key_start: Array  # [S + 1] int64
    tiles: Array  # [M, 2] int32
    context_rows: int
    absorbed: AbsorbedPart | None


class LatentPrefill:
    """The decompressed form of the CuPy backend's latent attention: which steps take it, and the last step's plan
    on the device (a step's layers share it, so it is made and uploaded once a step)."""

    def __init__(self, cp: Any):
        self.cp = cp
        self._key: tuple[bytes, ...] | None = None  # the batch arrays the plan was made from
        self._plan: DevicePlan | None = None

    def plan(self, query: Array, k_up: Array, v_up: Array, cache: Array, batch: ForwardBatch | None,
             activation_parts: int) -> DevicePlan | None:
        """The step's plan, or None where the whole step keeps the absorbed form: inside a graph capture or a step
        of one token a sequence, at matmul precision high, for up-projections other than bf16, widths the kernel
        is not built for, or no sequence long enough."""
        cp = self.cp
        heads, _, nope = k_up.shape
        widths = (nope, query.shape[2] - nope, v_up.shape[1])
        if batch is None or batch.num_tokens <= batch.num_seqs or activation_parts != 1:
            return None
        if widths not in tuning.LATENT_PREFILL_SHAPES or np.dtype(k_up.dtype) != np.uint16:
            return None
        if cp.cuda.get_current_stream().is_capturing() or not query.flags.c_contiguous:
            return None
        row_bytes = 2 * (heads * (widths[0] + widths[2]) + cache.shape[-1])
        max_rows = tuning.LATENT_PREFILL_MAX_BYTES // row_bytes
        key = (np.int64(max_rows).tobytes(), *(np.ascontiguousarray(a).tobytes() for a in (
            batch.query_start, batch.context_lens, batch.positions, batch.block_tables)))
        if key != self._key:
            host = plan_latent_prefill(batch, tuning.LATENT_PREFILL_MIN_TOKENS, max_rows)
            self._key, self._plan = key, None if host is None else self._upload(batch, host)
        return self._plan

    def _upload(self, batch: ForwardBatch, host: LatentPrefillPlan) -> DevicePlan:
        cp = self.cp
        absorbed = None
        if len(host.absorbed):
            part, rows = sequences_batch(batch, host.absorbed)
            absorbed = AbsorbedPart(part, {name: cp.asarray(getattr(part, name))
                                           for name in ("block_tables", "query_start", "positions")}, cp.asarray(rows))
        return DevicePlan(cp.asarray(host.decompressed.astype(np.int32)), cp.asarray(host.key_start),
                          cp.asarray(host.tiles), host.context_rows, absorbed)


def prefill_shared_bytes(nope: int, rope: int, value_dim: int) -> int:
    """latent_prefill_attention's dynamic shared memory: PREFILL_STAGES tiles of PREFILL_KEYS key rows of
    nope + rope + FLASH_PAD and value rows of value_dim + FLASH_PAD bf16."""
    return PREFILL_STAGES * PREFILL_KEYS * (nope + rope + value_dim + 2 * FLASH_PAD) * 2


def decompressed_attention(cp: Any, plan: DevicePlan, query: Array, k_up: Array, v_up: Array, cache: Array,
                           device_batch: dict[str, Array], scale: float, kv_scale: float, out: Array) -> None:
    """Attention of the plan's decompressed sequences, written into their tokens' rows of out [T, Q, Dv].
    query [T, Q, N + r] float32 (latent_rope_write's), k_up [Q, R, N] and v_up [Q, Dv, R] bf16, cache [num_blocks,
    block_size, 1, R + r] (stored values times kv_scale)."""
    heads, rank, nope = k_up.shape
    rope, value_dim = query.shape[2] - nope, v_up.shape[1]
    rows = plan.context_rows
    tables = device_batch["block_tables"]  # [B, max_blocks] int64
    kv_type = storage_type(cache)
    latent = cp.empty((rows, rank), np.uint16)  # [C, R] bf16
    rope_keys = cp.empty((rows, rope), np.uint16)  # [C, r] bf16
    launch(PREFILL_FILE, f"latent_gather<{kv_type}, __nv_bfloat16>", (rows,), 128,
           (cache, tables, plan.decompressed, plan.key_start, np.int32(len(plan.decompressed)),
            np.int32(tables.shape[1]), np.int32(cache.shape[1]), np.int32(rank), np.int32(rope), np.float32(kv_scale),
            latent, rope_keys), weight_type=kv_type)
    keys_values = cp.empty((rows, heads, nope + value_dim), np.uint16)  # [C, Q, N + Dv] bf16
    per_head_expansion(latent, k_up, keys_values, 0, inputs_first=True)
    per_head_expansion(latent, v_up, keys_values, nope, inputs_first=False)
    launch(PREFILL_FILE, f"latent_prefill_attention<{nope}, {rope}, {value_dim}>", (plan.tiles.shape[0], heads),
           PREFILL_THREADS, (query, keys_values, rope_keys, plan.key_start, plan.decompressed,
                             device_batch["query_start"], device_batch["positions"], plan.tiles, out,
                             np.int32(heads), np.float32(scale)),
           shared_mem=prefill_shared_bytes(nope, rope, value_dim), weight_type=kv_type)
