"""Kernel arguments of programmatic launches (backends/launch.py) are marshalled as CuPy marshals them: device
arrays as their address, NumPy scalars by their own width; anything else (a Python int, whose width the kernel
cannot know) is refused. No GPU needed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from colibri_stream.backends.launch import _argument, programmatic_active, programmatic_launches


class _DeviceArray:
    """The part of a CuPy array a launch reads: data.ptr."""

    class _Memory:
        ptr = 0x7F00_0000_1000

    data = _Memory()


@pytest.mark.parametrize("value,ctype", [(np.int32(-7), ctypes.c_int32), (np.int64(1 << 40), ctypes.c_int64),
                                         (np.uint64(2**63 + 5), ctypes.c_uint64), (np.float32(0.25), ctypes.c_float),
                                         (np.float64(-1.5), ctypes.c_double), (np.uint32(9), ctypes.c_uint32)])
def test_numpy_scalars_keep_their_width_and_value(value, ctype):
    argument = _argument(value)
    assert isinstance(argument, ctype) and ctypes.sizeof(argument) == value.dtype.itemsize
    assert argument.value == value.item()


def test_device_arrays_pass_their_address():
    argument = _argument(_DeviceArray())
    assert isinstance(argument, ctypes.c_uint64) and argument.value == _DeviceArray.data.ptr


@pytest.mark.parametrize("value", [3, 0.5, None, np.int8(1), "x"])
def test_arguments_of_unknown_width_are_refused(value):
    with pytest.raises(TypeError, match="kernel argument"):
        _argument(value)


def test_programmatic_launches_nest_and_restore():
    assert not programmatic_active()
    with programmatic_launches():
        assert programmatic_active()
        with programmatic_launches(False):
            assert not programmatic_active()
        assert programmatic_active()
    assert not programmatic_active()
