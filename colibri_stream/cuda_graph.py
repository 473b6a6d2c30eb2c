"""CUDA graphs for decode steps: a model step of a fixed batch size captured once, replayed with new inputs.

A decode step is one token per sequence, so for a batch size B every array shape is fixed except the block-table
width, which is padded to `max_blocks`. The step's inputs (token ids, feed rows, positions, KV slots, context
lengths, block tables; with a pool for the sliding-window layers their slots and tables too) live in pinned host
buffers and one device buffer at fixed addresses: a step writes a host buffer, copies it up in one transfer,
replays the graph (the whole forward plus the greedy argmax) and copies back only what the caller asks for (the
sampler: argmaxes and candidates, cupy_sampling.py). Everything data-dependent (routing, sequence lengths) is read
on the device.

Scheduling one step ahead: every graph writes its tokens (argmaxes, or draws over the whole vocabulary for rows
given a temperature and a uniform) into a `feedback` buffer on the device, and a step's input token can be named by
its row there (`feed_rows`) instead of by value: the first kernel of the graph (feed_tokens) reads it. So step t+1
is launched before the host has read step t's ids (`launch` returns a `PendingIds`), and the GPU goes from one step
to the next without waiting for the host. The host buffers come in two, used in turn, so writing step t+1's inputs
never races with step t's copy.
"""

from __future__ import annotations

import logging

import numpy as np

from .backends.cupy_sampling import DeviceLogits, draw_on_device
from .backends.launch import programmatic_launch_supported, programmatic_launches
from .batch import ForwardBatch
from .model.paged_kv import PagedKVCache
from .model.transformer import MoETransformer

logger = logging.getLogger(__name__)
_BATCH_INPUTS = ("token_ids", "positions", "slot_mapping", "context_lens")  # [B] each, from the ForwardBatch
# [B] 8-byte slots each: feed rows (int64), temperatures (float32 in the first half), uniforms (uint64, u * 2**53)
_STEP_INPUTS = ("feed_rows", "temperature", "draws")


class PendingIds:
    """A launched step's greedy ids on their way to a pinned host buffer; `wait()` returns them."""

    def __init__(self, host, event, count: int):
        self._host, self._event, self._count = host, event, count

    def wait(self) -> np.ndarray:
        """Block until the step and its copy finished; its ids [count] int64."""
        self._event.synchronize()
        return np.array(self._host[:self._count])


