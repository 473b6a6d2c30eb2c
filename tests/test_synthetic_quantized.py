"""Synthetic model folders with quantized experts: drawn as the bf16 folder's experts, then quantized by the codecs of
expert_codecs.py, so both folders hold the same weights up to the format's rounding (benchmarks/quantized.py)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from colibri_stream import synthetic
from colibri_stream.batch import single_sequence_batch
from colibri_stream.checkpoint import ModelFolder
from colibri_stream.expert_codecs import (Fp8Codec, Int4Codec, Int8Codec, Mxfp4Codec, dequantize_expert,
                                          expert_codec)
from colibri_stream.loader import load_model
from colibri_stream.synthetic import quantize_expert, shape_config, with_expert_format, write_synthetic_folder

# (expert_dtype, group_size, zero_point, scales) as write_synthetic_folder takes them
FORMATS = [("int4", 32, True, "block"), ("int4", 64, False, "block"), ("int4", 128, False, "block"),
           ("fp8", 128, False, "block"), ("fp8", 128, False, "channel"), ("int8", 128, False, "block"),
           ("mxfp4", 128, False, "block")]


def small_config():
    """A Qwen3-MoE of 2 layers whose expert matrices span several int4 groups, a partial last group (I = 160 with
    groups of 128) and partial 128 x 128 fp8 tiles."""
    return dataclasses.replace(shape_config("qwen3-30b-a3b", 2), vocab_size=300, hidden_size=256, num_heads=4,
                               num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=160,
                               max_position_embeddings=128)


@pytest.mark.parametrize("codec", [Int4Codec(32, True), Int4Codec(128, False), Fp8Codec("block"),
                                   Fp8Codec("channel"), Int8Codec(), Mxfp4Codec()], ids=lambda c: c.describe())
def test_quantizing_in_row_chunks_equals_quantizing_whole_matrices(codec):
    rng = np.random.default_rng(3)
    matrices = {"gate": rng.standard_normal((300, 192), np.float32), "up": rng.standard_normal((300, 192), np.float32),
                "down": rng.standard_normal((192, 300 - 12), np.float32)}  # 300 rows: chunks of 128, 128, 44
    whole = {}
    for name, matrix in matrices.items():
        whole.update(codec.quantize_matrix(name, matrix))
    with ThreadPoolExecutor(3) as pool:
        chunked = quantize_expert(codec, matrices, pool, rows=128)
        assert chunked.keys() == whole.keys()
        for key, array in whole.items():
            assert chunked[key].dtype == array.dtype and chunked[key].shape == array.shape, key
            assert np.array_equal(chunked[key].view(np.uint8), array.view(np.uint8)), key
        with pytest.raises(ValueError, match="multiple of 128"):
            quantize_expert(codec, matrices, pool, rows=100)  # would cut fp8's tiles


def test_with_expert_format_keeps_only_the_formats_own_parameters():
    config = small_config()
    int4 = with_expert_format(config, "int4", 64, True, "channel")
    assert (int4.expert_dtype, int4.expert_group_size, int4.expert_zero_point, int4.expert_scales) == \
        ("int4", 64, True, "")
    fp8 = with_expert_format(int4, "fp8", scales="channel")
    assert (fp8.expert_group_size, fp8.expert_zero_point, fp8.expert_scales) == (0, False, "channel")
    assert with_expert_format(fp8, "bfloat16") == config


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    write_synthetic_folder(path, small_config(), device="cpu")
    return ModelFolder(path, verify=True)


@pytest.mark.parametrize("expert_dtype,group_size,zero_point,scales", FORMATS,
                         ids=[f"{f[0]}-g{f[1]}-{'zp' if f[2] else f[3]}" for f in FORMATS])
def test_quantized_folder_holds_the_bf16_folders_experts_within_the_codecs_bound(
        tmp_path, monkeypatch, bf16_folder, expert_dtype, group_size, zero_point, scales):
    monkeypatch.setattr(synthetic, "QUANTIZE_ROWS", 128)  # gate and up (160 rows) are quantized in two chunks
    config = write_synthetic_folder(tmp_path, small_config(), expert_dtype=expert_dtype, device="cpu",
                                    group_size=group_size, zero_point=zero_point, scales=scales)
    folder = ModelFolder(tmp_path, verify=True)  # opens, every checksum
    assert folder.config == config and config.expert_dtype == expert_dtype
    assert config == with_expert_format(small_config(), expert_dtype, group_size, zero_point, scales)
    codec = expert_codec(folder.config)
    if expert_dtype == "int4":
        assert (folder.config.expert_group_size, folder.config.expert_zero_point) == (group_size, zero_point)
        assert codec.describe().startswith(f"int4, groups of {group_size}")
    if expert_dtype == "fp8":
        assert folder.config.expert_scales == scales
    assert folder.dense.get("layers.1.q_proj").tobytes() == bf16_folder.dense.get("layers.1.q_proj").tobytes()
    rounded = 0
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            stored = folder.experts.tensors(layer, expert)
            values = dequantize_expert(stored)
            for name, reference in bf16_folder.experts.tensors(layer, expert).items():
                weight = reference.astype(np.float32)
                error = np.abs(values[name] - weight)
                assert values[name].shape == weight.shape
                assert (error <= codec.error_bound(weight)).all(), (layer, expert, name, float(error.max()))
                rounded += int(np.count_nonzero(error))
    assert rounded > 0  # the stored values are the format's, not bf16 copies
    # the bound tells experts apart: expert 1's values are not within it of expert 0's weights
    other = dequantize_expert(folder.experts.tensors(0, 1))["gate"]
    weight = bf16_folder.experts.tensors(0, 0)["gate"].astype(np.float32)
    assert not (np.abs(other - weight) <= codec.error_bound(weight)).all()
    model, reference = load_model(str(tmp_path), device="cpu"), load_model(str(bf16_folder.path), device="cpu")
    batch = single_sequence_batch(np.arange(7), 0, np.arange(4), 8)
    logits = model.forward(batch, model.allocate_kv_cache(4, 8))
    expected = reference.forward(batch, reference.allocate_kv_cache(4, 8))
    assert np.isfinite(logits).all() and np.corrcoef(logits[0], expected[0])[0, 1] > 0.9
