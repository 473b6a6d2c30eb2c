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
non-token inputs (images), and positions are those of the chain. The pool's blocks and entries are
block_pool.py's; the sliding-window layers' second pool and tables are sliding_blocks.py's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .block_pool import ROOT, BlockPool
from .sliding_blocks import SlidingBlocks


@dataclass
class CachedPrefix:
    """The cached blocks a sequence can start from: its first `len(block_ids)` blocks' KV, already computed."""

    block_ids: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)  # the entry id of each block, in order
    # with sliding-window layers: the sliding table the sequence starts with, as long as block_ids (the window's
    # cached blocks, placeholders before them; SlidingBlocks.cached_window)
    sliding_block_ids: list[int] = field(default_factory=list)

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class KVCacheManager:
    """Block tables of the sequences that hold KV blocks; grows them as sequences advance and frees them.

    `allocate_slots` is all-or-nothing: it either gives a sequence every block it needs for the requested number
    of tokens, or changes nothing but letting go of sliding blocks no step reads again and returns None, so the
    caller can preempt another sequence and retry.

    With `enable_prefix_caching`, `find_cached_prefix` finds the longest run of cached blocks that a new sequence's
    tokens start with (never its last token, which must be computed for its logits), `allocate_slots(..., prefix)`
    starts the sequence's table with them (shared, reference counted), and `cache_blocks` registers a sequence's
    full blocks once their KV is computed. A sequence never writes into a cached block: it only writes positions at
    or after its computed tokens, and cached blocks lie wholly before them.

    With `sliding_window` (and `num_sliding_blocks`), the sliding-window layers' blocks come from a second pool
    (`sliding`, sliding_blocks.py): each sequence has a second table of the same length, whose blocks before the
    window of its step are released as it advances; a cached prefix serves only as far as its last window of
    sliding blocks is cached too.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, num_sliding_blocks: int = 0):
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.sliding = None if sliding_window is None else SlidingBlocks(num_sliding_blocks, block_size,
                                                                         sliding_window)
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
        (len(token_ids) - 1) // block_size of them so that the last token is always computed; with sliding-window
        layers cut back to the longest whose last window of sliding blocks is cached."""
        prefix = CachedPrefix()
        if not self.enable_prefix_caching:
            return prefix
        size, parent, keys = self.block_size, ROOT, []
        for i in range((len(token_ids) - 1) // size):
            key = (parent, tuple(token_ids[i * size:(i + 1) * size]))
            entry = self.pool.lookup(key)
            if entry is None:
                break
            prefix.block_ids.append(self.pool.entry_block(entry))
            prefix.entries.append(entry)
            keys.append(key)
            parent = entry
        if self.sliding is not None:
            prefix.sliding_block_ids = self.sliding.cached_window(keys)
            del prefix.block_ids[len(prefix.sliding_block_ids):], prefix.entries[len(prefix.sliding_block_ids):]
        return prefix

    def allocate_slots(self, seq_id: Hashable, num_tokens: int, prefix: CachedPrefix | None = None,
                       num_computed: int = 0) -> list[int] | None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens for a step whose tokens start at position
        `num_computed`; returns the new block ids, None if too few are free. Sliding blocks wholly before the first
        position that step reads are released, whether or not the rest succeeds.

        `prefix` (from `find_cached_prefix`, only for a sequence holding no blocks) starts the table with cached
        blocks; the returned ids are the blocks allocated after them."""
        cached = prefix.block_ids if prefix is not None else []
        sliding_cached = prefix.sliding_block_ids if prefix is not None else []
        if cached and seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks; a cached prefix starts a table")
        if self.sliding is not None:
            self.sliding.release(seq_id, num_computed)
        need = max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())) - len(cached))
        if need + self.pool.num_free_among(cached) > self.pool.num_free:
            return None
        if self.sliding is not None and not self.sliding.can_allocate(need, sliding_cached):
            return None
        if cached:
            self.pool.take(cached)  # first, so that allocating the new blocks cannot evict them
            self._tables[seq_id] = list(cached)
            self._chains[seq_id] = list(prefix.entries)
        new = self.pool.allocate(need)
        self._tables.setdefault(seq_id, []).extend(new)
        if self.sliding is not None:
            self.sliding.allocate(seq_id, need, sliding_cached)
        return new

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register `seq_id`'s full blocks among its first `num_computed_tokens` tokens (their KV computed) in the
        prefix cache, its sliding blocks still held under the same keys; `token_ids` are the sequence's tokens (at
        least that many)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        chain = self._chains.setdefault(seq_id, [])
        size = self.block_size
        for i in range(len(chain), min(num_computed_tokens // size, len(table))):
            key = (chain[-1] if chain else ROOT, tuple(token_ids[i * size:(i + 1) * size]))
            chain.append(self.pool.register(table[i], key))
            if self.sliding is not None:
                self.sliding.register(seq_id, i, key)

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """The blocks of `seq_id` in position order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def sliding_block_ids(self, seq_id: Hashable) -> list[int] | None:
        """The sliding-window layers' blocks of `seq_id` in position order, released ones the placeholder; None
        without sliding-window layers."""
        return None if self.sliding is None else self.sliding.block_ids(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Release every block of `seq_id`; blocks other sequences share stay theirs. A sequence holding none is
        ignored."""
        self.pool.free(self._tables.pop(seq_id, []))
        self._chains.pop(seq_id, None)
        if self.sliding is not None:
            self.sliding.free(seq_id)
