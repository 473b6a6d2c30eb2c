"""The tiered expert store: a bounded set of slots per MoE layer in front of experts.bin.

`TieredExpertStore` holds the policy logic (hits, eviction through `LayerSlots`, prefetch, statistics); the memory
and the copies belong to a `SlotTier`. On the CPU that is `HostTier`: an aligned host arena of slots filled with
`os.preadv` of the 4 KiB-aligned block (CRC32 checked on every read), prefetches on a thread pool. A GPU tier
implements the same five members over a device arena, a side stream and events (docs/ARCHITECTURE.md, "Expert
tiers").
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..checkpoint import BLOCK_ALIGNMENT, ExpertFile, corrupt_block_error, crc32
from ..errors import CheckpointError
from .policies import EvictionPolicy
from .prefetcher import Prefetcher
from .slots import LayerSlots
from .stats import ExpertStats, TierStats
from .store import ExpertStore

logger = logging.getLogger(__name__)
IO_THREADS = 4  # concurrent block reads of the prefetcher
KVIKIO_TASK_SIZE = 4 << 20  # bytes per parallel kvikio read task


class SlotTier(ABC):
    """Slot memory of one tier and the way blocks land in it. Slot `staging_slot` is the staging block."""

    name: str  # key of the tier in ExpertStats.tiers ("host", "gpu")
    staging_slot: int

    @abstractmethod
    def load(self, layer: int, expert: int, slot: int) -> None:
        """Fill `slot` with the block now; CheckpointError naming layer and expert if it fails its checksum."""

    @abstractmethod
    def start_load(self, layer: int, expert: int, slot: int) -> Future:
        """Fill `slot` in the background; the future's result() returns once the compute may read the slot."""

    @abstractmethod
    def tensors(self, slot: int) -> dict[str, np.ndarray]:
        """Views of the expert's tensors inside `slot`."""

    def close(self) -> None:
        """Wait for the loads in flight, stop the tier's threads and close the files it opened."""


def kvikio_available() -> bool:
    """Whether kvikio (the `gpu` extra's parallel file reader) imports."""
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


class BlockReader:
    """Reads one expert block from experts.bin into a caller's buffer and checks its CRC32.

    With `use_kvikio` (the GPU tiers, when kvikio is installed) a read is split into KVIKIO_TASK_SIZE tasks that
    kvikio's thread pool issues in parallel, which keeps an NVMe drive's queue full; otherwise one aligned pread.
    Either way the bytes land in host memory, where the checksum is taken before anything uses them.
    """

    def __init__(self, expert_file: ExpertFile, use_kvikio: bool = False):
        self.file = expert_file
        self._fd = os.open(expert_file.path, os.O_RDONLY)
        self._cufile = None
        if use_kvikio:
            import kvikio

            self._cufile = kvikio.CuFile(expert_file.path, "r")

    @property
    def library(self) -> str:
        return "kvikio" if self._cufile is not None else "pread"

    def read_into(self, layer: int, expert: int, out: np.ndarray) -> None:
        """out: [block_size] uint8, filled with the block of (layer, expert)."""
        entry = self.file.entry(layer, expert)
        size, offset = int(entry["size"]), int(entry["offset"])
        if self._cufile is not None:
            got = self._cufile.pread(out, size, offset, task_size=KVIKIO_TASK_SIZE).get()
        else:
            got = os.preadv(self._fd, [memoryview(out)], offset)
        if got != size:
            raise CheckpointError(f"{self.file.path.name}: expert {expert} of layer {layer} is cut short "
                                  f"(the file is truncated)")
        if crc32(out) != int(entry["crc32"]):
            raise corrupt_block_error(self.file.path.name, layer, expert)

    def close(self) -> None:
        if self._cufile is not None:
            self._cufile.close()
        os.close(self._fd)


