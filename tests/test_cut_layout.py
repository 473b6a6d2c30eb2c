"""The packed layout of a cut expert's GPU part (experts/cut_layout.py), checked on the host: the copies it describes,
done with NumPy on real int8, int4 and fp8 blocks, give tensors that compute exactly the expert's first rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_expert_tiers import moe16_dir  # noqa: F401
from tiny_models import build_hf_model

from colibri_stream.checkpoint import NUMPY_DTYPES, ModelFolder
from colibri_stream.expert_codecs import FP8_BLOCK, expert_codec
from colibri_stream.experts.cpu_executor import CpuExpertExecutor, intermediate_rows, numpy_expert
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


QUANTIZED = {"int4-g32-zero": dict(quantize="int4", group_size=32, zero_point=True),
             "int4-g128": dict(quantize="int4"), "fp8-block": dict(quantize="fp8"),
             "fp8-channel": dict(quantize="fp8", fp8_scales="channel")}


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory) -> dict[str, Path]:
    """A Qwen3-MoE of 256 intermediate rows an expert (two fp8 tiles, eight int4 groups of 32) in each format."""
    from colibri_stream.export import export_model

    hf_dir = tmp_path_factory.mktemp("hf_wide_experts")
    build_hf_model("qwen3_moe", hf_dir, moe_intermediate_size=256)
    folders = {}
    for name, options in QUANTIZED.items():
        folders[name] = tmp_path_factory.mktemp("models") / name
        export_model(hf_dir, folders[name], dtype="fp32", progress=False, **options)
    return folders


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_parts_hold_whole_groups_and_add_up_to_the_expert(quantized_dirs, name):
    """A cut of an int4 or fp8 expert at a multiple of its row group: the packed codes and gate/up scales are the
    first groups' own, down's scales and zero points whole (the kernels read their first columns at the whole
    tensor's pitch); the part, with those first columns of down's scales, plus the CPU's rest (the executor's
    kernel, and the NumPy reference) is the whole expert."""
    experts = ModelFolder(quantized_dirs[name]).experts
    config = experts.config
    inter = config.moe_intermediate_size
    group = expert_codec(config).row_group(inter)
    assert group == {"int4-g32-zero": 32, "int4-g128": 128, "fp8-block": 128, "fp8-channel": 1}[name]
    with pytest.raises(ValueError, match="splits its groups"):
        CutLayout(experts.slots, group + 16, group) if group > 16 else CutLayout(experts.slots, 7, 2)
    block = np.array(experts.block(config.moe_layers[0], 5))  # [block_size] uint8
    tensors = experts.unpack(block)
    x = np.random.default_rng(5).standard_normal((3, config.hidden_size), dtype=np.float32)
    whole = numpy_expert(x, tensors)
    executor = CpuExpertExecutor(num_threads=2, min_kernel_bytes=0)
    for rows in sorted({group, 128}):
        layout = CutLayout(experts.slots, rows, group)
        assert layout.nbytes <= experts.block_size
        packed = copy_like_the_gpu(layout, block)
        for tensor, array in packed.items():
            source = tensors[tensor]
            if tensor in ("down_scale", "down_zero"):
                np.testing.assert_array_equal(array, source, err_msg=tensor)
                continue
            axis = 1 if tensor.startswith("down") else 0
            entries = rows if source.shape[axis] == inter else rows // group
            np.testing.assert_array_equal(array, np.take(source, np.arange(entries), axis=axis), err_msg=tensor)
        # the columns of down's scales over the part's rows: int4's groups, fp8's tiles
        columns = packed["down"].shape[1] if packed["down"].ndim == 3 else -(-rows // FP8_BLOCK)
        part = {tensor: array[:, :columns] if tensor in ("down_scale", "down_zero") and array.ndim == 2 else array
                for tensor, array in packed.items()}
        gpu_part = numpy_expert(x, part)
        for rest in (numpy_expert(x, intermediate_rows(tensors, rows, inter)),
                     executor.run(x, tensors, (rows, inter))):
            np.testing.assert_allclose(gpu_part + rest, whole, rtol=1e-4, atol=1e-5 * np.abs(whole).max())
