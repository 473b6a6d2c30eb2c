"""Block tables of the sliding-window layers: a second block pool, whose blocks a sequence lets go of once no step
of it reads them again.

A layer with a window W attends from position p to positions p - W + 1 .. p only, so a step computing positions
c .. c + n - 1 of a sequence reads nothing before c - W + 1 in those layers. Their KV lives in a pool of its own
(`SlidingBlocks.pool`), and each sequence holds a second table of the same logical length as its full table
(position p in entry p // block_size). When a step is allocated, the blocks wholly before the first position it
reads are released, and their entries become `placeholder`: the block past the pool's last, which no sequence
writes (its rows stay zero) and no attention kernel reads (each starts at the window; the NumPy attention gathers
whole tables and masks it). A sequence then holds about (W + the step's tokens) / block_size + 1 sliding blocks,
however long its context. A step scheduled while the one before it still runs (scheduler.schedule_next) releases
only what that one no longer reads.

Prefix caching: a sliding block is registered under the same key as the full table's block of its position
(kv_cache.py), in this pool's own entries; a released block that holds an entry waits in the pool's LRU set like
any cached block. A cached prefix of k blocks serves a new sequence only when its last window of sliding blocks is
cached too (`cached_window`): the sequence goes on reading them. Recomputing them instead is no way out: the
recomputed tokens would attend to sliding keys before them that were never written.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .block_pool import BlockKey, BlockPool


def sliding_blocks_per_seq(window: int, block_size: int, step_tokens: int) -> int:
    """The most sliding blocks a sequence holds in a step of `step_tokens` of its tokens: those of its last
    window - 1 tokens and of the step's (positions c - W + 1 .. c + n - 1), one more where they start mid-block."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


class SlidingBlocks:
    """The sliding-window layers' pool and every sequence's table in it (released entries: `placeholder`)."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        if window < 1:
            raise ValueError("a sliding window holds at least one token")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        self.placeholder = num_blocks  # the cache arrays' extra block: never allocated, never written
        self._tables: dict[Hashable, list[int]] = {}
        self._released: dict[Hashable, int] = {}  # seq -> its leading entries that are the placeholder

    def first_block_read(self, num_computed: int) -> int:
        """The first block a step whose tokens start at position `num_computed` reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """`seq_id`'s table in position order, released entries the placeholder (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def release(self, seq_id: Hashable, num_computed: int) -> None:
        """Let go of `seq_id`'s blocks wholly before the first position its step from `num_computed` on reads."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        done, upto = self._released.get(seq_id, 0), min(self.first_block_read(num_computed), len(table))
        if upto > done:
            self.pool.free(table[done:upto])
            table[done:upto] = [self.placeholder] * (upto - done)
            self._released[seq_id] = upto

    def can_allocate(self, count: int, cached: Sequence[int]) -> bool:
        """Whether `count` new blocks and the cached window `cached` (`cached_window`'s, placeholders included) can
        be held at once."""
        held = [block for block in cached if block != self.placeholder]
        return count + self.pool.num_free_among(held) <= self.pool.num_free

    def allocate(self, seq_id: Hashable, count: int, cached: Sequence[int]) -> None:
        """Append `count` new blocks to `seq_id`'s table; `cached` (only for a sequence holding none) starts it.
        The caller checked `can_allocate`."""
        if cached:
            released = cached.count(self.placeholder)
            self.pool.take(cached[released:])  # first, so that allocating the new blocks cannot evict them
            self._tables[seq_id] = list(cached)
            self._released[seq_id] = released
        self._tables.setdefault(seq_id, []).extend(self.pool.allocate(count))

    def register(self, seq_id: Hashable, index: int, key: BlockKey) -> None:
        """Register `seq_id`'s block `index` (full, its KV computed) under `key`, the full table's key of that
        position; a block already released is no longer the sequence's to register."""
        block = self._tables[seq_id][index]
        if block != self.placeholder:
            self.pool.register(block, key)

    def cached_window(self, keys: Sequence[BlockKey]) -> list[int]:
        """The sliding table a new sequence starts with when `keys` (those of the full blocks cached in a row from
        its first) are its cached prefix: for the longest run of the first k whose blocks from
        first_block_read(k * block_size) to k - 1 are cached, placeholders then those blocks; [] when none is."""
        entries = [self.pool.lookup(key) for key in keys]
        present = []  # present[i]: the cached blocks in a row that end with block i
        for entry in entries:
            present.append(present[-1] + 1 if present and entry is not None else int(entry is not None))
        for k in range(len(keys), 0, -1):
            first = self.first_block_read(k * self.block_size)
            if present[k - 1] >= k - first:
                return [self.placeholder] * first + [self.pool.entry_block(e) for e in entries[first:k]]
        return []

    def free(self, seq_id: Hashable) -> None:
        """Release every block `seq_id` still holds."""
        table = self._tables.pop(seq_id, [])
        self.pool.free(table[self._released.pop(seq_id, 0):])
