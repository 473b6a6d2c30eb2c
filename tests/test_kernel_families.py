"""Which instantiations of a templated kernel file compile together (cupy_launch.FAMILIES), checked without a GPU."""

from __future__ import annotations

import re

import pytest

from colibri_stream.backends import cupy_latent, cupy_latent_prefill
from colibri_stream.backends.cupy_flash_attention import FLASH_ROWS
from colibri_stream.backends.cupy_launch import FAMILIES, launch
from colibri_stream.backends.kernels import kernel_dir


def test_a_launch_outside_its_files_family_is_refused_before_compiling():
    """A kernel expression missing from the family compiled for its weight type (int4's down product of 16-byte
    lanes launched with gate and up's 4-byte family) is a clear error, not a missing symbol from the driver."""
    assert "moe_down_int4<16, 1>" in FAMILIES["moe_int4.cu"]("16")
    with pytest.raises(ValueError, match=r"moe_down_int4<16, 1> is not among the instantiations of moe_int4.cu "
                                         r"compiled for weight type '4'"):
        launch("moe_int4.cu", "moe_down_int4<16, 1>", (1,), 128, (), weight_type="4")


@pytest.mark.parametrize("kv_type", ["__nv_bfloat16", "__half", "__nv_fp8_e4m3"])
def test_latent_attention_compiles_with_its_cache_types(kv_type):
    family = FAMILIES["latent_attention.cu"](kv_type)
    assert {f"latent_attention<{kv_type}, 512, 64, {split}, {m_tiles}>" for split in ("true", "false")
            for m_tiles in (1, 2)} | {f"latent_rope_write<{kv_type}>"} <= set(family)
    assert FAMILIES["latent_attention.cu"]("float") == ("latent_rope_write<float>",)


def kernel_constants(name: str) -> dict[str, int]:
    """The `constexpr int NAME = value;` lines of kernels/<name> whose value is a literal."""
    text = (kernel_dir() / name).read_text()
    return {key: int(value) for key, value in re.findall(r"constexpr int (\w+) = (\d+);", text)}


def test_the_latent_launches_mirror_their_kernels_constants():
    """cupy_latent.py's launch shapes and shared-memory sizes follow the constants of the kernels they launch."""
    latent, linear, flash = (kernel_constants(name) for name in ("latent_attention.cu", "linear.cu", "flash.cuh"))
    assert (cupy_latent.LATENT_HEADS, cupy_latent.LATENT_KEYS, cupy_latent.LATENT_STAGES, cupy_latent.ROPE_HEADS) == (
        latent["LATENT_HEADS"], latent["LATENT_KEYS"], latent["LATENT_STAGES"], latent["ROPE_HEADS"])
    assert cupy_latent.LATENT_THREADS == 32 * latent["LATENT_WARPS"]
    assert cupy_latent.HEAD_ROWS == linear["LINEAR_WARPS"] * 32 // linear["HEAD_TEAM"] * linear["HEAD_TEAM_ROWS"]
    assert cupy_latent.FLASH_PAD == flash["FLASH_PAD"]


def test_the_decompressed_prefill_mirrors_its_kernels_constants():
    """cupy_latent_prefill.py's launch shape and shared-memory size follow latent_prefill.cu's constants."""
    prefill = kernel_constants("latent_prefill.cu")
    assert (cupy_latent_prefill.PREFILL_KEYS, cupy_latent_prefill.PREFILL_STAGES) == (
        prefill["PREFILL_KEYS"], prefill["PREFILL_STAGES"])
    assert cupy_latent_prefill.PREFILL_THREADS == 32 * prefill["PREFILL_ROWS"] // 16
    assert prefill["PREFILL_ROWS"] == FLASH_ROWS  # the tiles are row_tiles' blocks
    assert FAMILIES["latent_prefill.cu"]("__nv_fp8_e4m3") == (
        "latent_gather<__nv_fp8_e4m3, __nv_bfloat16>", "latent_prefill_attention<128, 64, 128>")