class DecodeGraph:
    """One decode step of `batch_size` sequences on the CuPy backend, captured as a CUDA graph.

    Intermediate arrays of the captured step come from a memory pool private to the graph, so their addresses stay
    reserved for it between replays. Work runs on `stream` (the graph's own by default); `greedy` returns after it
    finished, `launch` at once. The argmaxes land in `feedback[:batch_size]` (the graph's own buffer by default;
    DecodeGraphs shares one between its graphs, so a step can take its tokens from a step of another size).
    With `programmatic` (and a GPU that has it), the kernels are captured as programmatic dependent launches
    (launch.py): each may start while the one before it ends. A capture that fails with them is made again
    without.
    """

    def __init__(self, model: MoETransformer, kv_cache: PagedKVCache, batch_size: int, max_blocks: int,
                 programmatic: bool = True, stream=None, feedback=None):
        import cupy
        import cupyx

        if not model.backend.captures(model.config, kv_cache.dtype):
            raise ValueError(f"the {model.backend.name} backend does not capture CUDA graphs of this model")
        self.model, self.kv_cache = model, kv_cache
        self.batch_size, self.max_blocks = batch_size, max_blocks
        self.feedback = cupy.zeros((batch_size,), np.int64) if feedback is None else feedback  # [F >= B] argmaxes
        if self.feedback.shape[0] < batch_size:
            raise ValueError(f"a feedback buffer of {self.feedback.shape[0]} ids is too short for {batch_size} rows")
        sliding = bool(kv_cache.sliding_layers)
        self._batch_inputs = (*_BATCH_INPUTS, "sliding_slot_mapping") if sliding else _BATCH_INPUTS  # [B] each
        self._tables = ("block_tables", "sliding_block_tables") if sliding else ("block_tables",)  # [B, max_blocks]
        inputs = (*self._batch_inputs, *_STEP_INPUTS)
        start = len(inputs) * batch_size
        size = start + len(self._tables) * batch_size * max_blocks
        self._host = cupyx.empty_pinned((2, size), np.int64)  # [2, size] the step's inputs, packed; used in turn
        self._host_ids = cupyx.empty_pinned((2, batch_size), np.int64)  # [2, B] ids copied back, used in turn
        self._turn = 0
        self._device = cupy.zeros((size,), np.int64)  # [size] the inputs on the device, at fixed addresses
        self._host_views: list[dict[str, np.ndarray]] = [{}, {}]  # per host buffer: arrays by field name
        self.inputs: dict[str, object] = {}  # device arrays by ForwardBatch field name (and feed_rows)
        for buffer, views in (*zip(self._host, self._host_views), (self._device, self.inputs)):
            for n, name in enumerate(inputs):
                views[name] = buffer[n * batch_size:(n + 1) * batch_size]  # [B]
            for n, name in enumerate(self._tables):
                at = start + n * batch_size * max_blocks
                views[name] = buffer[at:at + batch_size * max_blocks].reshape(batch_size, max_blocks)
            _typed(views, batch_size)
        self._rows = cupy.arange(batch_size, dtype=np.int32)  # [B] the logits rows the draws read
        self.inputs["query_start"] = cupy.arange(batch_size + 1, dtype=np.int64)  # [B+1]
        self.inputs["logits_indices"] = cupy.arange(batch_size, dtype=np.int64)  # [B]
        self._shape = ForwardBatch(  # shapes only: the backend reads the values from self.inputs
            token_ids=np.zeros(batch_size, np.int64), positions=np.zeros(batch_size, np.int64),
            query_start=np.arange(batch_size + 1, dtype=np.int64), context_lens=np.ones(batch_size, np.int64),
            block_tables=np.zeros((batch_size, max_blocks), np.int64), slot_mapping=np.zeros(batch_size, np.int64),
            logits_indices=np.arange(batch_size, dtype=np.int64),
            sliding_block_tables=np.zeros((batch_size, max_blocks), np.int64) if sliding else None,
            sliding_slot_mapping=np.zeros(batch_size, np.int64) if sliding else None)
        self.stream = cupy.cuda.Stream(non_blocking=True) if stream is None else stream
        self._pool = cupy.cuda.MemoryPool()
        self._host[:] = 0
        self._host_views[0]["feed_rows"][:] = -1  # the warm-up step's tokens are its own
        for name in ("slot_mapping", "sliding_slot_mapping") if sliding else ("slot_mapping",):
            self._host_views[0][name][:] = -1  # and it writes nothing into the KV cache
        with self.stream:
            self._device.set(self._host[0], stream=self.stream)
            self._step(warm_up=True)  # compiles every kernel outside the capture; leaves `feedback` alone
            self.stream.synchronize()
            self.programmatic = programmatic and programmatic_launch_supported()
            try:
                self._capture()
            except Exception as error:  # a driver or GPU that refuses programmatic launches in a capture
                if not self.programmatic:
                    raise
                logger.warning("capturing the decode step with programmatic launches failed (%s); capturing it "
                               "with plain launches", error)
                self.programmatic = False
                self._capture()

    def _capture(self) -> None:
        import cupy

        with cupy.cuda.using_allocator(self._pool.malloc), programmatic_launches(self.programmatic):
            self.stream.begin_capture()
            try:
                self.logits, self.token_ids = self._step()  # [B, V] float32, [B] int64 (a view of feedback)
            finally:
                self.graph = self.stream.end_capture()

    def _step(self, warm_up: bool = False):
        backend = self.model.backend
        backend.feed_tokens(self.inputs["token_ids"], self.inputs["feed_rows"], self.feedback)
        logits = self.model.forward_device(self._shape, self.inputs, self.kv_cache)  # [B, V]
        ids = backend.greedy(logits, out=None if warm_up else self.feedback[:self.batch_size])  # [B]
        # rows with a temperature draw over the whole vocabulary instead (sampled requests launched ahead)
        draw_on_device(logits, self._rows, self.inputs["temperature"], self.inputs["draws"], ids)
        return logits, ids

    @property
    def pool_bytes(self) -> int:
        """Device memory held by the graph's private pool."""
        return self._pool.total_bytes()

    def run(self, batch: ForwardBatch, feed_rows: np.ndarray | None = None, temperature: np.ndarray | None = None,
            draws: np.ndarray | None = None) -> None:
        """Enqueue the step for `batch` (batch_size sequences of one token each) on the graph's stream; `logits`
        and `token_ids` hold its results once the stream reaches them. `feed_rows` [B] int64: where >= 0, the
        sequence's token is that row of `feedback` (the step before this one on the stream sampled it), and its
        entry in batch.token_ids is ignored. `temperature` [B] float32 and `draws` [B] uint64 (uniforms as
        u * 2**53): rows with a temperature above 0 get a token drawn over the whole vocabulary instead of their
        argmax (cupy_sampling.draw_on_device); none by default. The step before the previous one must have
        finished (its host buffer is reused); `logits` and `token_ids` are overwritten by the next step."""
        b = self.batch_size
        if batch.num_tokens != b or batch.num_seqs != b:
            raise ValueError(f"this graph runs {b} sequences of one token each, got {batch.num_seqs} sequences "
                             f"and {batch.num_tokens} tokens")
        width = batch.block_tables.shape[1]  # the sliding tables' too
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed the graph's {self.max_blocks}")
        if int(batch.positions.max()) >= self.model.max_positions:
            raise ValueError(f"position {int(batch.positions.max())} is beyond the model's positions")
        if feed_rows is not None and (feed_rows.shape != (b,) or int(feed_rows.max()) >= self.feedback.shape[0]):
            raise ValueError(f"feed_rows must be [{b}] rows below {self.feedback.shape[0]}")
        turn, self._turn = self._turn, self._turn ^ 1
        views = self._host_views[turn]
        views["feed_rows"][:] = -1 if feed_rows is None else feed_rows
        views["temperature"][:] = 0.0 if temperature is None else temperature
        views["draws"][:] = 0 if draws is None else draws
        for name in self._batch_inputs:
            views[name][:] = getattr(batch, name)
        for name in self._tables:
            views[name][:, :width] = getattr(batch, name)
            views[name][:, width:] = 0
        self._device.set(self._host[turn], stream=self.stream)
        self.graph.launch(stream=self.stream)

    def launch(self, batch: ForwardBatch, feed_rows: np.ndarray | None = None, count: int | None = None,
               temperature: np.ndarray | None = None, draws: np.ndarray | None = None) -> PendingIds:
        """`run` the step, then copy its first `count` ids (all by default) back without waiting for them."""
        import cupy

        host = self._host_ids[self._turn]  # the turn `run` takes
        self.run(batch, feed_rows, temperature, draws)
        count = self.batch_size if count is None else count
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, self.token_ids.data.ptr, count * 8,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        event = cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return PendingIds(host, event, count)

    def greedy(self, batch: ForwardBatch) -> np.ndarray:
        """Run the step and return each sequence's greedy next token (only the ids are copied back).  # [B]"""
        return self.launch(batch).wait()


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # buckets: a decode batch runs in the smallest that holds it


