"""Block bookkeeping for the paged KV cache: which fixed-size blocks each sequence owns, and which full blocks hold
KV that a later sequence with the same leading tokens can reuse (automatic prefix caching).

Pure Python, no arrays: the model owns the cache memory, this module only hands out block ids. A sequence's
token at position p lives in block `block_ids(seq)[p // block_size]`, row `p % block_size`.

Prefix cache. A full block whose KV has been computed is registered under an exact key: (the cache entry id of the
previous block of its sequence, or ROOT for the first block; the tuple of the block's token ids). Entry ids are
never reused, so an entry id stands for exactly one chain of token blocks from position 0: two blocks with equal
tokens after different prefixes get different keys, and when an entry is evicted its children become unreachable
(their keys name an id no lookup will produce again) and age out of the LRU set like any free block. The KV of a
block depends on nothing else: the model's weights are fixed per engine, there are no adapters (LoRA) and no
non-token inputs (images), and positions are those of the chain.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

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


@dataclass
class CachedPrefix:
    """The cached blocks a sequence can start from: its first `len(block_ids)` blocks' KV, already computed."""

    block_ids: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)  # the entry id of each block, in order

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class KVCacheManager:
    """Block tables of the sequences that hold KV blocks; grows them as sequences advance and frees them.

    `allocate_slots` is all-or-nothing: it either gives a sequence every block it needs for the requested number
    of tokens, or changes nothing and returns None, so the caller can preempt another sequence and retry.

    With `enable_prefix_caching`, `find_cached_prefix` finds the longest run of cached blocks that a new sequence's
    tokens start with (never its last token, which must be computed for its logits), `allocate_slots(..., prefix)`
    starts the sequence's table with them (shared, reference counted), and `cache_blocks` registers a sequence's
    full blocks once their KV is computed. A sequence never writes into a cached block: it only writes positions at
    or after its computed tokens, and cached blocks lie wholly before them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        self._chains: dict[Hashable, list[int]] = {}  # seq -> entry id of each of its registered full blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for allocation, cached ones that no sequence holds included."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.pool.num_blocks - self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `seq_id` lacks to hold its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def find_cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of cached blocks matching `token_ids`' leading full blocks, at most
        (len(token_ids) - 1) // block_size of them so that the last token is always computed."""
        prefix = CachedPrefix()
        if not self.enable_prefix_caching:
            return prefix
        size, parent = self.block_size, ROOT
        for i in range((len(token_ids) - 1) // size):
            entry = self.pool.lookup((parent, tuple(token_ids[i * size:(i + 1) * size])))
            if entry is None:
                break
            prefix.block_ids.append(self.pool.entry_block(entry))
            prefix.entries.append(entry)
            parent = entry
        return prefix

    def allocate_slots(self, seq_id: Hashable, num_tokens: int, prefix: CachedPrefix | None = None
                       ) -> list[int] | None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens; returns the new block ids, None if too few are free.

        `prefix` (from `find_cached_prefix`, only for a sequence holding no blocks) starts the table with cached
        blocks; the returned ids are the blocks allocated after them."""
        cached = prefix.block_ids if prefix is not None else []
        if cached and seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks; a cached prefix starts a table")
        need = max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())) - len(cached))
        if need + self.pool.num_free_among(cached) > self.pool.num_free:
            return None
        if cached:
            self.pool.take(cached)  # first, so that allocating the new blocks cannot evict them
            self._tables[seq_id] = list(cached)
            self._chains[seq_id] = list(prefix.entries)
        new = self.pool.allocate(need)
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register `seq_id`'s full blocks among its first `num_computed_tokens` tokens (their KV computed) in the
        prefix cache; `token_ids` are the sequence's tokens (at least that many)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        chain = self._chains.setdefault(seq_id, [])
        size = self.block_size
        for i in range(len(chain), min(num_computed_tokens // size, len(table))):
            key = (chain[-1] if chain else ROOT, tuple(token_ids[i * size:(i + 1) * size]))
            chain.append(self.pool.register(table[i], key))

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """The blocks of `seq_id` in position order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def free(self, seq_id: Hashable) -> None:
        """Release every block of `seq_id`; blocks other sequences share stay theirs. A sequence holding none is
        ignored."""
        self.pool.free(self._tables.pop(seq_id, []))
        self._chains.pop(seq_id, None)
