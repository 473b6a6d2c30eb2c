"""MoE layers that the GPU stream hands to the CPU itself: decode steps with no host round trip in those layers.

A layer with no GPU slot (`--gpu-slot-layout layers` below 100 %, or any layout at 0 %) computes every routed
expert from the pinned L2. At decode both sides work on each routed expert at once: the CPU (a CpuLayerWorker
job) computes its intermediate rows r .. I - 1, and the GPU's MoE kernels compute rows 0 .. r - 1, reading the same
pinned blocks in place over PCIe (mapped host memory: no copy engine, no slot, no staging block). Neither side
needs the host to know the routing first, so the step thread queues the layer without waiting for anything:
  - on the compute stream: the routing (ids as int64, weights) and the MoE input copied into the layer's pinned
    buffers, then the gate word raised (handoff.HostFlag.raise_on);
  - the worker's job, gated on that word: every expert of the layer (the worker skips those no token is routed
    to), with the CPU's rows;
  - the GPU's part (`view`): the GPU's rows of every expert (the kernels skip the unrouted);
  - the stream's wait on the CPU's flag, then the CPU's sum copied in (`finish`).
The host-driven step instead reads the routing back, places the misses and queues copies before the CPU starts:
that read-back, the host's wake-up and the placement's Python sat between the GPU's router and the CPU's start,
about 0.75 ms per layer on the H200 host (BENCHMARKS.md), with host RAM idle.

The split r balances the two sides. It starts from the rates measured at start (pinned copies and the CPU's read,
each while the other runs) and follows what both sides take: the worker's job time and CUDA events around the
GPU's part, read as the jobs are taken in (`collect`). Only steps of up to STREAM_DRIVEN_TOKENS tokens go this
way: with more tokens per expert, moving whole experts to the GPU wins, which the host-driven placement decides.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from .cpu_worker import CpuLayerWorker
from .handoff import HostFlag
from .partial import DEVICE_DTYPES
from .pinned import PinnedExperts, pinned_empty
from .placement import RATE_LEARNING
from .stats import ExpertStats

logger = logging.getLogger(__name__)
STREAM_DRIVEN_TOKENS = 4  # steps of at most this many tokens (decode); more go through the host's placement
SPLIT_MULTIPLE = 16  # the GPU's rows of an expert: whole 16-byte vectors of every expert dtype
# The GPU's share of the rows stays within these bounds and moves by at most MAX_SHARE_MOVE a step: the two sides
# share host RAM, so one step's times are a noisy guide (a side that ends first leaves the other RAM to itself)
SHARE_BOUNDS = (0.1, 0.9)
MAX_SHARE_MOVE = 0.05
HISTORY = 256  # the latest steps' (rank, GPU rows, CPU seconds, GPU seconds) kept for benchmarks


class StreamDrivenLayers:
    """The stream-driven steps of a GpuTieredStore's layers without slots; see the module docstring.

    ranks: the MoE-layer ranks (of `layer_ids`) served this way. tensors: an expert block's TensorSlots
    (checkpoint.expert_block_layout). flag: the store's HostFlag that the stream waits on for the CPU's sums.
    gpu_share: the first fraction of each expert's rows the GPU computes.
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
        self._views: dict[tuple[int, int], object] = {}  # (rank, GPU rows) -> LayerExperts over the pinned blocks
        self._items: dict[tuple[int, int], np.ndarray] = {}  # (rank, GPU rows) -> the worker's items [E, 4]
        self._pending: list[dict] = []  # steps whose CPU job has not been taken in

    @classmethod
    def create(cls, host, tensors, layer_ids: list[int], ranks: set[int], worker: CpuLayerWorker | None,
               flag: HostFlag | None, inter: int, gpu_share: float) -> StreamDrivenLayers | None:
        """The stream-driven layers, or None where they cannot run: no rank qualifies, no pinned L2 holding every
        expert, no CpuLayerWorker, no stream waits on host memory, or no stream writes (the gate)."""
        if not ranks or not isinstance(host, PinnedExperts) or worker is None or flag is None:
            return None
        import cupy

        gate = HostFlag.create(cupy.cuda.get_current_stream())
        if gate is None:
            return None
        try:
            gate.raise_on(cupy.cuda.get_current_stream(), 0)
            gate.device_address(host.arena.ctypes.data)  # the kernels read the blocks in place
        except RuntimeError as error:
            logger.warning("the GPU cannot hand layers to the CPU itself (%s): the host places every layer", error)
            return None
        return cls(host, tensors, layer_ids, ranks, worker, flag, gate, inter, gpu_share)

    def takes(self, rank: int, tokens: int) -> bool:
        """Whether layer `rank`'s step of `tokens` tokens runs stream-driven."""
        return rank in self.ranks and tokens <= STREAM_DRIVEN_TOKENS

    def pending(self, rank: int) -> bool:
        """Whether layer `rank`'s previous step has not been taken in (`collect` first: its buffers are reused)."""
        return any(step["rank"] == rank for step in self._pending)

    def rows(self) -> int:
        """The GPU's rows of each expert now (a multiple of SPLIT_MULTIPLE, leaving the CPU some where it can)."""
        rows = int(round(self.gpu_share * self.inter / SPLIT_MULTIPLE)) * SPLIT_MULTIPLE
        return min(max(rows, SPLIT_MULTIPLE), self.inter - SPLIT_MULTIPLE) if self.inter > SPLIT_MULTIPLE else 0

    # ---- a layer's step ------------------------------------------------------------------------------------
    def begin(self, rank: int, x, expert_ids, weights) -> dict:
        """Queue the layer's inputs to the host and the gate on the compute stream, hand the worker its job; the
        step's plan for `view` and `finish`. x [T, H], expert_ids [T, k], weights [T, k] on the device."""
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
        rows = self.rows()
        ticket = self.flag.ticket()
        job = self.worker.submit(self._items_for(rank, rows), buffers["ids"], buffers["x"], buffers["weights"],
                                 buffers["out"], self.flag.word.ctypes.data, ticket, self.gate.word.ctypes.data,
                                 opened)
        step = {"rank": rank, "rows": rows, "job": job, "ticket": ticket, "start": start, "end": None}
        self._pending.append(step)
        return step

    def view(self, step: dict):
        """The GPU's part of the step: LayerExperts of the layer's first `rows` rows of every expert, in place in
        the pinned blocks (slot = expert id)."""
        key = (step["rank"], step["rows"])
        if key not in self._views:
            self._views[key] = self._host_view(*key)
        return self._views[key]

    def finish(self, step: dict):
        """After the GPU's part is queued: the stream waits for the CPU's flag; the CPU's weighted sum [T, H] on the
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

    def collect(self, stats: ExpertStats, executor, block_size: int) -> None:
        """Take in the handed-over jobs (waiting for those still running): raise a worker error, count each
        step's experts, and move the split toward the two sides' measured rates."""
        pending, self._pending = self._pending, []
        for step in pending:
            seconds = self.worker.wait(step["job"])
            ids = self._buffers[step["rank"]]["ids"]  # [T, k], written before the job started
            used = len(np.unique(ids))
            rows, cpu_share = step["rows"], 1 - step["rows"] / self.inter
            executor.record(used, seconds, int(used * cpu_share * self.worker.expert_bytes))
            stats.used[step["rank"]] += used
            stats.tiers["gpu"].misses += used
            stats.tiers["gpu"].bytes_read += int(used * (1 - cpu_share) * block_size)
            stats.tiers["host"].hits += used
            stats.tiers["host"].bytes_read += used * block_size
            stats.compute.gpu_experts += used
            stats.compute.split_experts += used
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

    # ---- buffers and views ---------------------------------------------------------------------------------
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
        key = (rank, rows)
        if key not in self._items:
            layer = self.layer_ids[rank]
            self._items[key] = np.array([(self.host.block(layer, e).ctypes.data, rows, self.inter, e)
                                         for e in range(self.host.num_experts)], np.int64)
        return self._items[key]

    def _host_view(self, rank: int, rows: int):
        """LayerExperts over layer `rank`'s pinned blocks, its first `rows` rows (gate, up [E, rows, H]; down's first
        `rows` columns [E, H, rows], each row I apart; scales alike), read by the kernels through mapped memory."""
        cp = self.cp
        from ..backends.cupy_backend import LayerExperts

        first = self.host.block(self.layer_ids[rank], 0)
        arena = self.host.arena
        base = self.gate.device_address(arena.ctypes.data) + (first.ctypes.data - arena.ctypes.data)
        span = arena.ctypes.data + arena.nbytes - first.ctypes.data
        memory = cp.cuda.UnownedMemory(base, span, arena, cp.cuda.Device().id)
        block_size = first.nbytes
        arrays = {}
        for t in self.tensors:
            dtype = np.dtype(DEVICE_DTYPES[t.dtype])
            if t.name == "down":  # [H, I] -> its first `rows` columns
                shape, strides = (t.shape[0], rows), (t.shape[1] * dtype.itemsize, dtype.itemsize)
            elif t.name == "down_scale":  # [H], whole
                shape, strides = t.shape, (dtype.itemsize,)
            else:  # gate, up [I, H] and their scales [I]: the first `rows` rows
                shape = (rows, *t.shape[1:])
                strides = (t.shape[1] * dtype.itemsize, dtype.itemsize) if len(t.shape) == 2 else (dtype.itemsize,)
            arrays[t.name] = cp.ndarray((self.host.num_experts, *shape), dtype,
                                        memptr=cp.cuda.MemoryPointer(memory, t.offset),
                                        strides=(block_size, *strides))
        return LayerExperts(arrays["gate"], arrays["up"], arrays["down"], arrays.get("gate_scale"),
                            arrays.get("up_scale"), arrays.get("down_scale"), None)
