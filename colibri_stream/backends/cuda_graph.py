"""CUDA graphs for decode steps: a model step of a fixed batch size captured once, replayed with new inputs.

A decode step is one token per sequence, so for a batch size B every array shape is fixed except the block-table
width, which is padded to `max_blocks`. The step's inputs (token ids, positions, KV slots, context lengths, block
tables) live in one pinned host buffer and one device buffer at fixed addresses: a step writes the host buffer,
copies it up in one transfer, replays the graph (the whole forward plus the greedy argmax) and copies back only
what the caller asks for (the sampler: argmaxes and candidates, cupy_sampling.py). Everything data-dependent (routing, sequence lengths) is read on the device.
"""

from __future__ import annotations

import logging

import numpy as np

from ..model.batch import ForwardBatch
from ..model.paged_kv import PagedKVCache
from ..model.transformer import MoETransformer
from .cupy_sampling import DeviceLogits
from .launch import programmatic_launch_supported, programmatic_launches

logger = logging.getLogger(__name__)
_INPUTS = ("token_ids", "positions", "slot_mapping", "context_lens")


class DecodeGraph:
    """One decode step of `batch_size` sequences on the CuPy backend, captured as a CUDA graph.

    Intermediate arrays of the captured step come from a memory pool private to the graph, so their addresses stay
    reserved for it between replays. Work runs on the graph's own stream; `greedy` returns after it finished.
    With `programmatic` (and a GPU that has it), the kernels are captured as programmatic dependent launches
    (launch.py): each may start while the one before it ends. A capture that fails with them (or with cuBLAS,
    captured_cublas.py) is made again without either.
    """

    def __init__(self, model: MoETransformer, kv_cache: PagedKVCache, batch_size: int, max_blocks: int,
                 programmatic: bool = True):
        import cupy
        import cupyx

        if model.backend.name != "cupy":
            raise ValueError("CUDA graphs need the CuPy backend")
        self.model, self.kv_cache = model, kv_cache
        self.batch_size, self.max_blocks = batch_size, max_blocks
        size = len(_INPUTS) * batch_size + batch_size * max_blocks
        self._host = cupyx.empty_pinned((size,), np.int64)  # [size] the step's inputs, packed
        self._device = cupy.zeros((size,), np.int64)  # [size] the same on the device, at fixed addresses
        self._host_views: dict[str, np.ndarray] = {}
        self.inputs: dict[str, object] = {}  # device arrays by ForwardBatch field name
        for n, name in enumerate(_INPUTS):
            self._host_views[name] = self._host[n * batch_size:(n + 1) * batch_size]  # [B]
            self.inputs[name] = self._device[n * batch_size:(n + 1) * batch_size]  # [B]
        start = len(_INPUTS) * batch_size
        self._host_views["block_tables"] = self._host[start:].reshape(batch_size, max_blocks)  # [B, max_blocks]
        self.inputs["block_tables"] = self._device[start:].reshape(batch_size, max_blocks)  # [B, max_blocks]
        self.inputs["query_start"] = cupy.arange(batch_size + 1, dtype=np.int64)  # [B+1]
        self.inputs["logits_indices"] = cupy.arange(batch_size, dtype=np.int64)  # [B]
        self._shape = ForwardBatch(  # shapes only: the backend reads the values from self.inputs
            token_ids=np.zeros(batch_size, np.int64), positions=np.zeros(batch_size, np.int64),
            query_start=np.arange(batch_size + 1, dtype=np.int64), context_lens=np.ones(batch_size, np.int64),
            block_tables=np.zeros((batch_size, max_blocks), np.int64), slot_mapping=np.zeros(batch_size, np.int64),
            logits_indices=np.arange(batch_size, dtype=np.int64))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.cuda.MemoryPool()
        self._host[:] = 0
        self._host_views["slot_mapping"][:] = -1  # the warm-up step writes nothing into the KV cache
        with self.stream:
            self._device.set(self._host, stream=self.stream)
            self._step()  # compiles every kernel outside the capture
            self.stream.synchronize()
            self.programmatic = programmatic and programmatic_launch_supported()
            backend = model.backend
            try:
                self._capture()
            except Exception as error:  # a driver or GPU that refuses programmatic launches or cuBLAS in a capture
                if not (self.programmatic or backend.captured_cublas):
                    raise
                logger.warning("capturing the decode step with programmatic launches and cuBLAS failed (%s); "
                               "capturing it with plain launches and our own kernels", error)
                self.programmatic = backend.captured_cublas = False
                self._capture()

    def _capture(self) -> None:
        import cupy

        with cupy.cuda.using_allocator(self._pool.malloc), programmatic_launches(self.programmatic):
            self.stream.begin_capture()
            try:
                self.logits, self.token_ids = self._step()  # [B, V] float32, [B] int64
            finally:
                self.graph = self.stream.end_capture()

    def _step(self):
        logits = self.model.forward_device(self._shape, self.inputs, self.kv_cache)  # [B, V]
        return logits, self.model.backend.greedy(logits)

    @property
    def pool_bytes(self) -> int:
        """Device memory held by the graph's private pool."""
        return self._pool.total_bytes()

    def run(self, batch: ForwardBatch) -> None:
        """Enqueue the step for `batch` (batch_size sequences of one token each) on the graph's stream; `logits`
        and `token_ids` hold its results once the stream reaches them. The previous step must be finished (its
        results read), since its inputs are overwritten."""
        b = self.batch_size
        if batch.num_tokens != b or batch.num_seqs != b:
            raise ValueError(f"this graph runs {b} sequences of one token each, got {batch.num_seqs} sequences "
                             f"and {batch.num_tokens} tokens")
        width = batch.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed the graph's {self.max_blocks}")
        if int(batch.positions.max()) >= self.model.max_positions:
            raise ValueError(f"position {int(batch.positions.max())} is beyond the model's positions")
        for name in _INPUTS:
            self._host_views[name][:] = getattr(batch, name)
        tables = self._host_views["block_tables"]
        tables[:, :width] = batch.block_tables
        tables[:, width:] = 0
        self._device.set(self._host, stream=self.stream)
        self.graph.launch(stream=self.stream)

    def greedy(self, batch: ForwardBatch) -> np.ndarray:
        """Run the step and return each sequence's greedy next token (only the ids are copied back).  # [B]"""
        self.run(batch)
        return self.token_ids.get(stream=self.stream)


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # buckets: a decode batch runs in the smallest that holds it


