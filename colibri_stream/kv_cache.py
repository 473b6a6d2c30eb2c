"""Block bookkeeping for the paged KV cache: which fixed-size blocks each sequence owns.

Pure Python, no arrays: the model owns the cache memory, this module only hands out block ids. A sequence's
token at position p lives in block `block_ids(seq)[p // block_size]`, row `p % block_size`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockPool:
    """A fixed set of block ids. Allocation takes from the front of the free queue, freed blocks join its back."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Block tables of the sequences that hold KV blocks; grows them as sequences advance and frees them.

    `allocate_slots` is all-or-nothing: it either gives a sequence every block it needs for the requested number
    of tokens, or changes nothing and returns None, so the caller can preempt another sequence and retry.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `seq_id` lacks to hold its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def allocate_slots(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens; returns the new block ids, None if too few are free."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > self.pool.num_free:
            return None
        new = self.pool.allocate(need)
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """The blocks of `seq_id` in position order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def free(self, seq_id: Hashable) -> None:
        """Give back every block of `seq_id`; a sequence holding none is ignored."""
        self.pool.free(self._tables.pop(seq_id, []))
