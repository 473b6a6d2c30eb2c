"""The quantization_config variants of published quantized MoE checkpoints: each is imported exactly or refused at
export in one line naming what is not supported.

Imported ones are checked against the export of the same checkpoint dequantized (by the format's own library, or
by the published format's arithmetic) and saved unquantized in float32: both exported with float32 dense weights,
every dense tensor and every dequantized expert must be equal. The variants: DeepSeek-V3.1's `scale_fmt` ue8m0, skip
lists (`modules_to_not_convert`, compressed-tensors' `ignore` with `re:` patterns as Kimi-K2-Thinking ships it)
that leave attention, shared experts and dense layers plain, a quantized router and shared expert gate, and a
checkpoint sharded so that weights and their scales lie in different files. Refused: the other methods and
schemes of GPTQ, AWQ, compressed-tensors and fp8 checkpoints, and damaged tensors (non-finite scales, codes of
another dtype, a g_idx that config.json does not announce, a tensor of an unknown dtype, a truncated or missing
shard).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from colibri_stream.checkpoint import ModelFolder  # noqa: E402
from colibri_stream.cli import main  # noqa: E402
from colibri_stream.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from colibri_stream.expert_codecs import dequantize_expert  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.quantized_sources import quantized_source  # noqa: E402
from quantized_checkpoints import (build_fp8_checkpoint, build_pack_quantized_checkpoint, shard,  # noqa: E402
                                   write_unquantized)
from test_quantized_import import FP8, FP8_SHAPE, PACKED, edit_tensors, error_of, packed  # noqa: E402

# Kimi-K2-Thinking's skip list: attention, shared experts and the dense layers' MLPs stay bf16, as do the routers
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
               r"re:.*mlp\.gate$")


def assert_imported_exactly(hf_dir: Path, state: dict[str, torch.Tensor], root: Path) -> ModelFolder:
    """`hf_dir` exports what its dequantized `state`, saved unquantized in float32, exports: the same dense
    tensors and dequantized experts (float32 dense weights). Returns the quantized export."""
    write_unquantized(state, hf_dir, root / "plain")
    export_model(hf_dir, root / "out", dtype="fp32", progress=False)
    export_model(root / "plain", root / "ref", dtype="fp32", progress=False)
    ours, reference = ModelFolder(root / "out", verify=True), ModelFolder(root / "ref")
    assert ours.dense.names == reference.dense.names
    for name in ours.dense.names:
        np.testing.assert_array_equal(ours.dense.get(name), reference.dense.get(name), err_msg=name)
    for layer in ours.config.moe_layers:
        for expert in range(ours.config.num_experts):
            theirs = dequantize_expert(reference.experts.tensors(layer, expert))
            for part, weight in dequantize_expert(ours.experts.tensors(layer, expert)).items():
                np.testing.assert_array_equal(weight, theirs[part], err_msg=f"{layer}.{expert}.{part}")
    ours.experts.close()
    reference.experts.close()
    return ours


# ------------------------------------------------------------------------------------------------------------------
# quantization_config as the published checkpoints write it
# ------------------------------------------------------------------------------------------------------------------

KIMI_K2_THINKING = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "ignore": list(KIMI_IGNORE),
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}}}
FP8_BLOCKS = dict(expert_dtype="fp8", expert_scales="block")
READ = [
    (FP8, FP8_BLOCKS),  # DeepSeek-V3, R1, Kimi-K2-Instruct
    (dict(FP8, scale_fmt="ue8m0"), FP8_BLOCKS),  # DeepSeek-V3.1
    (dict(FP8, modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate"]), FP8_BLOCKS),  # Qwen3-30B-A3B-FP8
    (dict(FP8, ignored_layers=["lm_head"]), FP8_BLOCKS),
    (dict(FP8, fmt="float8_e4m3fn"), FP8_BLOCKS),  # MiniMax-M2
    ({"quant_method": "fp8"}, FP8_BLOCKS),  # transformers' defaults
    (KIMI_K2_THINKING, dict(expert_dtype="int4", expert_group_size=32, expert_zero_point=False)),
    (packed(group_size=128, symmetric=False), dict(expert_dtype="int4", expert_group_size=128,
                                                   expert_zero_point=True)),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
     dict(expert_dtype="mxfp4")),  # gpt-oss
]


@pytest.mark.parametrize("quantization,expert_format", READ)
def test_published_configs_are_read(quantization, expert_format):
    assert quantized_source({"quantization_config": quantization}).expert_format() == expert_format


def test_transformers_own_fp8_config_is_read():
    from transformers import FineGrainedFP8Config

    quantization = json.loads(json.dumps(FineGrainedFP8Config().to_dict()))  # as config.json stores it
    assert quantized_source({"quantization_config": quantization}).expert_format() == FP8_BLOCKS


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "static_groups": False,
        "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq"}  # Qwen3-30B-A3B-GPTQ-Int4
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
       "modules_to_not_convert": ["mlp.gate"]}
FLOAT_QUANTIZED = {  # GLM-4.5-FP8: fp8 per output channel, activations per token
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                              "symmetric": True, "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "symmetric": True, "dynamic": True}}}}
REFUSED = [
    (GPTQ, "'gptq'"),
    (dict(GPTQ, desc_act=True), "'gptq'"),
    (dict(GPTQ, bits=8), "'gptq'"),
    (dict(GPTQ, bits=3, group_size=-1), "'gptq'"),
    (AWQ, "'awq'"),
    (dict(AWQ, version="gemv"), "'awq'"),
    (dict(AWQ, version="exllama"), "'awq'"),
    (FLOAT_QUANTIZED, "format 'float-quantized'"),
    (dict(PACKED, format="mixed-precision"), "format 'mixed-precision'"),
    (dict(PACKED, sparsity_config={"format": "sparse-bitmask"}), "sparsity_config"),
    (packed(num_bits=2), "num_bits 2"),
    (packed(num_bits=8, strategy="channel", group_size=None), "num_bits 8"),
    (packed(strategy="tensor", group_size=None), "strategy 'tensor'"),
    (packed(group_size=-1), "group_size -1"),
    (packed(type="float"), "type 'float'"),
    (packed(dynamic=True), "dynamic True"),
    (packed(actorder="group"), "actorder 'group'"),
    (dict(PACKED, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    (dict(FP8, weight_block_size=None), "weight_block_size None"),  # per-tensor scales
    (dict(FP8, weight_block_size=[1, 32]), "weight_block_size [1, 32]"),
    (dict(FP8, expert_dtype="mxfp4"), "expert_dtype 'mxfp4'"),
]


@pytest.mark.parametrize("quantization,words", REFUSED, ids=[f"{q['quant_method']}-{w}" for q, w in REFUSED])
def test_unsupported_variants_are_refused_in_one_line(quantization, words):
    with pytest.raises(UnsupportedModelError) as info:
        quantized_source({"quantization_config": quantization})
    message = str(info.value)
    assert "\n" not in message and words in message and "Colibri imports" in message, message


def test_the_cli_refuses_an_unsupported_method_in_one_line(fp8_variants, tmp_path, capsys):
    hf_dir = copy(fp8_variants / "hf", tmp_path / "awq")
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = dict(AWQ, version="gemv")
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert main(["export", str(hf_dir), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "'awq' is not supported" in err, err


# ------------------------------------------------------------------------------------------------------------------
# Variants that import exactly
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_variants(tmp_path_factory):
    """A DeepSeek-V3.1-style checkpoint: fp8 tiles with power-of-two scales (scale_fmt ue8m0), exported exactly."""
    root = tmp_path_factory.mktemp("ue8m0")
    state = build_fp8_checkpoint(root / "hf", scale_fmt="ue8m0", **FP8_SHAPE)
    assert_imported_exactly(root / "hf", state, root)
    return root


def test_ue8m0_scales_are_imported_exactly(fp8_variants):
    config = json.loads((fp8_variants / "hf" / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert ModelFolder(fp8_variants / "out").config.expert_dtype == "fp8"


def test_fp8_skip_lists_and_a_quantized_router(tmp_path):
    """DeepSeek-V3 with its shared experts and dense layer left bf16 by modules_to_not_convert, its router fp8."""
    state = build_fp8_checkpoint(tmp_path / "hf", "deepseek_v3", modules_to_not_convert=(
        "lm_head", r"model\.layers\.\d+\.mlp\.shared_experts", "model.layers.0.mlp"))
    stored = set(_tensor_names(tmp_path / "hf"))
    assert "model.layers.1.mlp.gate.weight_scale_inv" in stored
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv" not in stored
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" not in stored
    assert_imported_exactly(tmp_path / "hf", state, tmp_path)


def test_int4_ignore_list_of_kimi_k2_leaves_attention_shared_and_dense_plain(tmp_path):
    pytest.importorskip("compressed_tensors")
    state, stored = build_pack_quantized_checkpoint(tmp_path / "hf", 32, True, arch="deepseek_v3",
                                                    ignore=KIMI_IGNORE)
    assert "model.layers.0.self_attn.kv_b_proj.weight" in stored and "model.layers.0.mlp.up_proj.weight" in stored
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in stored
    assert "model.layers.1.mlp.experts.0.down_proj.weight_packed" in stored
    assert_imported_exactly(tmp_path / "hf", state, tmp_path)


def test_int4_quantized_router_shared_expert_and_dense_layer_are_dequantized(tmp_path):
    """Qwen2-MoE with everything but lm_head quantized: the router [8, H], the shared expert gate [1, H], the shared
    expert and the dense layer's MLP are dequantized. (Symmetric: compressed-tensors' own decompression of the
    zero points of a matrix of at most 8 rows fails.)"""
    pytest.importorskip("compressed_tensors")
    state, stored = build_pack_quantized_checkpoint(tmp_path / "hf", 32, True, arch="qwen2_moe", ignore=("lm_head",),
                                                    shared_expert_intermediate_size=64)
    for name in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                 "model.layers.0.mlp.shared_expert.down_proj", "model.layers.1.mlp.up_proj"):
        assert name + ".weight_packed" in stored, name
    assert_imported_exactly(tmp_path / "hf", state, tmp_path)


def test_weights_and_scales_in_different_shards(fp8_variants, tmp_path):
    hf_dir = copy(fp8_variants / "hf", tmp_path / "hf")
    weight_map = shard(hf_dir, 3)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert weight_map[name] != weight_map[name + "_scale_inv"]
    export_model(hf_dir, tmp_path / "out", dtype="fp32", progress=False)
    for file in ("dense.safetensors", "experts.bin"):
        assert (tmp_path / "out" / file).read_bytes() == (fp8_variants / "out" / file).read_bytes(), file
    scales = hf_dir / weight_map[name + "_scale_inv"]
    original = scales.read_bytes()
    scales.write_bytes(original[:-100])
    message = error_of(hf_dir, tmp_path / "a", CheckpointError)
    assert scales.name in message and "truncated" in message
    scales.unlink()
    assert f"lists {scales.name}, which is missing" in error_of(hf_dir, tmp_path / "b", CheckpointError)


# ------------------------------------------------------------------------------------------------------------------
# Damaged tensors
# ------------------------------------------------------------------------------------------------------------------

def copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        return list(f.keys())


def test_damaged_fp8_tensors_are_refused(fp8_variants, tmp_path):
    hf_dir = copy(fp8_variants / "hf", tmp_path / "hf")
    name = "model.layers.0.self_attn.o_proj.weight"  # a dense weight: dequantized, so checked the same way

    def infinite_scale(tensors):
        tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"].clone()
        tensors[name + "_scale_inv"][0, 0] = float("inf")

    edit_tensors(hf_dir, infinite_scale)
    message = error_of(hf_dir, tmp_path / "a", CheckpointError)
    assert name in message and "non-finite scales" in message
    shutil.copyfile(fp8_variants / "hf" / "model.safetensors", hf_dir / "model.safetensors")
    edit_tensors(hf_dir, lambda t: t.update({name: t[name].view(torch.uint8)}))
    message = error_of(hf_dir, tmp_path / "b", UnsupportedModelError)
    assert f"{name} is stored as U8" in message
    # ue8m0 scales as e8m0 bytes (2**(b - 127)), not the float32 powers of two DeepSeek-V3.1 stores
    shutil.copyfile(fp8_variants / "hf" / "model.safetensors", hf_dir / "model.safetensors")
    scale = name + "_scale_inv"
    edit_tensors(hf_dir, lambda t: t.update({scale: (t[scale].log2() + 127).to(torch.uint8)}))
    message = error_of(hf_dir, tmp_path / "c", CheckpointError)
    assert f"{scale} is stored as U8" in message and "F32 or BF16" in message


def test_a_tensor_of_an_unknown_dtype_is_not_dropped(fp8_variants, tmp_path):
    """A tensor in a dtype the exporter does not read is refused by name like any unaccounted tensor, not taken for
    an empty one."""
    hf_dir = copy(fp8_variants / "hf", tmp_path / "hf")
    stray = "model.layers.0.self_attn.o_proj.weight_scale_2"
    edit_tensors(hf_dir, lambda t: t.update({stray: torch.ones(4, dtype=torch.float8_e5m2)}))
    message = error_of(hf_dir, tmp_path / "a", CheckpointError)
    assert "does not account for" in message and stray in message
    edit_tensors(hf_dir, lambda t: t.update({stray: torch.ones(0, dtype=torch.float8_e5m2)}))
    export_model(hf_dir, tmp_path / "b", progress=False)  # no element: holds nothing


@pytest.fixture(scope="module")
def int4_stored(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("int4")
    build_pack_quantized_checkpoint(root / "hf", 32, True)
    return root / "hf"


DAMAGED_INT4 = [
    ("nan-scale", lambda t, w: t[w + "_scale"].__setitem__((0, 0), float("nan")), "non-finite scales"),
    ("inf-scale", lambda t, w: t[w + "_scale"].__setitem__((1, 1), float("-inf")), "non-finite scales"),
    ("i64-codes", lambda t, w: t.update({w + "_packed": t[w + "_packed"].long()}), "_packed is stored as I64"),
    ("u8-codes", lambda t, w: t.update({w + "_packed": t[w + "_packed"].view(torch.uint8)}),
     "_packed is stored as U8"),
    ("scale-shape", lambda t, w: t.update({w + "_scale": t[w + "_scale"][:, :1].clone()}), "_scale has shape"),
    ("g_idx", lambda t, w: t.update({w + "_g_idx": torch.zeros(64, dtype=torch.int32)}), "does not account for"),
]


@pytest.mark.parametrize("edit,words", [d[1:] for d in DAMAGED_INT4], ids=[d[0] for d in DAMAGED_INT4])
def test_damaged_int4_tensors_name_the_tensor(int4_stored, tmp_path, edit, words):
    hf_dir = copy(int4_stored, tmp_path / "hf")
    weight = "model.layers.0.mlp.experts.1.gate_proj.weight"  # [32, 64]: scales [32, 2]
    edit_tensors(hf_dir, lambda tensors: edit(tensors, weight))
    message = error_of(hf_dir, tmp_path / "out", CheckpointError)
    assert weight in message and words in message, message