def is_decode(batch: ForwardBatch) -> bool:
    """One token per sequence and logits for every one of them, in order: what a decode graph computes."""
    b = batch.num_seqs
    return batch.num_tokens == b and np.array_equal(batch.logits_indices, np.arange(b))


class DecodeGraphs:
    """The engine's decode steps as CUDA graphs: one `DecodeGraph` per batch-size bucket, captured the first time
    a decode batch of that bucket comes, a smaller batch padded up to it (padding rows write no KV: slot -1).

    Used only where a step's work is fixed by shapes: a backend that captures graphs with a store that needs no
    host work between kernels (`ExpertStore.capturable`; GPU expert slots synchronise with the host every layer).
    `logits(batch)` returns the rows of the real sequences, and
    `device_logits(batch)` the same left on the device for the sampler. `launch(batch, feed_rows)` enqueues a
    greedy step whose tokens may be the previous step's argmaxes (rows of the shared `feedback`): all graphs run
    on one stream in launch order and write their argmaxes to the same buffer.
    """

    def __init__(self, model: MoETransformer, kv_cache: PagedKVCache, max_blocks: int, max_batch_size: int):
        import cupy

        self.model, self.kv_cache, self.max_blocks = model, kv_cache, max_blocks
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s < max_batch_size] + [max_batch_size]
        self._graphs: dict[int, DecodeGraph] = {}
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.feedback = cupy.zeros((self.sizes[-1],), np.int64)  # [max_batch_size] the last step's argmaxes

    @staticmethod
    def usable(model: MoETransformer, kv_cache: PagedKVCache) -> bool:
        return model.backend.captures(model.config, kv_cache.dtype) and model.store.capturable

    def fits(self, batch: ForwardBatch) -> bool:
        return (batch.num_seqs <= self.sizes[-1] and batch.block_tables.shape[1] <= self.max_blocks
                and is_decode(batch))

    def logits(self, batch: ForwardBatch) -> np.ndarray:
        """The step's logits [B, V] float32 on the host, from the graph of the bucket holding B sequences."""
        graph = self._graph(batch)
        graph.run(_padded(batch, graph.batch_size))
        return graph.logits[:batch.num_seqs].get(stream=graph.stream)

    def device_logits(self, batch: ForwardBatch) -> DeviceLogits:
        """The step's logits [B, V] left on the device (and the graph's argmaxes), for the sampler; valid until
        the next step."""
        graph, b = self._graph(batch), batch.num_seqs
        graph.run(_padded(batch, graph.batch_size))
        return DeviceLogits(graph.logits[:b], self.model.backend, graph.stream, argmax=graph.token_ids[:b])

    def launch(self, batch: ForwardBatch, feed_rows: np.ndarray, temperature: np.ndarray | None = None,
               draws: np.ndarray | None = None) -> PendingIds:
        """Enqueue a step without waiting for the steps before it; `feed_rows` [B] int64 names, where >= 0, the row
        of the previous launched step's tokens that is the sequence's token (batch.token_ids there is ignored).
        Each sequence's token is its argmax, or where `temperature` [B] float32 is above 0 a draw over the whole
        vocabulary with the uniform `draws` [B] uint64 (DecodeGraph.run; by default every token is the argmax). The
        host must have waited for the step before the previous one."""
        graph = self._graph(batch)
        pad = graph.batch_size - batch.num_seqs
        if temperature is None:
            temperature, draws = np.zeros(batch.num_seqs, np.float32), np.zeros(batch.num_seqs, np.uint64)

        def padded(values: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([values, np.full(pad, fill, values.dtype)]) if pad else values

        return graph.launch(_padded(batch, graph.batch_size), padded(feed_rows, -1), batch.num_seqs,
                            padded(temperature, 0.0), padded(draws, 0))

    def launch_eager(self, batch: ForwardBatch, feed_rows: np.ndarray, temperature: np.ndarray,
                     draws: np.ndarray) -> PendingIds:
        """Enqueue a step no graph holds (prompt chunks beside decode tokens, or a batch past the buckets) on the
        graphs' stream, launch by launch, without waiting for the steps before it: `feed_rows` [T] int64 names,
        where >= 0, the row of the previous launched step's tokens that is that token of the batch. The step's
        tokens, one per logits row, are the argmax or, where `temperature` [N] float32 is above 0, a draw with the
        uniform `draws` [N] uint64 (as DecodeGraph.run's), and go to `feedback` as a graph's do. Its work must
        not wait for the host (Backend.max_tokens_in_stream_order); its arrays come from the stream's pool, so a
        later step on the stream reuses them only once it is done."""
        import cupy
        import cupyx

        backend, n = self.model.backend, batch.logits_indices.shape[0]
        if n > self.feedback.shape[0]:
            raise ValueError(f"{n} sampled rows exceed the feedback buffer's {self.feedback.shape[0]}")
        with self.stream:
            inputs = self.model.upload_batch(batch)  # asynchronous copies through pinned staging, in stream order
            backend.feed_tokens(inputs["token_ids"], backend.upload(feed_rows), self.feedback)
            logits = self.model.forward_device(batch, inputs, self.kv_cache)  # [N, V]
            ids = backend.greedy(logits, out=self.feedback[:n])  # [N]
            draw_on_device(logits, cupy.arange(n, dtype=np.int32), backend.upload(temperature), backend.upload(draws),
                           ids)
            host = cupyx.empty_pinned((n,), np.int64)  # [N] kept by the PendingIds until its copy is read
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, ids.data.ptr, n * 8, cupy.cuda.runtime.memcpyDeviceToHost,
                                          self.stream.ptr)
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        return PendingIds(host, event, n)

    def synchronize(self) -> None:
        """Wait until every launched step finished."""
        self.stream.synchronize()

    def _graph(self, batch: ForwardBatch) -> DecodeGraph:
        """The graph of the bucket holding the batch's sequences (captured on first use, after the launched steps
        finished)."""
        size = next(s for s in self.sizes if s >= batch.num_seqs)
        graph = self._graphs.get(size)
        if graph is None:
            self.stream.synchronize()
            graph = self._graphs[size] = DecodeGraph(self.model, self.kv_cache, size, self.max_blocks,
                                                     stream=self.stream, feedback=self.feedback)
        return graph