def is_decode(batch: ForwardBatch) -> bool:
    """One token per sequence and logits for every one of them, in order: what a decode graph computes."""
    b = batch.num_seqs
    return batch.num_tokens == b and np.array_equal(batch.logits_indices, np.arange(b))


class DecodeGraphs:
    """The engine's decode steps as CUDA graphs: one `DecodeGraph` per batch-size bucket, captured the first time
    a decode batch of that bucket comes, a smaller batch padded up to it (padding rows write no KV: slot -1).

    Used only where a step's work is fixed by shapes: the CuPy backend with every expert resident (GPU expert
    slots synchronise with the host every layer). `logits(batch)` returns the rows of the real sequences, and
    `device_logits(batch)` the same left on the device for the sampler.
    """

    def __init__(self, model: MoETransformer, kv_cache: PagedKVCache, max_blocks: int, max_batch_size: int):
        self.model, self.kv_cache, self.max_blocks = model, kv_cache, max_blocks
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s < max_batch_size] + [max_batch_size]
        self._graphs: dict[int, DecodeGraph] = {}

    @staticmethod
    def usable(model: MoETransformer) -> bool:
        return model.backend.name == "cupy" and getattr(model.store, "resident", False)

    def fits(self, batch: ForwardBatch) -> bool:
        return (batch.num_seqs <= self.sizes[-1] and batch.block_tables.shape[1] <= self.max_blocks
                and is_decode(batch))

    def logits(self, batch: ForwardBatch) -> np.ndarray:
        """The step's logits [B, V] float32 on the host, from the graph of the bucket holding B sequences."""
        graph = self._run(batch)
        return graph.logits[:batch.num_seqs].get(stream=graph.stream)

    def device_logits(self, batch: ForwardBatch) -> DeviceLogits:
        """The step's logits [B, V] left on the device (and the graph's argmaxes), for the sampler; valid until
        the next step of the same bucket."""
        graph, b = self._run(batch), batch.num_seqs
        return DeviceLogits(graph.logits[:b], self.model.backend, graph.stream, argmax=graph.token_ids[:b])

    def _run(self, batch: ForwardBatch) -> DecodeGraph:
        """Enqueue the step on the graph of the bucket holding its sequences (captured on first use)."""
        size = next(s for s in self.sizes if s >= batch.num_seqs)
        graph = self._graphs.get(size)
        if graph is None:
            graph = self._graphs[size] = DecodeGraph(self.model, self.kv_cache, size, self.max_blocks)
        graph.run(_padded(batch, size))
        return graph


def _padded(batch: ForwardBatch, size: int) -> ForwardBatch:
    """A decode batch of `size` sequences: `batch`'s, then rows that read position 0 and write no KV."""
    pad = size - batch.num_seqs
    if pad == 0:
        return batch

    def extend(values: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(pad, fill, values.dtype)])

    tables = np.zeros((size, batch.block_tables.shape[1]), np.int64)  # [size, width]
    tables[: batch.num_seqs] = batch.block_tables
    return ForwardBatch(token_ids=extend(batch.token_ids, 0), positions=extend(batch.positions, 0),
                        query_start=np.arange(size + 1, dtype=np.int64), context_lens=extend(batch.context_lens, 1),
                        block_tables=tables, slot_mapping=extend(batch.slot_mapping, -1),
                        logits_indices=np.arange(size, dtype=np.int64))
