"""An expert-parallel group's collectives over NCCL (`cupy.cuda.nccl`): one rank per process and GPU.

Rank 0 makes the group's id (`nccl_unique_id`) and hands it to the other ranks (over the engine processes' pipes,
`expert_group.py`); each rank then builds `NcclCommunicator(rank, size, unique_id)` with its GPU current, every
rank at about the same time (NCCL's init waits for all of them).

The operations take CuPy arrays, or NumPy arrays (copied to the GPU and the results back to the host: the
`Communicator` contract of `FakeGroup` and `PipeCommunicator`). Each is enqueued on the current stream and waited
for, with a watchdog: past `timeout` seconds (a dead or stuck peer never joins) the communicator is aborted
(`ncclCommAbort`) and the call raises ExpertParallelError; the communicator stays failed.

- `all_to_all`: each destination's array may have its own shape (the MoE dispatch sends each peer the rows its
  experts need): an all-gather of every rank's send shapes, then one group of `ncclSend`/`ncclRecv` per peer
  (`ncclGroupStart` .. `ncclGroupEnd`; NCCL has no all-to-all call). Empty arrays are not sent.
- `all_gather`: the parts may differ in size: their sizes gathered first, every part padded to the largest.
- `reduce_scatter`: parts[d] padded to the largest part, `ncclReduceScatter` with `ncclSum` (NCCL's order of
  additions: equal to FakeGroup's to rounding).
- `broadcast`: the pickled object's length, then its bytes.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from ..errors import ExpertParallelError
from .expert_parallel import Communicator
from .pipe_group import COLLECTIVE_TIMEOUT_SECONDS

MAX_DIMS = 7  # the most dimensions an all-to-all's arrays may have (a shape travels as [ndim, dims...] int64)
POLL_SECONDS = 20e-6  # how often the watchdog asks whether the stream finished a collective


def nccl_unique_id() -> tuple:
    """A new group's id (rank 0 makes it, every rank passes it to NcclCommunicator)."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


