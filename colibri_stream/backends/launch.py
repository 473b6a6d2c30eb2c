"""Programmatic dependent launch (PDL): kernels of a captured decode step that start while the one before them ends.

A decode step at small batch is a chain of short kernels, each shorter than the gap a kernel boundary costs
(BENCHMARKS.md, step kernels), and between two kernels of a CUDA graph the GPU drains the first grid
before it launches the second. Launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (sm_90 and
newer), a kernel's blocks are scheduled as soon as every block of the kernel before it has started, and run up to
`pdl_wait()` (kernels/common.cuh) while that kernel finishes: they get resident and pull their weights into L2
(`prefetch_l2`) meanwhile. `pdl_wait()` returns once the earlier kernel completed with its writes visible, so every
kernel of kernels/*.cu calls it before reading an activation or writing anything; for a kernel launched normally it
returns at once.

CuPy launches through cuLaunchKernel, which takes no launch attributes; inside `programmatic_launches()` the
backend's launches go through the driver's cuLaunchKernelEx (ctypes) instead. DecodeGraph turns it on while it
captures: the graph keeps the programmatic edges, and the launch's Python cost is paid once, at capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID in cuda.h
_ARGUMENT_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
                   np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
                   np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here one int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_active = False


@functools.lru_cache(maxsize=None)
def _driver_launch():
    """The driver's cuLaunchKernelEx, or None where the driver predates it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def programmatic_launch_supported() -> bool:
    """Whether the current GPU (sm_90 or newer) and its driver take programmatic dependent launches."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90 and _driver_launch() is not None


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True) -> Iterator[None]:
    """Inside, the backend's kernels launch with programmatic stream serialization (when `enabled`)."""
    global _active
    previous, _active = _active, enabled
    try:
        yield
    finally:
        _active = previous


def programmatic_active() -> bool:
    return _active


def _argument(value) -> ctypes._SimpleCData:
    """A kernel argument as the C value CuPy would pass: a device array's address, a NumPy scalar's bits."""
    data = getattr(value, "data", None)
    if hasattr(data, "ptr"):  # a CuPy array
        return ctypes.c_uint64(data.ptr)
    if isinstance(value, np.generic) and value.dtype in _ARGUMENT_TYPES:
        return _ARGUMENT_TYPES[value.dtype](value.item())
    raise TypeError(f"kernel argument of type {type(value).__name__} (pass CuPy arrays and sized NumPy scalars)")


def launch_programmatic(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                        shared_mem: int = 0) -> None:
    """Launch a CuPy RawKernel on the current stream with programmatic stream serialization."""
    import cupy

    values = [_argument(a) for a in args]
    pointers = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                        for v in values))
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    grid3, block3 = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), shared_mem,
                           cupy.cuda.get_current_stream().ptr, ctypes.pointer(attribute), 1)
    status = _driver_launch()(ctypes.byref(config), kernel.kernel.ptr, pointers, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} for {kernel.name} (grid {grid3}, "
                           f"block {block3}, {shared_mem} bytes of shared memory)")