def _typed(views: dict, batch_size: int) -> None:
    """The temperature and draws slots of a packed int64 input buffer, viewed as float32 [B] and uint64 [B]."""
    views["temperature"] = views["temperature"].view(np.float32)[:batch_size]
    views["draws"] = views["draws"].view(np.uint64)


def _padded(batch: ForwardBatch, size: int) -> ForwardBatch:
    """A decode batch of `size` sequences: `batch`'s, then rows that read position 0 and write no KV."""
    pad = size - batch.num_seqs
    if pad == 0:
        return batch

    def extend(values: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(pad, fill, values.dtype)])

    def tables(values: np.ndarray) -> np.ndarray:
        padded = np.zeros((size, values.shape[1]), np.int64)  # [size, width]
        padded[: batch.num_seqs] = values
        return padded

    sliding = batch.sliding_block_tables is not None
    return ForwardBatch(token_ids=extend(batch.token_ids, 0), positions=extend(batch.positions, 0),
                        query_start=np.arange(size + 1, dtype=np.int64), context_lens=extend(batch.context_lens, 1),
                        block_tables=tables(batch.block_tables), slot_mapping=extend(batch.slot_mapping, -1),
                        logits_indices=np.arange(size, dtype=np.int64),
                        sliding_block_tables=tables(batch.sliding_block_tables) if sliding else None,
                        sliding_slot_mapping=extend(batch.sliding_slot_mapping, -1) if sliding else None)