class NcclCommunicator(Communicator):
    """Rank `rank` of `size` over NCCL on the current GPU (see the module's docstring)."""

    def __init__(self, rank: int, size: int, unique_id: tuple, timeout: float = COLLECTIVE_TIMEOUT_SECONDS):
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl = cupy, nccl
        self.rank, self.size, self.timeout = rank, size, timeout
        self._comm = nccl.NcclCommunicator(size, unique_id, rank)
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint8): nccl.NCCL_UINT8,
                       np.dtype(np.int8): nccl.NCCL_INT8}
        self._failure: str | None = None

    def all_to_all(self, sends: list[Any]) -> list[Any]:
        on_host = isinstance(sends[self.rank], np.ndarray)
        sends = [self._on_device(array) for array in sends]
        shapes = np.zeros((self.size, MAX_DIMS + 1), np.int64)  # [d]: the shape this rank sends to rank d
        for d, array in enumerate(sends):
            if array.ndim > MAX_DIMS:
                raise ValueError(f"all_to_all takes arrays of at most {MAX_DIMS} dimensions, got {array.shape}")
            shapes[d, :array.ndim + 1] = (array.ndim, *array.shape)
        table = self._gather_fixed(self._cupy.asarray(shapes)).get()  # [source, destination, MAX_DIMS + 1]
        dtype = sends[self.rank].dtype
        received = []
        for source in range(self.size):
            ndim = int(table[source, self.rank, 0])
            received.append(self._cupy.empty(tuple(int(n) for n in table[source, self.rank, 1:ndim + 1]), dtype))
        stream = self._stream()
        self._nccl.groupStart()
        try:
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                if sends[peer].size:
                    self._comm.send(sends[peer].data.ptr, sends[peer].size, self._type(dtype), peer, stream)
                if received[peer].size:
                    self._comm.recv(received[peer].data.ptr, received[peer].size, self._type(dtype), peer, stream)
        finally:
            self._nccl.groupEnd()
        received[self.rank][...] = sends[self.rank]
        self._wait()
        return [self._cupy.asnumpy(array) for array in received] if on_host else received

    def all_gather(self, part: Any) -> list[Any]:
        on_host = isinstance(part, np.ndarray)
        part = self._on_device(part)
        shapes = self._gather_fixed(self._cupy.asarray(np.array([part.size, *part.shape], np.int64))).get()
        largest = int(shapes[:, 0].max())  # [size, 1 + ndim]: each part's size and shape
        padded = self._cupy.zeros(largest, part.dtype)
        padded[:part.size] = part.reshape(-1)
        gathered = self._gather_fixed(padded)  # [size, largest]
        parts = [gathered[r, :int(shapes[r, 0])].reshape(tuple(int(n) for n in shapes[r, 1:]))
                 for r in range(self.size)]
        return [self._cupy.asnumpy(p) for p in parts] if on_host else parts

    def reduce_scatter(self, parts: list[Any]) -> Any:
        on_host = isinstance(parts[self.rank], np.ndarray)
        parts = [self._on_device(p) for p in parts]
        largest = max(p.size for p in parts)
        dtype = parts[self.rank].dtype
        sends = self._cupy.zeros((self.size, largest), dtype)  # [d]: this rank's part for rank d, padded
        for d, p in enumerate(parts):
            sends[d, :p.size] = p.reshape(-1)
        total = self._cupy.empty(largest, dtype)
        self._comm.reduceScatter(sends.data.ptr, total.data.ptr, largest, self._type(dtype), self._nccl.NCCL_SUM,
                                 self._stream())
        self._wait()
        mine = total[:parts[self.rank].size].reshape(parts[self.rank].shape)
        return self._cupy.asnumpy(mine) if on_host else mine

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        payload = pickle.dumps(obj) if self.rank == root else b""
        length = self._cupy.asarray(np.array([len(payload)], np.int64))
        self._bcast(length, root)
        data = (self._cupy.asarray(np.frombuffer(payload, np.uint8)) if self.rank == root
                else self._cupy.empty(int(length.get()[0]), np.uint8))
        if data.size:
            self._bcast(data, root)
        return obj if self.rank == root else pickle.loads(self._cupy.asnumpy(data).tobytes())

    def abort(self, reason: str) -> None:
        """Fail this communicator (`ncclCommAbort`): its peers' collectives with it fail or time out."""
        if self._failure is None:
            self._failure = reason
            self._comm.abort()

    def _gather_fixed(self, part: Any) -> Any:
        """`ncclAllGather` of an array whose shape every rank shares -> [size, *part.shape]."""
        self._check()
        part = self._cupy.ascontiguousarray(part)
        out = self._cupy.empty((self.size, *part.shape), part.dtype)
        self._comm.allGather(part.data.ptr, out.data.ptr, part.size, self._type(part.dtype), self._stream())
        self._wait()
        return out

    def _bcast(self, array: Any, root: int) -> None:
        self._check()
        self._comm.bcast(array.data.ptr, array.size, self._type(array.dtype), root, self._stream())
        self._wait()

    def _on_device(self, array: Any) -> Any:
        return self._cupy.ascontiguousarray(self._cupy.asarray(array))

    def _type(self, dtype: Any) -> int:
        try:
            return self._types[np.dtype(dtype)]
        except KeyError:
            raise TypeError(f"NCCL collectives here take {sorted(map(str, self._types))}, not {dtype}") from None

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def _check(self) -> None:
        if self._failure is not None:
            raise ExpertParallelError(f"the expert-parallel group failed earlier: {self._failure}")

    def _wait(self) -> None:
        """Wait for the current stream's work so far, failing the communicator past `timeout` or on an NCCL
        error (a peer that left)."""
        done = self._cupy.cuda.get_current_stream().record()
        deadline = time.monotonic() + self.timeout
        while not done.done:
            try:
                self._comm.check_async_error()
            except self._nccl.NcclError as error:
                self._fail(f"NCCL reported an error on rank {self.rank}: {error}")
            if time.monotonic() > deadline:
                self._fail(f"a collective on rank {self.rank} did not finish in {self.timeout:g} s (a peer is "
                           f"gone or stuck)")
            time.sleep(POLL_SECONDS)

    def _fail(self, reason: str) -> None:
        self.abort(reason)
        raise ExpertParallelError(f"expert-parallel collective failed: {reason}")
