"""Where the GPU tier's expert blocks come from: one interface over pinned host memory, a host tier and experts.bin.

A block is an expert in experts.bin's layout (checkpoint.expert_block_layout), held as a [block_size] uint8 row of
pinned host memory, the only memory the GPU copies from asynchronously. `GpuTieredStore` moves blocks and never
looks inside one; what it asks of a source is here: whether a block is in host memory now, the block itself (with
a `release(event)` to call once the copy that reads it is queued), a read of a block from experts.bin into a
staging buffer (loader threads), and the source's counters. The sources:

- `PinnedSource`: every block in pinned memory (`PinnedExperts`, an L2 budget that holds them all).
- `HostTierSource`: some blocks in a pinned `HostTier` with its own eviction policy (`TieredExpertStore`); the
  others are read from experts.bin through a staging ring.
- `DiskSource`: no L2 budget: every block read from experts.bin through a staging ring.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ..checkpoint import ExpertFile
from .pinned import PinnedExperts, StagingRing
from .stats import ExpertStats, TierStats
from .tiers import BlockReader, TieredExpertStore

Release = Callable[[object], None]  # called with the CUDA event after which the block's memory may be reused
LOADER_THREADS = 4  # the GPU tier's threads reading prefetched blocks that are not in host memory
STAGING_BUFFERS = LOADER_THREADS + 2  # pinned buffers of a staging ring: one per loader thread, and two more


def _keep(event) -> None:
    """The release of a block that is never reused (pinned blocks held for the whole run)."""


class BlockSource(ABC):
    """Pinned host blocks of (layer, expert) for the GPU tier; see the module docstring.

    `counts` are the store's per-tier counters (`tier_names` besides "gpu"), which the store hands over with every
    fresh set of statistics; a source adds its hits and bytes to them on the step thread only.
    """

    tier_names: tuple[str, ...] = ("disk",)
    has_host_blocks: bool = True  # some blocks are in host memory, so an expert can be cut (copy and CPU read one)

    def __init__(self, expert_file: ExpertFile, reader: BlockReader):
        self.file, self.reader = expert_file, reader
        self.block_size = expert_file.block_size
        self.counts: dict[str, TierStats] = {}
        self._ring = StagingRing(self.block_size, STAGING_BUFFERS)

    @abstractmethod
    def in_memory(self, layer: int, expert: int) -> bool:
        """Whether the block is in host memory now (no read from experts.bin to use it)."""

    @abstractmethod
    def block(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        """(pinned block [block_size] uint8, its release) of (layer, expert), counted; on the step thread."""

    def count_disk_read(self) -> None:
        """Count one block read from experts.bin (on the step thread, for a read another thread makes)."""
        disk = self.counts["disk"]
        disk.hits += 1
        disk.bytes_read += self.block_size

    def read_staged(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        """Read (layer, expert) from experts.bin into a staging buffer (checked against its CRC32): (buffer,
        release); not counted (`count_disk_read`). Safe from any thread."""
        index = self._ring.acquire()
        try:
            self.reader.read_into(layer, expert, self._ring.buffers[index])
        except BaseException:
            self._ring.release(index)
            raise
        return self._ring.buffers[index], lambda event: self._ring.release(index, event)

    def begin_layer(self, layer: int, experts: list[int]) -> None:
        """The step of MoE layer `layer` will read the blocks of `experts` (a host tier loads what it lacks)."""

    def sample_blocks(self, layer: int, first: int, second: int) -> tuple[np.ndarray, np.ndarray]:
        """Two blocks of `layer` in pinned memory, for measuring rates at start (they may be overwritten later)."""
        one, two = self._ring.buffers[0], self._ring.buffers[1]
        self.reader.read_into(layer, first, one)
        self.reader.read_into(layer, second, two)
        return one, two

    def layout_block(self, layer: int) -> np.ndarray | None:
        """A pinned block whose tensors' offsets hold for every block (the CPU worker's layout), or None where the
        CPU reads no host blocks (every block it computes comes from experts.bin on its own thread)."""
        return self._ring.buffers[0]

    def merged_stats(self, snapshot: ExpertStats) -> ExpertStats:
        """The store's snapshot with the source's own counters added."""
        return snapshot

    def close(self) -> None:
        self.reader.close()


class PinnedSource(BlockSource):
    """Every block in pinned host memory, read and checked at start; never evicted."""

    tier_names = ("host", "disk")

    def __init__(self, expert_file: ExpertFile, reader: BlockReader, pinned: PinnedExperts):
        # no staging ring: no block is ever read from experts.bin after start
        self.file, self.reader, self.pinned = expert_file, reader, pinned
        self.block_size = expert_file.block_size
        self.counts = {}

    def in_memory(self, layer: int, expert: int) -> bool:
        return True

    def block(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        host = self.counts["host"]
        host.hits += 1
        host.bytes_read += self.block_size
        return self.pinned.block(layer, expert), _keep

    def read_staged(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        return self.pinned.block(layer, expert), _keep  # in memory: nothing to read

    def sample_blocks(self, layer: int, first: int, second: int) -> tuple[np.ndarray, np.ndarray]:
        return self.pinned.block(layer, first), self.pinned.block(layer, second)

    def layout_block(self, layer: int) -> np.ndarray:
        return self.pinned.block(layer, 0)


class HostTierSource(BlockSource):
    """Some blocks in a pinned host tier (its own slots and eviction policy); the rest read from experts.bin."""

    def __init__(self, expert_file: ExpertFile, reader: BlockReader, tier: TieredExpertStore):
        super().__init__(expert_file, reader)
        self.tier = tier

    def in_memory(self, layer: int, expert: int) -> bool:
        return self.tier.holds(layer, expert)

    def block(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        slot = self.tier.slot_of(layer, expert)  # a hit, or a load into the tier (counted by the tier)
        return self.tier.tier.arena[slot], lambda event: self.tier.tier.release(slot, event)

    def begin_layer(self, layer: int, experts: list[int]) -> None:
        self.tier.begin_layer(layer, None, np.asarray(experts, np.int64)[:, None])

    def merged_stats(self, snapshot: ExpertStats) -> ExpertStats:
        host = self.tier.stats()
        disk = snapshot.tiers["disk"]
        snapshot.tiers = {"gpu": snapshot.tiers["gpu"], "host": host.tiers["host"],
                          "disk": TierStats(hits=disk.hits + host.tiers["disk"].hits, misses=0,
                                            bytes_read=disk.bytes_read + host.tiers["disk"].bytes_read)}
        return snapshot

    def close(self) -> None:
        self.tier.close()
        super().close()


class DiskSource(BlockSource):
    """No host tier: every block read from experts.bin into a staging buffer on its way to the GPU."""

    has_host_blocks = False

    def in_memory(self, layer: int, expert: int) -> bool:
        return False

    def block(self, layer: int, expert: int) -> tuple[np.ndarray, Release]:
        self.count_disk_read()
        return self.read_staged(layer, expert)

    def layout_block(self, layer: int) -> None:
        return None


def block_source(expert_file: ExpertFile, host: PinnedExperts | TieredExpertStore | None,
                 reader: BlockReader) -> BlockSource:
    """The source for an L2 that holds every block (PinnedExperts), some (a TieredExpertStore over a pinned
    HostTier) or none (None)."""
    if isinstance(host, PinnedExperts):
        return PinnedSource(expert_file, reader, host)
    if isinstance(host, TieredExpertStore):
        return HostTierSource(expert_file, reader, host)
    return DiskSource(expert_file, reader)
