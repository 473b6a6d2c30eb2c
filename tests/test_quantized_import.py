"""Importing pre-quantized checkpoints: FP8 block-scaled (DeepSeek-V3 / Qwen3-FP8) and compressed-tensors
pack-quantized int4, built by tests/quantized_checkpoints.py from tiny random Qwen3-MoE models, and gpt-oss's MXFP4
experts, from a tiny random gpt-oss.

What must hold: the routed experts in experts.bin are the checkpoint's own values and scales (fp8: the same bytes;
int4: the same codes, dequantizing to what compressed-tensors decompresses; mxfp4: the same blocks and exponents,
gate from gate_up's even rows and up from its odd ones, dequantizing to what transformers dequantizes), quantized
dense weights are dequantized, and the exported model computes what a float32 transformers model loaded with the
dequantized weights computes: logits within 1e-4 of the largest reference logit (float32 dense export, float32 KV
cache: the weights are the same numbers, only the order of operations differs) and the same 32 greedy tokens. The
MXFP4 export also computes exactly what the export of its dequantized bf16 checkpoint computes (the same float32
weights on the NumPy backend). Everything else in a quantization_config is refused in one line naming what is
imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from colibri_stream.checkpoint import ModelFolder  # noqa: E402
from colibri_stream.errors import CheckpointError, ColibriError, UnsupportedModelError  # noqa: E402
from colibri_stream.expert_codecs import dequantize_expert  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.quantized_sources import quantized_source  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from quantized_checkpoints import (build_fp8_checkpoint, build_mxfp4_checkpoint,  # noqa: E402
                                   build_pack_quantized_checkpoint, compressed_tensors_scheme,
                                   write_dequantized_mxfp4)
from test_parity import (NEW_TOKENS, colibri_greedy, colibri_logits, prompt_ids, reference_greedy,  # noqa: E402
                         reference_logits, relative_error)
from tiny_models import hf_config  # noqa: E402

# hidden 160 and expert width 48: two 128-column tiles, the second partial, and tiles of fewer than 128 rows
FP8_SHAPE = dict(hidden_size=160, moe_intermediate_size=48)
# (group size, symmetric, shape): compressed-tensors needs the group size to divide every quantized matrix's input
INT4_CASES = [(32, True, {}), (64, False, dict(head_dim=32, moe_intermediate_size=64))]


def reference_model(overrides: dict, state: dict[str, torch.Tensor]):
    """A float32 transformers Qwen3-MoE holding the dequantized weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_moe", **overrides), dtype=torch.float32)
    model.load_state_dict(state)
    return model.eval()


def assert_generates_like(reference, out: Path) -> None:
    model = load_model(out, verify=True)
    ids = prompt_ids()
    assert relative_error(colibri_logits(model, ids), reference_logits(reference, ids)) < 1e-4
    assert colibri_greedy(model, ids, NEW_TOKENS) == reference_greedy(reference, ids, NEW_TOKENS)


def expert_weights(layer: int, expert: int) -> dict[str, str]:
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return {part: f"{base}.{part}_proj.weight" for part in ("gate", "up", "down")}


