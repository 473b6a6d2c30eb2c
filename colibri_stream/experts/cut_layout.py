"""The GPU's part of an expert cut by its intermediate rows, packed into one device block.

When the placement cuts a missed expert in two (placement.place_step), the GPU computes its first `rows`
intermediate rows and the CPU the rest (CpuExpertExecutor.run with rows=); the two partial outputs add up to the
expert's. The GPU part is copied from the expert's pinned block (experts.bin's layout: the weights gate [I, H],
up [I, H], down [H, I], then their scales and zero points, expert_codecs.py) into a device block packed as an
expert of intermediate size `rows`, one copy a tensor. Gate's and up's tensors run over the intermediate rows
along their first axis (their first entries, contiguous), down's weights along their second (one 2D copy: the
first entries of each of its H rows). An axis shorter than I holds a group of `row_group` rows an entry (int4's
groups of down's columns, fp8's tiles of gate's and up's rows), so `rows` is a multiple of it and the part holds
whole groups. Down's scales and zero points are copied whole: they are small, a 2D copy of their short rows
would be slow, and the kernels read a row of them at the whole tensor's pitch (their last axis), so the part's
first columns find their own. The MoE kernels then compute the part like any expert in a slot, with I = rows.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import NUMPY_DTYPES, TensorSlot

TENSOR_ALIGNMENT = 256  # bytes; each packed tensor starts on this boundary (the kernels read 16-byte vectors)
# block tensor dtype -> the dtype of its device view (the kernels read bf16 as uint16 bits and fp8 e4m3 as bytes)
DEVICE_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "int8": np.int8,
                 "uint8": np.uint8, "float8_e4m3fn": np.uint8}
WHOLE = ("down_scale", "down_zero")  # copied whole (the module docstring)


def _align(offset: int) -> int:
    return -(-offset // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


class CutLayout:
    """Where each tensor of an expert's first `rows` intermediate rows lies in a packed block, and how to copy it.

    tensors: the expert block's TensorSlots (checkpoint.expert_block_layout); row_group: the format's
    ExpertCodec.row_group, which divides `rows`. `pieces` lists per tensor (name, dtype, source offset, packed
    offset, packed shape, bytes per copied row, source pitch, copied rows): one 2D copy each.
    """

    def __init__(self, tensors: list[TensorSlot], rows: int, row_group: int = 1):
        if rows % row_group:
            raise ValueError(f"a cut expert's GPU part of {rows} rows splits its groups of {row_group} rows")
        inter = next(t.shape[0] for t in tensors if t.name == "gate")
        self.rows = rows
        self.pieces = []
        offset = 0
        for t in tensors:
            itemsize = NUMPY_DTYPES[t.dtype].itemsize
            axis = 1 if t.name.startswith("down") else 0  # the axis over the intermediate rows
            if t.name in WHOLE or len(t.shape) <= axis:  # (a tensor without that axis: down's bias [H])
                shape, width, pitch, height = t.shape, t.nbytes, t.nbytes, 1
            else:
                entries = rows if t.shape[axis] == inter else rows // row_group
                shape = (*t.shape[:axis], entries, *t.shape[axis + 1:])
                inner = int(np.prod(t.shape[axis + 1:], dtype=np.int64)) * itemsize  # bytes of one entry
                width = entries * inner
                height, pitch = (t.shape[0], t.shape[axis] * inner) if axis else (1, width)
            self.pieces.append((t.name, t.dtype, t.offset, offset, shape, width, pitch, height))
            offset = _align(offset + width * height)
        self.nbytes = offset

    def enqueue_copy(self, source: int, destination: int, stream) -> None:
        """Queue the host -> device copies from the pinned block at address `source` to `destination` on `stream`."""
        import cupy as cp

        for _, _, src_offset, dst_offset, _, width, pitch, height in self.pieces:
            cp.cuda.runtime.memcpy2DAsync(destination + dst_offset, width, source + src_offset, pitch, width, height,
                                          cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def arrays(self, memory, offset: int) -> dict:
        """The packed tensors as one-slot device arrays ([1, rows, H], [1, H, rows], [1, rows] ...) at `offset`
        bytes into the cupy allocation `memory`."""
        import cupy as cp

        arrays = {}
        for name, dtype, _, dst_offset, shape, _, _, _ in self.pieces:
            arrays[name] = cp.ndarray((1, *shape), DEVICE_DTYPES[dtype], memptr=memory + (offset + dst_offset))
        return arrays
