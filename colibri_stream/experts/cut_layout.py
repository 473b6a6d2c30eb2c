"""The GPU's part of an expert cut by its intermediate rows, packed into one device block.

When the placement cuts a missed expert in two (placement.place_step), the GPU computes its first `rows`
intermediate rows and the CPU the rest (CpuExpertExecutor.run with rows=); the two partial outputs add up to the
expert's. The GPU part is copied from the expert's pinned block (experts.bin's layout: gate [I, H], up [I, H],
down [H, I], then the int8 scales) into a device block packed as an expert of intermediate size `rows`: gate and up
rows 0 .. rows - 1 (contiguous), down's first `rows` columns (one 2D copy: H rows of `rows` elements with a source
pitch of I), their scales, and down's per-row scales whole. The MoE kernels then compute it like any expert in a
slot, with I = rows.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import NUMPY_DTYPES, TensorSlot

TENSOR_ALIGNMENT = 256  # bytes; each packed tensor starts on this boundary (the kernels read 16-byte vectors)
# block tensor dtype -> the dtype of its device view (the kernels read bf16 as uint16 bits and fp8 e4m3 as bytes)
DEVICE_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "int8": np.int8,
                 "uint8": np.uint8, "float8_e4m3fn": np.uint8}


def _align(offset: int) -> int:
    return -(-offset // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


class CutLayout:
    """Where each tensor of an expert's first `rows` intermediate rows lies in a packed block, and how to copy it.

    tensors: the expert block's TensorSlots (checkpoint.expert_block_layout). `pieces` lists per tensor (name, source
    offset, packed offset, packed shape, bytes per copied row, source pitch, copied rows): one 2D copy each.
    """

    def __init__(self, tensors: list[TensorSlot], rows: int):
        self.rows = rows
        self.pieces = []
        offset = 0
        for t in tensors:
            itemsize = NUMPY_DTYPES[t.dtype].itemsize
            if t.name == "down":  # [H, I] -> [H, rows]: `rows` elements of each of the H rows
                shape, width, pitch, height = (t.shape[0], rows), rows * itemsize, t.shape[1] * itemsize, t.shape[0]
            elif t.name == "down_scale":  # [H], whole
                shape, width, pitch, height = t.shape, t.nbytes, t.nbytes, 1
            else:  # gate, up [I, H] and their scales [I]: the first `rows` rows, contiguous
                shape = (rows, *t.shape[1:])
                width = int(np.prod(shape)) * itemsize
                pitch, height = width, 1
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