# ------------------------------------------------------------------------------------------------------------------
# FP8 block-scaled
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(folder, dequantized float32 state dict, exported folder with float32 dense weights)."""
    root = tmp_path_factory.mktemp("fp8")
    state = build_fp8_checkpoint(root / "hf", **FP8_SHAPE)
    export_model(root / "hf", root / "out", dtype="fp32", progress=False)
    return root / "hf", state, root / "out"


def test_fp8_experts_keep_the_checkpoints_bytes_and_scales(fp8_checkpoint):
    hf_dir, _, out = fp8_checkpoint
    source = load_file(str(hf_dir / "model.safetensors"))
    folder = ModelFolder(out, verify=True)
    config = folder.config
    assert (config.expert_dtype, config.expert_scales) == ("fp8", "block")
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            ours = folder.experts.tensors(layer, expert)
            for part, name in expert_weights(layer, expert).items():
                values, scale = source[name], source[name + "_scale_inv"]
                rows, cols = values.shape
                assert scale.shape == (-(-rows // 128), -(-cols // 128))
                np.testing.assert_array_equal(ours[part].view(np.uint8), values.view(torch.uint8).numpy())
                np.testing.assert_array_equal(ours[part + "_scale"], scale.numpy())
    folder.experts.close()


def test_fp8_dense_weights_are_dequantized_per_tile(fp8_checkpoint, tmp_path):
    hf_dir, state, out = fp8_checkpoint
    name = "model.layers.1.self_attn.q_proj.weight"  # [96, 160]: tiles of 96 x 128 and 96 x 32
    folder = ModelFolder(out)
    np.testing.assert_array_equal(folder.dense.get("layers.1.q_proj"), state[name].numpy())
    np.testing.assert_array_equal(folder.dense.get("layers.1.router"), state["model.layers.1.mlp.gate.weight"])
    export_model(hf_dir, tmp_path / "bf16", progress=False)  # the default dense dtype
    rounded = state[name].numpy().astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ModelFolder(tmp_path / "bf16").dense.get("layers.1.q_proj"), rounded)


def test_fp8_export_generates_like_the_dequantized_reference(fp8_checkpoint):
    _, state, out = fp8_checkpoint
    assert_generates_like(reference_model(FP8_SHAPE, state), out)


# ------------------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized int4
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=INT4_CASES, ids=["g32-symmetric", "g64-zero-points"])
def int4_checkpoint(request, tmp_path_factory):
    """(group size, symmetric, overrides, folder, decompressed float32 state, stored tensors, exported folder)."""
    pytest.importorskip("compressed_tensors")
    group_size, symmetric, overrides = request.param
    root = tmp_path_factory.mktemp(f"int4_g{group_size}")
    # seed 1: its greedy continuation varies (seed 0's g32 model repeats two tokens)
    state, stored = build_pack_quantized_checkpoint(root / "hf", group_size, symmetric, seed=1, **overrides)
    export_model(root / "hf", root / "out", dtype="fp32", progress=False)
    return group_size, symmetric, overrides, root / "hf", state, stored, root / "out"


def test_int4_experts_are_the_libraries_codes_and_decompress_alike(int4_checkpoint):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    group_size, symmetric, _, _, _, stored, out = int4_checkpoint
    scheme = compressed_tensors_scheme(group_size, symmetric)
    folder = ModelFolder(out, verify=True)
    config = folder.config
    assert (config.expert_dtype, config.expert_group_size, config.expert_zero_point) == ("int4", group_size,
                                                                                       not symmetric)
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            ours = folder.experts.tensors(layer, expert)
            dequantized = dequantize_expert(ours)
            for part, name in expert_weights(layer, expert).items():
                base = name[: -len("weight")]
                module = {key[len(base):]: value for key, value in stored.items() if key.startswith(base)}
                shape = tuple(module["weight_shape"].tolist())
                signed = unpack_from_int32(module["weight_packed"], 4, torch.Size(shape)).numpy()  # [out, in]
                codes = np.stack([ours[part] & 15, ours[part] >> 4], axis=-1).reshape(shape)
                np.testing.assert_array_equal(codes, signed + 8)
                # the library's decompression with the scales as stored (bf16): ours rounded the same way
                library = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
                assert library.dtype == torch.bfloat16
                np.testing.assert_array_equal(dequantized[part].astype(ml_dtypes.bfloat16),
                                              library.view(torch.uint16).numpy().view(ml_dtypes.bfloat16))
    folder.experts.close()


def test_int4_dense_weights_are_decompressed(int4_checkpoint):
    *_, state, _, out = int4_checkpoint
    folder = ModelFolder(out)
    for ours, theirs in (("layers.0.o_proj", "model.layers.0.self_attn.o_proj.weight"),
                         ("layers.2.k_proj", "model.layers.2.self_attn.k_proj.weight")):
        np.testing.assert_array_equal(folder.dense.get(ours), state[theirs].numpy())


def test_int4_export_generates_like_the_decompressed_reference(int4_checkpoint):
    _, _, overrides, _, state, _, out = int4_checkpoint
    assert_generates_like(reference_model(overrides, state), out)


# ------------------------------------------------------------------------------------------------------------------
# gpt-oss MXFP4
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """(root, stored tensors, transformers' dequantized float32 state): root holds the MXFP4 checkpoint `hf`, its
    dequantized bf16 checkpoint `bf16`, and their float32-dense exports `out` and `ref`."""
    root = tmp_path_factory.mktemp("mxfp4")
    stored = build_mxfp4_checkpoint(root / "hf", seed=2)
    state = write_dequantized_mxfp4(stored, root / "hf", root / "bf16")
    export_model(root / "hf", root / "out", dtype="fp32", progress=False)
    export_model(root / "bf16", root / "ref", dtype="fp32", progress=False)
    return root, stored, state


def test_mxfp4_experts_keep_the_checkpoints_blocks_and_scales(mxfp4_checkpoint):
    root, stored, state = mxfp4_checkpoint
    folder = ModelFolder(root / "out", verify=True)
    config = folder.config
    assert config.expert_dtype == "mxfp4" and config.expert_bias
    for layer in config.moe_layers:
        base = f"model.layers.{layer}.mlp.experts."
        gate_up = (stored[base + "gate_up_proj_blocks"].numpy(), stored[base + "gate_up_proj_scales"].numpy())
        down = (stored[base + "down_proj_blocks"].numpy(), stored[base + "down_proj_scales"].numpy())
        gate_up_bias, down_bias = (stored[base + name].float().numpy() for name in ("gate_up_proj_bias",
                                                                                   "down_proj_bias"))
        for expert in range(config.num_experts):
            ours = folder.experts.tensors(layer, expert)
            for part, (blocks, scales), rows in (("gate", gate_up, slice(0, None, 2)),
                                                 ("up", gate_up, slice(1, None, 2)), ("down", down, slice(None))):
                np.testing.assert_array_equal(ours[part], blocks[expert, rows])
                np.testing.assert_array_equal(ours[part + "_scale"], scales[expert, rows])
            weights = dequantize_expert(ours)
            fused = state[base + "gate_up_proj"][expert].numpy()  # [H, 2I], as transformers dequantizes it
            np.testing.assert_array_equal(weights["gate"], fused[:, 0::2].T)
            np.testing.assert_array_equal(weights["up"], fused[:, 1::2].T)
            np.testing.assert_array_equal(weights["down"], state[base + "down_proj"][expert].numpy().T)
            np.testing.assert_array_equal(weights["gate_bias"], gate_up_bias[expert, 0::2])
            np.testing.assert_array_equal(weights["up_bias"], gate_up_bias[expert, 1::2])
            np.testing.assert_array_equal(weights["down_bias"], down_bias[expert])
    folder.experts.close()


def test_mxfp4_export_computes_what_its_dequantized_checkpoint_does(mxfp4_checkpoint):
    import transformers

    root, _, _ = mxfp4_checkpoint
    model, dequantized = load_model(root / "out", verify=True), load_model(root / "ref")
    assert dequantized.config.expert_dtype == "float32"
    ids = prompt_ids()
    logits = colibri_logits(model, ids)
    np.testing.assert_array_equal(logits, colibri_logits(dequantized, ids))  # the same float32 weights
    assert colibri_greedy(model, ids, NEW_TOKENS) == colibri_greedy(dequantized, ids, NEW_TOKENS)
    reference = transformers.AutoModelForCausalLM.from_pretrained(root / "bf16", dtype=torch.float32).eval()
    assert relative_error(logits, reference_logits(reference, ids)) < 1e-4


def test_mxfp4_experts_dequantized_at_export_compute_what_the_kept_ones_do(mxfp4_checkpoint, tmp_path):
    """--dequantize stores the checkpoint's experts as the values its MXFP4 codes stand for (exactly: e2m1 times a
    power of two is a bf16 and a float32), or re-quantizes them; a checkpoint that is not quantized refuses it."""
    root, _, _ = mxfp4_checkpoint
    kept = load_model(root / "out")
    ids = prompt_ids()
    for dtype, expert_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        config = export_model(root / "hf", tmp_path / dtype, dtype=dtype, dequantize=True, progress=False)
        assert config.expert_dtype == expert_dtype and config.expert_bias
        folders = ModelFolder(tmp_path / dtype, verify=True), ModelFolder(root / "out")
        for layer in config.moe_layers:
            ours, theirs = (dequantize_expert(f.experts.tensors(layer, 1)) for f in folders)
            for name in ("gate", "up", "down", "gate_bias", "down_bias"):
                np.testing.assert_array_equal(ours[name].astype(np.float32), theirs[name].astype(np.float32))
        for folder in folders:
            folder.experts.close()
    np.testing.assert_array_equal(colibri_logits(load_model(tmp_path / "fp32"), ids), colibri_logits(kept, ids))
    requantized = export_model(root / "hf", tmp_path / "int8", dtype="fp32", quantize="int8", dequantize=True,
                               progress=False)
    assert requantized.expert_dtype == "int8"
    assert "or with --dequantize" in error_of(root / "hf", tmp_path / "refused", quantize="int8")
    assert "--dequantize is an option of pre-quantized checkpoints" in error_of(root / "bf16", tmp_path / "plain",
                                                                                dequantize=True)


@pytest.fixture
def mxfp4_copy(mxfp4_checkpoint, tmp_path):
    shutil.copytree(mxfp4_checkpoint[0] / "hf", tmp_path / "hf")
    return tmp_path / "hf"


def test_damaged_mxfp4_checkpoints_name_the_tensor(mxfp4_checkpoint, mxfp4_copy, tmp_path):
    stored = mxfp4_checkpoint[1]
    name = "model.layers.1.mlp.experts.gate_up_proj"  # blocks [8, 64, 2, 16], scales [8, 64, 2]

    def nan_scale(tensors):
        scales = stored[name + "_scales"].clone()
        scales[3, 5, 1] = 255  # e8m0's NaN, in expert 3's up
        tensors[name + "_scales"] = scales

    edit_tensors(mxfp4_copy, nan_scale)
    message = error_of(mxfp4_copy, tmp_path / "a", CheckpointError)
    assert f"{name}_scales[3]" in message and "255" in message and "corrupt" in message
    edit_tensors(mxfp4_copy, lambda t: t.update({name + "_scales": stored[name + "_scales"][..., :1].clone()}))
    message = error_of(mxfp4_copy, tmp_path / "b", CheckpointError)
    assert f"{name}_scales has shape [8, 64, 1]" in message and "[8, 64, 2]" in message
    edit_tensors(mxfp4_copy, lambda t: t.update({name + "_scales": stored[name + "_scales"].to(torch.int8)}))
    message = error_of(mxfp4_copy, tmp_path / "c", CheckpointError)
    assert f"{name}_scales is stored as I8" in message and "U8" in message
    edit_tensors(mxfp4_copy, lambda t: t.update({name + "_scales": stored[name + "_scales"],
                                                 name + "_blocks": stored[name + "_blocks"][..., :8].clone()}))
    message = error_of(mxfp4_copy, tmp_path / "d", CheckpointError)
    assert f"{name}_blocks has shape [8, 64, 2, 8]" in message and "[8, 64, 2, 16]" in message
    edit_tensors(mxfp4_copy, lambda t: (t.update({name + "_blocks": stored[name + "_blocks"]}),
                                        t.pop(name + "_scales")))
    assert f"{name}_scales is missing" in error_of(mxfp4_copy, tmp_path / "e", CheckpointError)
    edit_tensors(mxfp4_copy, lambda t: t.update({name + "_scales": stored[name + "_scales"]}))
    export_model(mxfp4_copy, tmp_path / "f", progress=False)  # whole again: exports


def test_mxfp4_stacks_in_the_fused_layout_are_read_by_rows(tmp_path):
    stored = build_mxfp4_checkpoint(tmp_path / "hf", arch="qwen3_moe")  # gate_up [E, 2I, H]: gate the first I rows
    export_model(tmp_path / "hf", tmp_path / "out", progress=False)
    folder = ModelFolder(tmp_path / "out", verify=True)
    inter = folder.config.moe_intermediate_size
    for layer in folder.config.moe_layers:
        base = f"model.layers.{layer}.mlp.experts."
        for expert in range(folder.config.num_experts):
            ours = folder.experts.tensors(layer, expert)
            for part, stack, rows in (("gate", "gate_up_proj", slice(0, inter)),
                                      ("up", "gate_up_proj", slice(inter, None)), ("down", "down_proj", slice(None))):
                np.testing.assert_array_equal(ours[part], stored[base + stack + "_blocks"][expert, rows].numpy())
                np.testing.assert_array_equal(ours[part + "_scale"],
                                              stored[base + stack + "_scales"][expert, rows].numpy())
    folder.experts.close()


def test_an_mxfp4_dense_weight_is_dequantized(mxfp4_copy, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    name = "model.layers.0.self_attn.o_proj.weight"  # [64, 64]: stored as blocks [64, 2, 16], scales [64, 2]
    rng = np.random.default_rng(0)
    blocks = torch.from_numpy(rng.integers(0, 256, (64, 2, 16), np.uint8))
    scales = torch.from_numpy(rng.integers(120, 124, (64, 2), np.uint8))
    edit_tensors(mxfp4_copy, lambda t: (t.pop(name), t.update({name + "_blocks": blocks, name + "_scales": scales})))
    export_model(mxfp4_copy, tmp_path / "out", dtype="fp32", progress=False)
    expected = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T  # [out, in]
    np.testing.assert_array_equal(ModelFolder(tmp_path / "out").dense.get("layers.0.o_proj"), expected.numpy())


def test_unknown_mxfp4_options_are_refused(mxfp4_copy, tmp_path):
    config_path = mxfp4_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["group_size"] = 32
    config_path.write_text(json.dumps(config))
    message = error_of(mxfp4_copy, tmp_path / "a", UnsupportedModelError)
    assert "quantization_config group_size 32 is not supported" in message and "mxfp4" in message
    del config["quantization_config"]["group_size"]
    config_path.write_text(json.dumps(config))
    message = error_of(mxfp4_copy, tmp_path / "b", quantize="int4")
    assert "already quantized" in message and "MXFP4" in message


# ------------------------------------------------------------------------------------------------------------------
# Refusals and damaged checkpoints
# ------------------------------------------------------------------------------------------------------------------

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PACKED = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}


def packed(**weights) -> dict:
    group = dict(PACKED["config_groups"]["group_0"], weights=dict(PACKED["config_groups"]["group_0"]["weights"],
                                                                  **weights))
    return dict(PACKED, config_groups={"group_0": group})


REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4", "block_size": 16}, "block_size 16"),
    (dict(FP8, weight_block_size=[64, 64]), "weight_block_size [64, 64]"),
    (dict(FP8, activation_scheme="static"), "activation_scheme 'static'"),
    (dict(FP8, fmt="e5m2"), "fmt 'e5m2'"),
    (dict(PACKED, format="float-quantized"), "format 'float-quantized'"),
    (dict(PACKED, format="naive-quantized"), "format 'naive-quantized'"),
    (dict(PACKED, quantization_status="frozen"), "quantization_status 'frozen'"),
    (packed(group_size=16), "group_size 16"),
    (packed(num_bits=8), "num_bits 8"),
    (packed(strategy="channel", group_size=None), "strategy 'channel'"),
    (packed(actorder="group"), "actorder 'group'"),
    (dict(PACKED, config_groups={"group_0": dict(PACKED["config_groups"]["group_0"], input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})}), "input_activations"),
]


@pytest.mark.parametrize("quantization,words", REFUSED, ids=[w for _, w in REFUSED])
def test_other_quantization_configs_are_refused_in_one_line(quantization, words):
    with pytest.raises(UnsupportedModelError) as info:
        quantized_source({"quantization_config": quantization})
    message = str(info.value)
    assert "\n" not in message and words in message and "Colibri imports" in message, message


def test_supported_configs_are_read():
    assert quantized_source({}) is None
    assert quantized_source({"quantization_config": dict(FP8, modules_to_not_convert=["lm_head"])}).codec.name == "fp8"
    # MiniMax-M2's FP8 release names the format by its torch dtype
    assert quantized_source({"quantization_config": dict(FP8, fmt="float8_e4m3fn")}).codec.name == "fp8"
    source = quantized_source({"quantization_config": packed(symmetric=False, group_size=64, actorder="weight")})
    assert source.expert_format() == dict(expert_dtype="int4", expert_group_size=64, expert_zero_point=True)
    source = quantized_source({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}})
    assert source.expert_format() == dict(expert_dtype="mxfp4") and source.codec.name == "mxfp4"


def error_of(hf_dir: Path, out: Path, kind=ColibriError, **kwargs) -> str:
    with pytest.raises(kind) as info:
        export_model(hf_dir, out, progress=False, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    assert not (out / "config.json").exists()
    return message


@pytest.fixture
def fp8_copy(fp8_checkpoint, tmp_path):
    shutil.copytree(fp8_checkpoint[0], tmp_path / "hf")
    return tmp_path / "hf"


def edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_a_quantized_checkpoint_is_not_quantized_again(fp8_copy, tmp_path):
    message = error_of(fp8_copy, tmp_path / "a", quantize="int4")
    assert "already quantized" in message and "fp8" in message


def test_damaged_fp8_checkpoints_name_the_tensor(fp8_copy, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [160, 48]: scales [2, 1]
    edit_tensors(fp8_copy, lambda t: t.update({name + "_scale_inv": torch.ones(1, 1)}))
    message = error_of(fp8_copy, tmp_path / "a", CheckpointError)
    assert name + "_scale_inv" in message and "[1, 1]" in message and "[2, 1]" in message
    edit_tensors(fp8_copy, lambda t: t.pop(name + "_scale_inv"))
    assert f"{name}_scale_inv is missing" in error_of(fp8_copy, tmp_path / "b", CheckpointError)

    def nan_value(tensors):
        tensors[name + "_scale_inv"] = torch.ones(2, 1)
        values = tensors[name].view(torch.uint8).clone()
        values[0, 0] = 0x7F  # e4m3fn's NaN
        tensors[name] = values.view(torch.float8_e4m3fn)

    edit_tensors(fp8_copy, nan_value)
    message = error_of(fp8_copy, tmp_path / "c", CheckpointError)
    assert name in message and "NaN" in message

    def plain_expert(tensors):
        tensors.pop(name + "_scale_inv")
        tensors[name] = torch.zeros(160, 48, dtype=torch.bfloat16)

    edit_tensors(fp8_copy, plain_expert)
    message = error_of(fp8_copy, tmp_path / "d", UnsupportedModelError)
    assert "1 routed expert matrices unquantized" in message and name in message


def test_mislabelled_int4_checkpoints_are_refused(tmp_path):
    pytest.importorskip("compressed_tensors")
    build_pack_quantized_checkpoint(tmp_path / "hf", 32, True)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    config_path.write_text(json.dumps(config))
    message = error_of(tmp_path / "hf", tmp_path / "a", CheckpointError)
    assert "model.layers.0.self_attn" in message
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    config_path.write_text(json.dumps(config))
    name = "model.layers.2.mlp.experts.7.up_proj.weight_shape"
    edit_tensors(tmp_path / "hf", lambda t: t.update({name: torch.tensor([32, 32])}))
    message = error_of(tmp_path / "hf", tmp_path / "b", CheckpointError)
    assert name in message and "[32, 32]" in message and "[32, 64]" in message