def aligned_empty(rows: int, row_bytes: int) -> np.ndarray:
    """Uninitialised [rows, row_bytes] uint8 whose rows start on BLOCK_ALIGNMENT boundaries."""
    raw = np.empty(rows * row_bytes + BLOCK_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % BLOCK_ALIGNMENT
    return raw[start : start + rows * row_bytes].reshape(rows, row_bytes)


class HostTier(SlotTier):
    """Host memory slots (the L2 tier): `num_slots` blocks plus the staging block, read from experts.bin.

    Behind the GPU tier the arena is pinned (`allocate`: rows, row bytes -> [rows, row bytes] uint8 with aligned
    rows) and the GPU copies blocks out of it asynchronously: `release(slot, event)` hands over the copy's CUDA
    event, and a load into that slot first waits for it, so no block is overwritten while a copy still reads it.
    """

    name = "host"

    def __init__(self, expert_file: ExpertFile, num_slots: int, io_threads: int = IO_THREADS,
                 allocate=aligned_empty, reader: BlockReader | None = None):
        self.file = expert_file
        self._owns_reader = reader is None  # a reader handed in is its giver's to close
        self.reader = reader or BlockReader(expert_file)
        self.arena = allocate(num_slots + 1, expert_file.block_size)  # [slots + staging, block_size]
        self.staging_slot = num_slots
        self._copies: dict[int, object] = {}  # slot -> CUDA event of the last copy reading it
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="colibri-expert-io")

    def release(self, slot: int, event) -> None:
        """A copy reading `slot` finishes at `event` (a CUDA event)."""
        self._copies[slot] = event

    def load(self, layer: int, expert: int, slot: int) -> None:
        copy = self._copies.pop(slot, None)
        if copy is not None:
            copy.synchronize()
        self.reader.read_into(layer, expert, self.arena[slot])

    def start_load(self, layer: int, expert: int, slot: int) -> Future:
        return self._pool.submit(self.load, layer, expert, slot)

    def tensors(self, slot: int) -> dict[str, np.ndarray]:
        return self.file.unpack(self.arena[slot])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._owns_reader:
            self.reader.close()


