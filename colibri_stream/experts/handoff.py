"""Handing small results between the GPU stream and host threads with as few host waits as possible.

`HostFlag`: a word of pinned host memory a CUDA stream waits on (the driver's cuStreamWaitValue32). The thread
that computes experts on the CPU sets it once its result is written, so the stream can hold the work that reads
the result (a copy to the device, the add into the layer's output) while the step thread goes on queueing the
next layer's kernels instead of waiting for the CPU. CuPy does not wrap the driver's stream memory operations, so
they are called through ctypes on libcuda; CUDA 12 drivers support 32-bit waits on every device.

`PinnedReadback`: several device arrays copied into reused pinned buffers on one stream with one synchronisation
(three blocking `asnumpy` calls were three); the copies can be queued before the host is ready to wait for them.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from .pinned import pinned_empty

logger = logging.getLogger(__name__)
CU_STREAM_WAIT_VALUE_GEQ = 0  # proceed once (int32)(*addr - value) >= 0: a counter may wrap


class HostFlag:
    """A pinned uint32 counter that a stream waits on and a host thread raises.

    `ticket()` gives the next value; `wait(stream, value)` queues a wait on `stream` until the counter reaches it;
    `set(value)` (any thread, after writing what the waiting work reads) releases it. `create()` returns None when
    the driver refuses stream waits on host memory: then the caller waits on the host.
    """

    def __init__(self, driver: ctypes.CDLL):
        import cupy

        mapped = cupy.cuda.PinnedMemory(4, cupy.cuda.runtime.hostAllocMapped)  # the device may read it
        self.word = np.ndarray((1,), np.uint32, buffer=cupy.cuda.PinnedMemoryPointer(mapped, 0))
        self.word[0] = 0
        self._count = 0
        pointer = ctypes.c_uint64()
        self._check(driver, driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer),
                                                               ctypes.c_void_p(self.word.ctypes.data), 0))
        self.device_pointer = pointer.value
        self._wait = driver.cuStreamWaitValue32_v2
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._driver = driver

    @classmethod
    def create(cls, stream) -> HostFlag | None:
        """A flag whose first wait (already satisfied) `stream` accepted, or None (logged) if the driver has no
        stream memory operations."""
        try:
            flag = cls(ctypes.CDLL("libcuda.so.1"))
            flag.wait(stream, 0)
        except (OSError, AttributeError, RuntimeError) as error:
            logger.warning("streams cannot wait on host memory (%s): the step waits for the CPU's experts", error)
            return None
        return flag

    @staticmethod
    def _check(driver: ctypes.CDLL, status: int) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            driver.cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"CUDA driver error {status} ({(name.value or b'?').decode()})")

    def ticket(self) -> int:
        self._count = (self._count + 1) & 0xFFFFFFFF
        return self._count

    def wait(self, stream, value: int) -> None:
        """Work queued on `stream` after this starts once the counter reaches `value`."""
        self._check(self._driver, self._wait(ctypes.c_void_p(stream.ptr), self.device_pointer, value,
                                             CU_STREAM_WAIT_VALUE_GEQ))

    def set(self, value: int) -> None:
        self.word[0] = value


class PinnedReadback:
    """Copies of device arrays in pinned host buffers, kept and grown per name, after one stream synchronisation.

    `queue` returns views of those buffers (valid until the next `queue` with the same names) that hold the arrays
    once `wait` returned.
    """

    def __init__(self):
        self._buffers: dict[str, np.ndarray] = {}

    @staticmethod
    def wait(stream) -> None:
        """Block until the copies queued on `stream` are done."""
        stream.synchronize()

    def queue(self, stream, **arrays) -> dict[str, np.ndarray]:
        """Queue the copies on `stream`; their host views by name."""
        out = {}
        for name, array in arrays.items():
            buffer = self._buffers.get(name)
            if buffer is None or buffer.nbytes < array.nbytes:
                buffer = self._buffers[name] = pinned_empty(1, 2 * max(array.nbytes, 1))[0]  # room to grow without reallocating
            host = buffer[: array.nbytes].view(array.dtype).reshape(array.shape)
            array.get(stream=stream, out=host, blocking=False)
            out[name] = host
        return out
