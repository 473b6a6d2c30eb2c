"""The blocks of one KV pool: a fixed set of block ids, their reference counts, and the prefix cache's entries
(kv_cache.py says what a key stands for). Pure Python, no arrays."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

ROOT = 0  # the "previous entry" of a sequence's first block; entry ids start at 1

BlockKey = tuple[int, tuple[int, ...]]  # (entry id of the previous block or ROOT, the block's token ids)


class BlockPool:
    """A fixed set of block ids with reference counts and the prefix cache's entries.

    A block is free when no sequence holds it. Free blocks without a cache entry wait in a FIFO queue; free blocks
    that hold an entry wait in an LRU set and keep their KV until allocation needs them. Allocation takes never-cached
    free blocks first (front of the queue), then evicts the least recently used cached ones, dropping their entries.
    Both kinds count as free (`num_free`), so caching never lowers what running sequences can get.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, no cache entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, holding an entry; least recently used first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._entries: dict[BlockKey, int] = {}  # key -> entry id
        self._entry_blocks: dict[int, int] = {}  # entry id -> the block holding its KV
        self._block_entries: dict[int, tuple[int, BlockKey]] = {}  # block -> (entry id, key)
        self._next_entry = ROOT + 1

    @property
    def num_free(self) -> int:
        """Blocks allocation can hand out: never-cached free blocks plus cached blocks no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a cache entry (held by sequences or not)."""
        return len(self._block_entries)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each held once: never-cached free blocks first, then the least recently used cached."""
        if count > self.num_free:
            raise ValueError(f"asked for {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                entry, key = self._block_entries.pop(block)
                del self._entries[key], self._entry_blocks[entry]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def take(self, block_ids: Sequence[int]) -> None:
        """Hold cached blocks once more (a sequence reusing them); a free one leaves the LRU set."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Release one hold on each of a sequence's blocks (in position order). Blocks nobody holds any more become
        free: uncached ones join the back of the queue in order, cached ones the most recently used end of the LRU
        set tail first, so a sequence's later blocks are evicted before its earlier ones, which more prompts share."""
        cached = []
        for block in block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._block_entries:
                    cached.append(block)
                else:
                    self._free.append(block)
        for block in reversed(cached):
            self._evictable[block] = None

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` (cached blocks) no sequence holds: taking them uses up free blocks."""
        return sum(self._refs[block] == 0 for block in block_ids)

    def lookup(self, key: BlockKey) -> int | None:
        """The entry id registered under `key`, or None."""
        return self._entries.get(key)

    def entry_block(self, entry: int) -> int:
        return self._entry_blocks[entry]

    def register(self, block_id: int, key: BlockKey) -> int:
        """Make `block_id` (held, full, its KV computed, no entry yet) the cache entry of `key`; returns the id.

        When another block already holds `key`, that entry's id is returned and `block_id` stays uncached."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if block_id in self._block_entries:
            raise ValueError(f"block {block_id} already holds a cache entry")
        entry = self._next_entry
        self._next_entry += 1
        self._entries[key] = entry
        self._entry_blocks[entry] = block_id
        self._block_entries[block_id] = (entry, key)
        return entry
