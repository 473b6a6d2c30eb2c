"""Pinned (page-locked) host memory that the GPU expert tier copies from: the only host memory a GPU copies
asynchronously and at full PCIe speed (several times what a copy from pageable memory reaches).

`PinnedExperts` is the L2 tier when its budget holds every expert: all of experts.bin read once, in parallel and
checksummed, never evicted. `StagingRing` holds the blocks read from experts.bin on their way to the GPU when no
host tier holds them. Both hand the GPU tier a block as a [block_size] uint8 row; a ring buffer is reused only
after the CUDA event of the copy that read it.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checkpoint import ExpertFile
from .tiers import BlockReader

logger = logging.getLogger(__name__)
FILL_THREADS = 8  # parallel reads filling PinnedExperts at start


def pinned_empty(rows: int, row_bytes: int) -> np.ndarray:
    """[rows, row_bytes] uint8 in page-locked host memory (page aligned, so rows of 4 KiB multiples stay aligned),
    the only host memory the GPU copies from asynchronously and at full PCIe speed."""
    import cupyx

    return cupyx.empty_pinned((rows, row_bytes), np.uint8)


class StagingRing:
    """Pinned buffers that blocks read from experts.bin pass through on their way to the GPU; a buffer is reused
    only after the copy that read it has finished (its event). Safe to use from several threads."""

    def __init__(self, block_size: int, count: int):
        self.buffers = pinned_empty(count, block_size)  # [count, block_size]
        self._free: queue.Queue = queue.Queue()
        for index in range(count):
            self._free.put((index, None))

    def acquire(self) -> int:
        index, event = self._free.get()
        if event is not None:
            event.synchronize()
        return index

    def release(self, index: int, event=None) -> None:
        self._free.put((index, event))


class PinnedExperts:
    """Every expert block of experts.bin in pinned host memory (an L2 budget that holds them all), read in
    parallel and checked against its CRC32 at start; never evicted, so copies need no bookkeeping."""

    def __init__(self, expert_file: ExpertFile, reader: BlockReader, threads: int = FILL_THREADS):
        layers, experts = expert_file.config.moe_layers, expert_file.config.num_experts
        self.num_experts = experts
        self._rank = {layer: rank for rank, layer in enumerate(layers)}
        self.arena = pinned_empty(len(layers) * experts, expert_file.block_size)  # [L*E, block_size]
        start = time.perf_counter()
        jobs = [(layer, e) for layer in layers for e in range(experts)]
        with ThreadPoolExecutor(threads, thread_name_prefix="colibri-l2-fill") as pool:
            list(pool.map(lambda job: reader.read_into(*job, self.block(*job)), jobs))
        seconds = time.perf_counter() - start
        logger.info("L2: %d expert blocks (%.1f GiB) read into pinned memory in %.1f s (%.1f GB/s, %s)", len(jobs),
                    self.arena.nbytes / 2**30, seconds, self.arena.nbytes / seconds / 1e9, reader.library)

    def block(self, layer: int, expert: int) -> np.ndarray:
        return self.arena[self._rank[layer] * self.num_experts + expert]
