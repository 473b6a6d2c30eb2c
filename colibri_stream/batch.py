"""The contract between whoever schedules tokens and the model: one flat batch of tokens over a paged KV cache.

Sequences are laid end to end ("varlen"): a step may hold a chunk of one prompt, whole prompts and single decode
tokens of other sequences, all in one forward pass. The KV cache is paged: sequence b's tokens live in the blocks
listed in `block_tables[b]`, token at position p in block `block_tables[b][p // block_size]`, row `p % block_size`.
A model with sliding-window layers keeps theirs in a second pool: `sliding_block_tables` and `sliding_slot_mapping`
are the same for it (sliding_blocks.py), and those layers read the batch through `for_sliding_layers()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass
class ForwardBatch:
    """One model step's inputs, as host (NumPy) arrays; the backend copies them to its device."""

    token_ids: np.ndarray  # [T] int64: the tokens computed this step, sequence after sequence
    positions: np.ndarray  # [T] int64: position of each token in its sequence
    query_start: np.ndarray  # [B+1] int64: sequence b owns tokens query_start[b] : query_start[b + 1]
    context_lens: np.ndarray  # [B] int64: tokens of sequence b in the KV cache once this step's are written
    block_tables: np.ndarray  # [B, max_blocks] int64: KV block ids of each sequence (unused entries: 0)
    slot_mapping: np.ndarray  # [T] int64: KV slot (block_id * block_size + row) that each token's K/V fills
    logits_indices: np.ndarray  # [N] int64: rows of T whose logits the step returns (a sequence's last token)
    # the sliding-window layers' pool (None without one): block ids (released blocks: the pool's placeholder) and
    # the slot each token's K/V fills there
    sliding_block_tables: np.ndarray | None = None  # [B, max_blocks] int64
    sliding_slot_mapping: np.ndarray | None = None  # [T] int64

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def for_sliding_layers(self) -> ForwardBatch:
        """The batch as the sliding-window layers read it: their block tables and slots in place of the others'."""
        if self.sliding_block_tables is None:
            raise ValueError("the KV cache has sliding-window layers of their own, the batch no tables for them")
        return replace(self, block_tables=self.sliding_block_tables, slot_mapping=self.sliding_slot_mapping)

    def validate(self, block_size: int, num_blocks: int, num_sliding_blocks: int = 0) -> None:
        """Check the invariants the model relies on; raises ValueError naming the broken one."""
        t, b = self.num_tokens, self.num_seqs
        if self.positions.shape != (t,) or self.slot_mapping.shape != (t,):
            raise ValueError("positions and slot_mapping must have one entry per token")
        if self.query_start.shape != (b + 1,) or self.query_start[0] != 0 or self.query_start[-1] != t:
            raise ValueError("query_start must run from 0 to the number of tokens, one step per sequence")
        if np.any(np.diff(self.query_start) < 1):
            raise ValueError("every sequence in a batch must compute at least one token")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError("block_tables must be [num_seqs, max_blocks]")
        if np.any(self.context_lens > self.block_tables.shape[1] * block_size):
            raise ValueError("a sequence's context does not fit in its block table")
        if np.any(self.slot_mapping < 0) or np.any(self.slot_mapping >= num_blocks * block_size):
            raise ValueError("slot_mapping points outside the KV cache")
        if np.any((self.logits_indices < 0) | (self.logits_indices >= t)):
            raise ValueError("logits_indices must index this step's tokens")
        if self.sliding_block_tables is not None:
            if self.sliding_block_tables.shape != self.block_tables.shape or self.sliding_slot_mapping.shape != (t,):
                raise ValueError("the sliding tables and slots must have the shapes of the others")
            slots = self.sliding_slot_mapping
            if np.any(slots < 0) or np.any(slots >= num_sliding_blocks * block_size):
                raise ValueError("sliding_slot_mapping points outside the sliding-window layers' pool")


def flat_batch(chunks: Sequence[Sequence[int]], start_positions: Sequence[int],
               block_tables: Sequence[Sequence[int]], sample: Sequence[bool], block_size: int,
               sliding_block_tables: Sequence[Sequence[int]] | None = None) -> ForwardBatch:
    """The flat batch of sequences computing `chunks[b]` from `start_positions[b]` on over their block tables (and
    the sliding-window layers' tables, as long as theirs); logits are returned for the last token of each sequence
    whose `sample` is set."""
    lens = np.array([len(c) for c in chunks], dtype=np.int64)  # [B]
    starts = np.asarray(start_positions, dtype=np.int64)  # [B]
    query_start = np.zeros(len(chunks) + 1, dtype=np.int64)  # [B+1]
    np.cumsum(lens, out=query_start[1:])
    owner = np.repeat(np.arange(len(chunks)), lens)  # [T] sequence of each token
    positions = np.arange(query_start[-1], dtype=np.int64) - query_start[owner] + starts[owner]  # [T]
    tables = _padded_tables(block_tables)  # [B, max_blocks]
    sliding = None if sliding_block_tables is None else _padded_tables(sliding_block_tables)  # [B, max_blocks]
    return ForwardBatch(
        token_ids=np.fromiter((t for c in chunks for t in c), dtype=np.int64, count=int(query_start[-1])),
        positions=positions,
        query_start=query_start,
        context_lens=starts + lens,
        block_tables=tables,
        slot_mapping=tables[owner, positions // block_size] * block_size + positions % block_size,  # [T]
        logits_indices=query_start[1:][np.asarray(sample, dtype=bool)] - 1,  # [N]
        sliding_block_tables=sliding,
        sliding_slot_mapping=None if sliding is None else sliding[owner, positions // block_size] * block_size
        + positions % block_size,  # [T]
    )


def _padded_tables(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """The sequences' block tables as one array, short ones padded with block 0.  # [B, max_blocks] int64"""
    tables = np.zeros((len(block_tables), max(len(t) for t in block_tables)), dtype=np.int64)
    for b, table in enumerate(block_tables):
        tables[b, : len(table)] = table
    return tables


def single_sequence_batch(token_ids: Sequence[int], start_position: int, block_table: Sequence[int],
                          block_size: int) -> ForwardBatch:
    """A batch of one sequence computing `token_ids` from `start_position` on; returns the last token's logits."""
    return flat_batch([token_ids], [start_position], [block_table], [True], block_size)
