"""MoE layers whose CPU work the GPU stream starts: at decode the CPU does not wait for the host.

A layer with no GPU slot (`--gpu-slot-layout layers` below 100 %, or any layout at 0 %) computes every routed
expert from the pinned L2. In the host-driven step the host reads the routing back, places the misses, queues
copies and only then hands the CPU its job: the read-back, the host's wake-up and the placement's Python sat
between the GPU's router and the CPU's start, about 0.75 ms per layer on the H200 host with host RAM idle
(BENCHMARKS.md). Here, at decode, the step thread hands the worker its job before the GPU has computed the
layer's routing:
  - on the compute stream: the routing (ids as int64, weights) and the MoE input copied into the layer's pinned
    buffers, then a gate word raised (handoff.HostFlag.raise_on);
  - the CpuLayerWorker's job, gated on that word: each routed expert's intermediate rows r .. I - 1 (every expert
    of the layer is listed; the worker skips those no token is routed to);
  - the host then waits for the routing as before, and the store copies rows 0 .. r - 1 of each routed expert
    into the staging block, packed one after the other (partial.PartialLayout), for one pass of the MoE kernels;
  - the stream waits on the CPU's flag, then adds the CPU's sum (`finish`).
So the CPU starts a few microseconds after the router, and the host's latency falls on the copy's side, which the
split leaves shorter. (Kernels reading the pinned blocks in place instead of copies need no host at all, but read
host memory at about 44 GB/s beside the CPU against 49 for the copy engine, and lost at 0 %; BENCHMARKS.md.)

The split r balances the two sides. It starts from the rates measured at start (pinned copies and the CPU's read,
each while the other runs) and follows what both sides take: the worker's job time, and CUDA events from the gate
to the end of the GPU's pass (the host's latency included), read as the jobs are taken in (`collect`). The GPU's
rows of all routed experts must fit the staging block. Only steps of up to STREAM_DRIVEN_TOKENS tokens go this
way: with more tokens per expert, moving whole experts to the GPU wins, which the host-driven placement decides.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from .cpu_worker import CpuLayerWorker
from .handoff import HostFlag
from .pinned import PinnedExperts, pinned_empty
from .placement import RATE_LEARNING
from .stats import ExpertStats

logger = logging.getLogger(__name__)
STREAM_DRIVEN_TOKENS = 1  # steps of at most this many tokens (one sequence's decode) go this way; more (the GPU's
# rows of more experts would not fit the staging block) go through the host's placement
SPLIT_MULTIPLE = 16  # the GPU's rows of an expert: whole 16-byte vectors of every expert dtype
# The GPU's share of the rows stays within these bounds and moves by at most MAX_SHARE_MOVE a step: the two sides
# share host RAM, so one step's times are a noisy guide (a side that ends first leaves the other RAM to itself)
SHARE_BOUNDS = (0.1, 0.9)
MAX_SHARE_MOVE = 0.05
HISTORY = 256  # the latest steps' (rank, GPU rows, CPU seconds, GPU seconds) kept for benchmarks


class StreamDrivenLayers:
    """The CPU's side of the stream-driven steps of a GpuTieredStore's layers without slots (the store copies and
    computes the GPU's rows); see the module docstring.

    ranks: the MoE-layer ranks (of `layer_ids`) served this way. tensors: an expert block's TensorSlots
    (checkpoint.expert_block_layout). flag: the store's HostFlag that the stream waits on for the CPU's sums; gate:
    the HostFlag the stream raises for the worker. gpu_share: the first fraction of each expert's rows the GPU
    computes.
    """

    def __init__(self, host: PinnedExperts, tensors, layer_ids: list[int], ranks: set[int], worker: CpuLayerWorker,
                 flag: HostFlag, gate: HostFlag, inter: int, gpu_share: float):
        import cupy

        self.cp = cupy
        self.host, self.tensors, self.layer_ids, self.ranks = host, tensors, layer_ids, ranks
        self.worker, self.flag, self.gate, self.inter = worker, flag, gate, inter
        self.gpu_share = min(max(gpu_share, SHARE_BOUNDS[0]), SHARE_BOUNDS[1])
        self.history: deque[tuple[int, int, float, float]] = deque(maxlen=HISTORY)
        self._buffers: dict[int, dict[str, np.ndarray]] = {}  # per rank: pinned x, ids, weights, out of T tokens
        self._blocks: dict[int, np.ndarray] = {}  # rank -> the worker's items [E, 4] of whole experts
        self._pending: list[dict] = []  # steps whose CPU job has not been taken in

    @classmethod
    def create(cls, host, tensors, layer_ids: list[int], ranks: set[int], worker: CpuLayerWorker | None,
               flag: HostFlag | None, inter: int, gpu_share: float) -> StreamDrivenLayers | None:
        """The stream-driven layers, or None where they cannot run: no rank qualifies, no pinned L2 holding every
        expert, no CpuLayerWorker, no stream waits on host memory, or no stream writes (the gate)."""
        if not ranks or not isinstance(host, PinnedExperts) or worker is None or flag is None:
            return None
        import cupy

        stream = cupy.cuda.get_current_stream()
        gate = HostFlag.create(stream)
        if gate is None:
            return None
        try:
            gate.raise_on(stream, 0)
        except RuntimeError as error:
            logger.warning("the stream cannot start the CPU's work (%s): the host places every layer", error)
            return None
        return cls(host, tensors, layer_ids, ranks, worker, flag, gate, inter, gpu_share)

    def takes(self, rank: int, tokens: int) -> bool:
        """Whether layer `rank`'s step of `tokens` tokens runs stream-driven."""
        return rank in self.ranks and tokens <= STREAM_DRIVEN_TOKENS

    def pending(self, rank: int) -> bool:
        """Whether layer `rank`'s previous step has not been taken in (`collect` first: its buffers are reused)."""
        return any(step["rank"] == rank for step in self._pending)

    def rows(self, limit: int) -> int:
        """The GPU's rows of each expert now: the share's, a multiple of SPLIT_MULTIPLE, at most `limit`."""
        rows = int(round(self.gpu_share * self.inter / SPLIT_MULTIPLE)) * SPLIT_MULTIPLE
        return max(0, min(rows, limit, self.inter - SPLIT_MULTIPLE))

    # ---- a layer's step ------------------------------------------------------------------------------------
    def begin(self, rank: int, x, expert_ids, weights, max_rows: int) -> dict:
        """Queue the layer's inputs to the host and the gate on the compute stream and hand the worker its job
        (the CPU's rows of each routed expert); the step's plan: rank, the GPU's rows (at most `max_rows`), the
        job, the flag's ticket, the gate's event. x [T, H], expert_ids [T, k], weights [T, k] on the device."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        buffers = self._buffers_for(rank, *expert_ids.shape, x.shape[1])
        for name, array in (("x", x), ("ids", expert_ids), ("weights", weights)):
            cp.ascontiguousarray(array.astype(buffers[name].dtype, copy=False)).get(stream=stream, out=buffers[name],
                                                                                  blocking=False)
        opened = self.gate.ticket()
        self.gate.raise_on(stream, opened)
        start = cp.cuda.Event()
        start.record(stream)
        rows = self.rows(max_rows)
        ticket = self.flag.ticket()
        job = self.worker.submit(self._items_for(rank, rows), buffers["ids"], buffers["x"], buffers["weights"],
                                 buffers["out"], self.flag.word.ctypes.data, ticket, self.gate.word.ctypes.data,
                                 opened)
        step = {"rank": rank, "rows": rows, "job": job, "ticket": ticket, "start": start, "end": None}
        self._pending.append(step)
        return step

    def routed(self, step: dict) -> list[int]:
        """The step's distinct routed experts, once the stream has copied its routing (after the host's wait)."""
        return np.unique(self._buffers[step["rank"]]["ids"]).tolist()

    def finish(self, step: dict):
        """After the GPU's pass is queued: the stream waits for the CPU's flag; the CPU's weighted sum [T, H] on the
        device."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        step["end"] = cp.cuda.Event()
        step["end"].record(stream)
        self.flag.wait(stream, step["ticket"])
        host = self._buffers[step["rank"]]["out"]
        out = cp.empty(host.shape, np.float32)  # [T, H]
        cp.cuda.runtime.memcpyAsync(out.data.ptr, host.ctypes.data, out.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
        return out

    def collect(self, stats: ExpertStats, executor, block_size: int, running: dict | None = None) -> None:
        """Take in the handed-over jobs but `running` (waiting for those still running): raise a worker error,
        count each step's experts, and move the split toward the two sides' measured times."""
        pending, self._pending = self._pending, [step for step in self._pending if step is running]
        for step in pending:
            if step is running:
                continue
            seconds = self.worker.wait(step["job"])
            used = len(self.routed(step))
            rows, cpu_share = step["rows"], 1 - step["rows"] / self.inter
            executor.record(used, seconds, int(used * cpu_share * self.worker.expert_bytes))
            stats.used[step["rank"]] += used
            stats.tiers["gpu"].misses += used
            stats.tiers["gpu"].bytes_read += int(used * (1 - cpu_share) * block_size)
            stats.tiers["host"].hits += used
            stats.tiers["host"].bytes_read += used * block_size
            stats.compute.gpu_experts += used if rows else 0
            stats.compute.split_experts += used if rows else 0
            if step["end"] is not None and step["end"].done and seconds > 0 and 0 < rows < self.inter:
                gpu_seconds = self.cp.cuda.get_elapsed_time(step["start"], step["end"]) / 1e3
                self.history.append((step["rank"], rows, seconds, gpu_seconds))
                self._rebalance(rows, seconds, gpu_seconds)

    def _rebalance(self, rows: int, cpu_seconds: float, gpu_seconds: float) -> None:
        """Move the GPU's share toward the one that ends both sides together at the rates this step showed."""
        gpu_rate, cpu_rate = rows / gpu_seconds, (self.inter - rows) / cpu_seconds  # rows per second
        balanced = gpu_rate / (gpu_rate + cpu_rate)
        move = min(max(RATE_LEARNING * (balanced - self.gpu_share), -MAX_SHARE_MOVE), MAX_SHARE_MOVE)
        self.gpu_share = min(max(self.gpu_share + move, SHARE_BOUNDS[0]), SHARE_BOUNDS[1])

    # ---- buffers -------------------------------------------------------------------------------------------
    def _buffers_for(self, rank: int, tokens: int, top_k: int, hidden: int) -> dict[str, np.ndarray]:
        """The layer's pinned x [T, H] float32, ids [T, k] int64, weights [T, k] float32 and out [T, H] float32 (the
        CPU's sum), reallocated when the shapes change."""
        buffers = self._buffers.get(rank)
        if buffers is None or buffers["ids"].shape != (tokens, top_k) or buffers["x"].shape[1] != hidden:
            shapes = {"x": ((tokens, hidden), np.float32), "ids": ((tokens, top_k), np.int64),
                      "weights": ((tokens, top_k), np.float32), "out": ((tokens, hidden), np.float32)}
            buffers = {}
            for name, (shape, dtype) in shapes.items():
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                buffers[name] = pinned_empty(1, max(nbytes, 8))[0][:nbytes].view(dtype).reshape(shape)
            self._buffers[rank] = buffers
        return buffers

    def _items_for(self, rank: int, rows: int) -> np.ndarray:
        """The worker's items of the layer: (block address, first row, last row, expert) of every expert, the CPU
        taking rows `rows` .. I - 1.  # [E, 4] int64"""
        if rank not in self._blocks:
            layer = self.layer_ids[rank]
            self._blocks[rank] = np.array([(self.host.block(layer, e).ctypes.data, 0, self.inter, e)
                                           for e in range(self.host.num_experts)], np.int64)
        items = self._blocks[rank].copy()
        items[:, 1] = rows
        return items
