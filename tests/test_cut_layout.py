"""The packed layout of a cut expert's GPU part (experts/cut_layout.py), checked on the host: the copies it describes,
done with NumPy on a real int8 block, give tensors that compute exactly the expert's first rows."""

from __future__ import annotations

import numpy as np
import pytest
from test_expert_tiers import moe16_dir  # noqa: F401

from colibri_stream.checkpoint import NUMPY_DTYPES, ModelFolder
from colibri_stream.experts.cpu_executor import intermediate_rows, numpy_expert
from colibri_stream.experts.cut_layout import TENSOR_ALIGNMENT, CutLayout


def copy_like_the_gpu(layout: CutLayout, block: np.ndarray) -> dict[str, np.ndarray]:
    """What the layout's 2D copies write, done on the host, and the packed tensors read back from it."""
    packed = np.zeros(layout.nbytes, np.uint8)
    for _, _, src, dst, _, width, pitch, height in layout.pieces:
        for row in range(height):
            packed[dst + row * width: dst + (row + 1) * width] = block[src + row * pitch: src + row * pitch + width]
    return {name: packed[dst: dst + int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize]
            .view(NUMPY_DTYPES[dtype]).reshape(shape) for name, dtype, _, dst, shape, _, _, _ in layout.pieces}


@pytest.mark.parametrize("rows", [16, 32])
def test_packed_part_is_the_first_rows_of_the_expert(moe16_dir, rows):  # noqa: F811
    experts = ModelFolder(moe16_dir).experts
    inter = experts.config.moe_intermediate_size
    block = np.array(experts.block(experts.config.moe_layers[0], 3))  # [block_size] uint8
    tensors = experts.unpack(block)
    layout = CutLayout(experts.slots, rows)
    assert layout.nbytes <= experts.block_size  # it fits the staging block
    assert all(dst % TENSOR_ALIGNMENT == 0 for _, _, _, dst, _, _, _, _ in layout.pieces)
    packed = copy_like_the_gpu(layout, block)
    assert packed["gate"].shape == (rows, experts.config.hidden_size)
    assert packed["down"].shape == (experts.config.hidden_size, rows)
    want = intermediate_rows(tensors, 0, rows)
    for name, array in packed.items():
        np.testing.assert_array_equal(array, want[name], err_msg=name)
    x = np.random.default_rng(rows).standard_normal((3, experts.config.hidden_size), dtype=np.float32)
    if rows < inter:  # with the CPU's rest, the whole expert
        whole = numpy_expert(x, tensors)
        parts = numpy_expert(x, packed) + numpy_expert(x, intermediate_rows(tensors, rows, inter))
        np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6 * np.abs(whole).max())