class TieredExpertStore(ExpertStore):
    """Experts served from a bounded number of slots per MoE layer, loaded from experts.bin on demand or ahead.

    `policies` holds one eviction policy per MoE layer; `prefetcher` (optional) predicts later layers' experts in
    `begin_layer`, and their blocks load in the background into slots the running step does not need. Every
    decision (which slot, who leaves) is taken on the step thread; loader threads only fill the slots they were
    given.
    """

    def __init__(self, expert_file: ExpertFile, tier: SlotTier, slots_per_layer: int,
                 policies: list[EvictionPolicy], prefetcher: Prefetcher | None = None):
        layers = expert_file.config.moe_layers
        self.file, self.tier, self.prefetcher = expert_file, tier, prefetcher
        self.block_size = expert_file.block_size
        self._rank = {layer: rank for rank, layer in enumerate(layers)}
        self._layers = [LayerSlots(range(r * slots_per_layer, (r + 1) * slots_per_layer), policy)
                        for r, policy in enumerate(policies)]
        self._inflight: list[dict[int, Future]] = [{} for _ in layers]  # per rank: expert -> its running load
        self._prefetched: list[set[int]] = [set() for _ in layers]  # per rank: loaded ahead for its coming step
        self._stats = ExpertStats(len(layers), tiers={tier.name: TierStats(), "disk": TierStats()})
        self._current = len(layers)  # rank of the running layer (a new step starts at any rank <= it)
        self._warm_start()

    def _warm_start(self) -> None:
        """Load what the policies want resident from the start (the pinned policy's ranked experts)."""
        loads = [self.tier.start_load(self.file.config.moe_layers[rank], e, slot)
                 for rank, slots in enumerate(self._layers) for e, slot in slots.warm()]
        for future in loads:
            future.result()
            self._stats.tiers["disk"].bytes_read += self.block_size

    # ---- the step ------------------------------------------------------------------------------------------
    def begin_layer(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights=None) -> None:
        rank = self._rank[layer]
        if rank <= self._current:
            self._stats.steps += 1
        self._current = rank
        needed = np.unique(np.asarray(expert_ids)).tolist()  # the step's distinct experts (batch union)
        self._settle(rank)
        wasted = self._prefetched[rank].difference(needed)
        self._stats.prefetch_wasted_bytes += len(wasted) * self.block_size
        self._prefetched[rank] = set()
        self._stats.used[rank] += len(needed)
        self._layers[rank].begin_step(needed)
        if self.prefetcher is not None:
            self.prefetcher.settle(rank, needed, self._stats)
            for target, ranked in self.prefetcher.predict(rank, x):
                self._prefetch(target, ranked)

    def _prefetch(self, rank: int, ranked: list[int]) -> None:
        """Start loading the most likely of `ranked` into layer `rank`'s slots, at most one per slot."""
        layer = self.file.config.moe_layers[rank]
        self._settle(rank)
        for expert, slot in self._layers[rank].place_ahead(ranked):
            self._inflight[rank][expert] = self.tier.start_load(layer, expert, slot)
            self._prefetched[rank].add(expert)
            self._stats.prefetch_loads += 1
            self._stats.prefetch_bytes += self.block_size
            self._stats.tiers["disk"].bytes_read += self.block_size

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return self.tier.tensors(self.slot_of(layer, expert))

    def holds(self, layer: int, expert: int) -> bool:
        """Whether the block of (layer, expert) is in a slot now, loaded (no read needed to use it)."""
        slots = self._layers[self._rank[layer]]
        return slots.lookup(expert) is not None and expert not in slots.loading

    def slot_of(self, layer: int, expert: int) -> int:
        """The tier slot holding the block of (layer, expert) once this returns: a hit, or a load (into a slot
        of the layer or the staging block). Valid until the next `slot_of`, `expert` or `begin_layer` call."""
        rank = self._rank[layer]
        slots, stats = self._layers[rank], self._stats
        tier_stats = stats.tiers[self.tier.name]
        slot = slots.lookup(expert)
        if slot is not None:
            if expert in slots.loading:
                self._wait(rank, expert)
            tier_stats.hits += 1
        else:
            tier_stats.misses += 1
            disk = stats.tiers["disk"]
            disk.hits += 1
            disk.bytes_read += self.block_size
            placed = slots.place(expert)
            if placed is None:
                stats.bypass_loads += 1
                slot = self.tier.staging_slot
            else:
                slot = placed[0]
            start = time.perf_counter()
            try:
                with self.timer.phase("expert_load_disk"):
                    self.tier.load(layer, expert, slot)
            except CheckpointError:
                stats.load_errors += 1
                if placed is not None:
                    slots.drop(expert)
                raise
            finally:
                stats.stall_seconds += time.perf_counter() - start
        tier_stats.bytes_read += self.block_size
        slots.use(expert)
        return slot

    # ---- background loads ----------------------------------------------------------------------------------
    def _wait(self, rank: int, expert: int) -> None:
        """Block until the running load of `expert` has filled its slot (its failure is the caller's)."""
        start = time.perf_counter()
        try:
            with self.timer.phase("expert_load_wait"):
                self._inflight[rank].pop(expert).result()
        except CheckpointError:
            self._stats.load_errors += 1
            self._layers[rank].drop(expert)
            raise
        finally:
            self._stats.stall_seconds += time.perf_counter() - start
        self._layers[rank].loading.discard(expert)

    def _settle(self, rank: int) -> None:
        """Mark finished background loads of layer `rank`; a failed one frees its slot (a demand read will
        report the corrupt block if the expert is ever needed)."""
        slots, inflight = self._layers[rank], self._inflight[rank]
        for expert in [e for e, future in inflight.items() if future.done()]:
            error = inflight.pop(expert).exception()
            if error is None:
                slots.loading.discard(expert)
                continue
            self._stats.load_errors += 1
            slots.drop(expert)
            self._prefetched[rank].discard(expert)
            logger.warning("prefetch of expert %d of layer %d failed: %s", expert,
                           self.file.config.moe_layers[rank], error)

    def stats(self) -> ExpertStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self.tier.close()
