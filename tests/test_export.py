"""The exporter: config translation, exact tensor round trips, input layouts, and one-line errors for what it refuses.

Ground truth is the transformers model in memory (float32), whose experts are the fused [E, 2I, H] / [E, H, I]
parameters, so the per-expert files that save_pretrained writes are checked against an independent layout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import load_file, save_file  # noqa: E402

from colibri_stream.checkpoint import ModelFolder  # noqa: E402
from colibri_stream.config import RopeConfig  # noqa: E402
from colibri_stream.errors import CheckpointError, ColibriError, UnsupportedModelError  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.architectures import translate_config  # noqa: E402
from colibri_stream.loader import load_model
from test_parity import colibri_logits, prompt_ids, reference_logits, relative_error
from tiny_models import ALL_ARCHITECTURES, build_hf_model  # noqa: E402

# Our per-layer dense tensor name -> the transformers parameter name (under model.layers.{l}.); a tuple: the name
# differs between families.
HF_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "router": "mlp.gate.weight",
    "q_a_proj": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b_proj": "self_attn.q_b_proj.weight", "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b_proj": "self_attn.kv_b_proj.weight",
    "score_correction_bias": ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
    "shared_expert.gate_proj": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
    "shared_expert.up_proj": ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_expert.down_proj": ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
    "shared_expert_gate": "mlp.shared_expert_gate.weight", "mlp.gate_proj": "mlp.gate_proj.weight",
    "mlp.up_proj": "mlp.up_proj.weight", "mlp.down_proj": "mlp.down_proj.weight",
}
HF_GLOBAL_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                   "lm_head": "lm_head.weight"}

COMMON = dict(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=512,
              sliding_windows=(None, None, None), tie_word_embeddings=False)
_DEEPSEEK_V3 = dict(head_dim=20, num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(1, 2),
                    intermediate_size=96, norm_topk_prob=True, qk_norm="none", qkv_bias=False, o_bias=False,
                    shared_expert_intermediate_size=32, shared_expert_gate=False, rope=RopeConfig(theta=1e4),
                    router_scoring="sigmoid", score_correction_bias=True, n_group=2, topk_group=1,
                    routed_scaling_factor=2.5, attention="mla", rotary_dim=8, q_lora_rank=24, kv_lora_rank=16,
                    v_head_dim=20, rope_interleave=True, num_kv_heads=4, softmax_scale=20**-0.5)
EXPECTED = {
    "mixtral": dict(head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=48, moe_layers=(0, 1, 2),
                    intermediate_size=0, norm_topk_prob=True, qk_norm="none", qkv_bias=False, o_bias=False,
                    shared_expert_intermediate_size=0, rope=RopeConfig(theta=1e6)),
    "qwen2_moe": dict(head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(0, 2),
                      intermediate_size=96, norm_topk_prob=False, qk_norm="none", qkv_bias=True, o_bias=False,
                      shared_expert_intermediate_size=40, shared_expert_gate=True, rope=RopeConfig(theta=1e4)),
    "qwen3_moe": dict(head_dim=24, num_experts=8, top_k=3, moe_intermediate_size=32, moe_layers=(0, 1, 2),
                      intermediate_size=0, norm_topk_prob=True, qk_norm="per_head", qkv_bias=False, o_bias=False,
                      shared_expert_intermediate_size=0, rope=RopeConfig(theta=1e4)),
    "olmoe": dict(head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(0, 1, 2),
                  intermediate_size=0, norm_topk_prob=False, qk_norm="full", qkv_bias=False, o_bias=False,
                  clip_qkv=None, shared_expert_intermediate_size=0, rope=RopeConfig(theta=1e4)),
    "glm4_moe": dict(head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(1, 2),
                     intermediate_size=96, norm_topk_prob=True, qk_norm="per_head", qkv_bias=True, o_bias=False,
                     shared_expert_intermediate_size=32, shared_expert_gate=False, rope=RopeConfig(theta=1e4),
                     router_scoring="sigmoid", score_correction_bias=True, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, rotary_dim=8),
    "minimax_m2": dict(head_dim=24, num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(0, 1, 2),
                       intermediate_size=0, norm_topk_prob=True, qk_norm="full", qkv_bias=False, o_bias=False,
                       shared_expert_intermediate_size=0, rope=RopeConfig(theta=5e6), router_scoring="sigmoid",
                       score_correction_bias=True, n_group=1, routed_scaling_factor=1.0, rotary_dim=12),
    "deepseek_v3": _DEEPSEEK_V3,
    # DeepSeek-V2-Lite's options: softmax routing, scaled, not renormalised, no q LoRA, a wider shared expert
    "deepseek_v2": dict(_DEEPSEEK_V3, norm_topk_prob=False, shared_expert_intermediate_size=64,
                        router_scoring="softmax", score_correction_bias=False, n_group=1, routed_scaling_factor=1.5,
                        q_lora_rank=0),
    # GLM-4.7-Flash: DeepSeek-V3's computation without a q LoRA, MoE layers named by mlp_layer_types
    "glm4_moe_lite": dict(_DEEPSEEK_V3, moe_layers=(0, 2), routed_scaling_factor=1.8, q_lora_rank=0),
}
STORAGE = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}


@pytest.fixture(scope="module", params=ALL_ARCHITECTURES)
def hf_tiny(request, tmp_path_factory):
    """(arch, folder written by save_pretrained, {name: float32 array} of the model in memory)."""
    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    model = build_hf_model(request.param, folder)
    return request.param, folder, {k: v.numpy().copy() for k, v in model.state_dict().items()}


def hf_dense(state: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name in HF_GLOBAL_NAMES:
        return state[HF_GLOBAL_NAMES[name]]
    _, layer, part = name.split(".", 2)
    names = HF_LAYER_NAMES[part] if isinstance(HF_LAYER_NAMES[part], tuple) else (HF_LAYER_NAMES[part],)
    return next(state[f"model.layers.{layer}.{n}"] for n in names if f"model.layers.{layer}.{n}" in state)


def hf_expert(state: dict[str, np.ndarray], layer: int, expert: int, size: int) -> dict[str, np.ndarray]:
    gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert]  # [2I, H]
    return {"gate": gate_up[:size], "up": gate_up[size:], "down": state[f"model.layers.{layer}.mlp.experts.down_proj"][
        expert]}


def rounded(array: np.ndarray, dtype: str) -> np.ndarray:
    return array.astype(STORAGE[dtype]).astype(np.float32)


@pytest.mark.parametrize("dtype,quantize", [("fp32", None), ("bf16", None), ("fp16", None), ("bf16", "int8")])
def test_export_translates_config_and_round_trips_every_tensor(hf_tiny, dtype, quantize, tmp_path):
    arch, hf_dir, state = hf_tiny
    config = export_model(hf_dir, tmp_path / "out", dtype=dtype, quantize=quantize, progress=False)
    storage = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    expected = dict(COMMON, **EXPECTED[arch], architecture=arch, dtype=storage,
                    expert_dtype="int8" if quantize else storage)
    assert {k: getattr(config, k) for k in expected} == expected

    folder = ModelFolder(tmp_path / "out", verify=True)
    assert folder.config == config
    assert (tmp_path / "out" / "generation_config.json").is_file()
    for name in folder.dense.names:
        ours = folder.dense.get(name).astype(np.float32)
        stored = "fp32" if name.endswith("score_correction_bias") else dtype  # router biases stay float32
        np.testing.assert_array_equal(ours, rounded(hf_dense(state, name), stored), err_msg=name)
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            ours = folder.experts.tensors(layer, expert)
            for part, weight in hf_expert(state, layer, expert, config.moe_intermediate_size).items():
                if not quantize:
                    np.testing.assert_array_equal(ours[part].astype(np.float32), rounded(weight, dtype))
                    continue
                q, scale = ours[part], ours[part + "_scale"]  # [rows, cols] int8, [rows] float32
                np.testing.assert_allclose(scale, np.abs(weight).max(axis=1) / 127, rtol=1e-6)
                error = np.abs(q.astype(np.float32) * scale[:, None] - weight)
                assert np.all(error <= scale[:, None] * (0.5 + 1e-5)), (layer, expert, part)
    folder.experts.close()


def test_sharded_input_gives_the_same_files_as_a_single_file(tmp_path):
    build_hf_model("qwen2_moe", tmp_path / "single", seed=4)
    build_hf_model("qwen2_moe", tmp_path / "sharded", seed=4, max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    for name in ("single", "sharded"):
        export_model(tmp_path / name, tmp_path / f"out_{name}", quantize="int8", progress=False)
    for file in ("config.json", "dense.safetensors", "experts.bin"):
        assert (tmp_path / "out_single" / file).read_bytes() == (tmp_path / "out_sharded" / file).read_bytes(), file


HALF_CHECKPOINTS = [("qwen3_moe", torch.bfloat16, "torch_dtype", None), ("glm4_moe", torch.float16, "dtype", None),
                    ("deepseek_v3", torch.bfloat16, "dtype", "200KB"), ("mixtral", torch.float16, "torch_dtype", None)]


@pytest.mark.parametrize("arch,dtype,key,shard", HALF_CHECKPOINTS,
                         ids=[f"{a}-{str(d).split('.')[1]}-{k}-{'sharded' if s else 'single'}"
                              for a, d, k, s in HALF_CHECKPOINTS])
def test_half_precision_checkpoints_export_what_transformers_loads(arch, dtype, key, shard, tmp_path):
    """bf16 and fp16 checkpoints (one file or shards) as transformers saves them: each tensor's dtype is read from
    its safetensors header, so config.json's dtype key (`dtype` since transformers 5, `torch_dtype` before) and its
    value change nothing. A float32 export holds the stored values widened: transformers' float32 logits of the same
    checkpoint."""
    import transformers

    hf_model = build_hf_model(arch, tmp_path / "hf32", seed=6).to(dtype)
    hf_model.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    raw[key] = "float32"  # a stale value: the headers decide
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == bool(shard)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = prompt_ids(seed=7)
    assert relative_error(colibri_logits(load_model(tmp_path / "model"), ids), reference_logits(reference, ids)) < 1e-4


def test_fused_expert_layout_exports_the_same_experts(hf_tiny, tmp_path):
    arch, hf_dir, state = hf_tiny
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(hf_dir / "config.json", fused / "config.json")
    save_file(state, str(fused / "model.safetensors"))  # the transformers-5 in-memory names and layout
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    for name in ("per_expert", "fused"):
        export_model(hf_dir if name == "per_expert" else fused, tmp_path / f"out_{name}", dtype="bf16",
                     progress=False)
    for file in ("dense.safetensors", "experts.bin"):
        assert (tmp_path / "out_per_expert" / file).read_bytes() == (tmp_path / "out_fused" / file).read_bytes()


def test_tied_embeddings_write_no_lm_head(tmp_path):
    build_hf_model("mixtral", tmp_path / "hf", tie_word_embeddings=True)
    config = export_model(tmp_path / "hf", tmp_path / "out", progress=False)
    assert config.tie_word_embeddings
    assert "lm_head" not in ModelFolder(tmp_path / "out").dense.names


def test_tied_config_with_a_different_lm_head_is_exported_untied(tmp_path):
    """transformers ties only when lm_head.weight is absent or equal to the embeddings; else it loads it as is."""
    import transformers

    build_hf_model("mixtral", tmp_path / "hf", tie_word_embeddings=True)
    embed = load_file(str(tmp_path / "hf" / "model.safetensors"))["model.embed_tokens.weight"]
    edit_weights(tmp_path / "hf", lambda t: t.update({"lm_head.weight": embed.copy()}))  # as torch .bin files hold
    assert export_model(tmp_path / "hf", tmp_path / "equal", dtype="fp32", progress=False).tie_word_embeddings
    head = np.random.default_rng(0).normal(0, 0.08, embed.shape).astype(np.float32)
    edit_weights(tmp_path / "hf", lambda t: t.update({"lm_head.weight": head}))
    config = export_model(tmp_path / "hf", tmp_path / "out", dtype="fp32", progress=False)
    assert not config.tie_word_embeddings
    np.testing.assert_array_equal(ModelFolder(tmp_path / "out").dense.get("lm_head"), head)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = prompt_ids()
    ours = colibri_logits(load_model(tmp_path / "out"), ids)
    assert relative_error(ours, reference_logits(reference, ids)) < 1e-4


# ------------------------------------------------------------------------------------------------------------------
# Config translation (no weights needed)
# ------------------------------------------------------------------------------------------------------------------

def raw_config(arch: str, **changes) -> dict:
    from tiny_models import hf_config

    raw = hf_config(arch).to_dict()
    raw.update(changes)
    return {k: v for k, v in raw.items() if v != "<drop>"}


def translate(raw: dict, generation: dict | None = None, names=()):
    return translate_config(raw, generation or {}, set(names), "bfloat16", "bfloat16")


def test_legacy_v4_rope_keys_and_yarn_defaults():
    raw = raw_config("qwen3_moe", rope_parameters="<drop>", rope_theta=1e6,
                     rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16})
    rope = translate(raw).rope
    assert (rope.type, rope.theta, rope.factor, rope.beta_fast) == ("yarn", 1e6, 4.0, 16.0)
    assert rope.original_max_position_embeddings == 512  # transformers' default: max_position_embeddings
    raw = raw_config("mixtral", rope_parameters="<drop>")
    assert translate(raw).rope == RopeConfig(theta=1e6)  # MixtralConfig.default_theta
    raw = raw_config("olmoe", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                     original_max_position_embeddings=64)
    rope = translate(raw).rope
    assert (rope.type, rope.original_max_position_embeddings, rope.high_freq_factor) == ("llama3", 64, 4.0)


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES + ("gpt_oss",))
def test_rope_theta_left_out_is_the_config_class_default(arch):
    """A rope_scaling without rope_theta, and none at the top level: transformers takes its config class's
    default_theta (150000 for gpt-oss, 5e6 for MiniMax-M2, 1e6 for Mixtral, 1e4 for the others)."""
    from tiny_models import hf_config

    raw = raw_config(arch, rope_parameters="<drop>", rope_theta="<drop>",
                     rope_scaling={"rope_type": "linear", "factor": 2.0})
    rope = translate(raw).rope
    reference = type(hf_config(arch)).from_dict(raw).rope_parameters  # (fills in raw's rope_scaling in place)
    assert (rope.type, rope.theta, rope.factor) == ("linear", reference["rope_theta"], 2.0)


def test_sliding_windows_per_architecture():
    assert translate(raw_config("mixtral", sliding_window=16)).sliding_windows == (16, 16, 16)
    assert translate(raw_config("qwen3_moe", sliding_window=16)).sliding_windows == (None,) * 3
    assert translate(raw_config("qwen3_moe", sliding_window=16, use_sliding_window=True)).sliding_windows == (16,) * 3
    # Qwen2-MoE without layer_types: computed the way Qwen2MoeConfig does (even layers below max_window_layers).
    raw = raw_config("qwen2_moe", layer_types="<drop>", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert translate(raw).sliding_windows == (8, None, None)
    raw = raw_config("qwen2_moe", use_sliding_window=True, sliding_window=8,
                     layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    assert translate(raw).sliding_windows == (None, 8, 8)


def test_qwen_layer_options_and_legacy_keys():
    raw = raw_config("qwen2_moe", qkv_bias="<drop>", mlp_only_layers=[0], decoder_sparse_step=2,
                     num_hidden_layers=4, layer_types="<drop>", head_dim=None)
    config = translate(raw, names={"model.layers.0.self_attn.q_proj.bias"})
    assert config.moe_layers == (1, 3) and config.qkv_bias and config.head_dim == 16
    assert not translate(raw).qkv_bias  # a legacy config without the key: the weights decide
    config = translate(raw_config("qwen3_moe", attention_bias=True))
    assert config.qkv_bias and config.o_bias
    config = translate(raw_config("olmoe", clip_qkv=8, attention_bias=True, norm_topk_prob=True))
    assert (config.clip_qkv, config.qkv_bias, config.o_bias, config.norm_topk_prob) == (8.0, True, True, True)


def test_special_tokens_from_generation_config():
    config = translate(raw_config("qwen3_moe"), {"eos_token_id": [7, 2], "bos_token_id": 5})
    assert (config.eos_token_ids, config.bos_token_id, config.pad_token_id) == ((7, 2), 5, 0)
    assert translate(raw_config("qwen3_moe", eos_token_id=[3, 4])).eos_token_ids == (3, 4)
    with pytest.raises(CheckpointError, match=r"^generation_config.json: eos_token_id must be an integer .* '2'$"):
        translate(raw_config("qwen3_moe"), {"eos_token_id": "2"})


@pytest.mark.parametrize("arch,changes,words", [
    ("mixtral", dict(model_type="llama"), ["llama", "mixtral, qwen2_moe, qwen3_moe, olmoe"]),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), ["dynamic"]),
    ("qwen2_moe", dict(rope_parameters="<drop>", rope_scaling={"type": "longrope", "factor": 2.0}), ["longrope"]),
    ("mixtral", dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    ("olmoe", dict(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     ["partial_rotary_factor"]),
    ("mixtral", dict(per_layer_config={"0": {}}), ["per_layer_config"]),
    ("qwen2_moe", dict(use_sliding_window=False,
                       layer_types=["sliding_attention", "full_attention", "full_attention"]), ["layer 0"]),
    ("olmoe", dict(head_dim=32), ["head_dim"]),
    ("mixtral", dict(sliding_window=0), ["sliding_window"]),
])
def test_refused_options_raise_one_clear_line(arch, changes, words):
    with pytest.raises(UnsupportedModelError) as info:
        translate(raw_config(arch, **changes))
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


# ------------------------------------------------------------------------------------------------------------------
# Bad inputs and the output folder
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def hf_copy(tmp_path):
    """A tiny qwen2_moe checkpoint that the test may damage."""
    build_hf_model("qwen2_moe", tmp_path / "hf")
    return tmp_path / "hf"


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def error_of(hf_dir: Path, out: Path, kind=ColibriError, **kwargs) -> str:
    with pytest.raises(kind) as info:
        export_model(hf_dir, out, progress=False, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_weight_problems_name_the_tensor(hf_copy, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    edit_weights(hf_copy, lambda t: t.pop(name))
    assert name in error_of(hf_copy, tmp_path / "a", CheckpointError)
    edit_weights(hf_copy, lambda t: t.update({name: np.zeros((32, 60), np.float32)}))
    message = error_of(hf_copy, tmp_path / "b", CheckpointError)
    assert name in message and "[32, 60]" in message and "[32, 64]" in message
    edit_weights(hf_copy, lambda t: t.update({name: np.zeros((32, 64), np.float32),
                                              "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}))
    assert "model.layers.0.self_attn.o_proj.bias" in error_of(hf_copy, tmp_path / "c", CheckpointError)

    def int8_expert(tensors):
        del tensors["model.layers.0.self_attn.o_proj.bias"]
        tensors[name] = np.zeros((32, 64), np.int8)

    edit_weights(hf_copy, int8_expert)
    message = error_of(hf_copy, tmp_path / "d", UnsupportedModelError)
    assert name in message and "I8" in message


def test_missing_or_pickle_weights_and_bad_arguments(hf_copy, tmp_path):
    (hf_copy / "model.safetensors").rename(hf_copy / "pytorch_model.bin")
    assert "safetensors" in error_of(hf_copy, tmp_path / "a", UnsupportedModelError)
    (hf_copy / "pytorch_model.bin").unlink()
    assert "model.safetensors" in error_of(hf_copy, tmp_path / "b", CheckpointError)
    (hf_copy / "config.json").write_text("{not json")
    assert "not valid JSON" in error_of(hf_copy, tmp_path / "c", CheckpointError)
    assert "dtype" in error_of(hf_copy, tmp_path / "d", dtype="int4")
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in error_of(tmp_path / "empty", tmp_path / "e", CheckpointError)


def test_output_folder_rules(hf_copy, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_model(hf_copy, out, progress=False)
    assert "not empty" in error_of(hf_copy, out, CheckpointError)
    assert "must not be" in error_of(hf_copy, hf_copy, CheckpointError, force=True)
    (out / "chat_template.jinja").write_text("a stale template from another model")
    export_model(hf_copy, out, dtype="fp32", force=True, progress=False)
    assert not (out / "chat_template.jinja").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    def fail(*args):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("colibri_stream.expert_codecs.Int8Codec.quantize", fail)
    with pytest.raises(RuntimeError):
        export_model(hf_copy, out, quantize="int8", force=True, progress=False)
    assert not (out / "config.json").exists() and not (out / "experts.bin").exists()
    with pytest.raises(RuntimeError):
        export_model(hf_copy, tmp_path / "fresh", quantize="int8", progress=False)
    assert not (tmp_path / "fresh").exists()


# ------------------------------------------------------------------------------------------------------------------
# Hostile or broken checkpoints: one line naming the key, file or tensor, and exit status 1 from the CLI
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,changes,words", [
    ("qwen3_moe", dict(norm_topk_prob="false"), ["norm_topk_prob", "true or false", "'false'"]),
    ("mixtral", dict(tie_word_embeddings="false"), ["tie_word_embeddings"]),
    ("olmoe", dict(attention_bias=0), ["attention_bias"]),
    ("qwen3_moe", dict(use_sliding_window="no"), ["use_sliding_window"]),
    ("qwen2_moe", dict(qkv_bias="true"), ["qkv_bias"]),
    ("qwen3_moe", dict(hidden_size="<drop>", num_experts_per_tok="<drop>"),
     ["hidden_size, num_experts_per_tok missing"]),
    ("mixtral", dict(num_local_experts="<drop>", num_experts="<drop>"), ["num_local_experts missing"]),
    ("qwen2_moe", dict(moe_intermediate_size="<drop>"), ["moe_intermediate_size missing"]),
    ("olmoe", dict(intermediate_size=None, vocab_size="<drop>"), ["vocab_size, intermediate_size missing"]),
    ("qwen3_moe", dict(architectures=["MixtralForCausalLM"]), ["'qwen3_moe'", "MixtralForCausalLM"]),
    ("mixtral", dict(architectures="MixtralForCausalLM"), ["architectures must be a list"]),
    ("qwen2_moe", dict(mlp_only_layers=["1"]), ["mlp_only_layers"]),
    ("mixtral", dict(num_key_value_heads=0), ["num_key_value_heads"]),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "truncate": "no"}),
     ["truncate"]),
    ("mixtral", {"head_dim": 15}, ["head_dim (15) must be even"]),
])
def test_invalid_config_values_raise_one_clear_line(arch, changes, words):
    with pytest.raises(CheckpointError) as info:
        translate(raw_config(arch, **changes))
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_config_without_any_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="no supported model_type or architecture"):
        translate(raw_config("mixtral", model_type="<drop>", architectures=["LlamaForCausalLM"]))
    assert translate(raw_config("olmoe", model_type="<drop>", architectures=["OlmoeForCausalLM"])).qk_norm == "full"


@pytest.fixture
def hf_sharded(tmp_path):
    """A tiny qwen2_moe checkpoint in several shards, with its index, that the test may damage."""
    build_hf_model("qwen2_moe", tmp_path / "sharded", max_shard_size="60KB")
    return tmp_path / "sharded"


def edit_index(folder: Path, edit) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_broken_sharded_checkpoints_name_the_shard(hf_sharded, tmp_path):
    index = json.loads((hf_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.gate_proj.weight"
    shard = index[name]
    other = next(f for f in sorted(set(index.values())) if f != shard)
    original = (hf_sharded / shard).read_bytes()

    (hf_sharded / shard).write_bytes(original[: len(original) // 2])
    message = error_of(hf_sharded, tmp_path / "a", CheckpointError)
    assert shard in message and "truncated" in message
    (hf_sharded / shard).unlink()
    message = error_of(hf_sharded, tmp_path / "b", CheckpointError)
    assert f"lists {shard}, which is missing" in message
    (hf_sharded / shard).write_bytes(original)

    edit_index(hf_sharded, lambda m: m.update({name: other}))
    assert error_of(hf_sharded, tmp_path / "c", CheckpointError) == (
        f"model.safetensors.index.json places {name} in {other}, but it is in {shard}")
    edit_index(hf_sharded, lambda m: m.update({name: shard, "model.layers.9.mlp.gate_proj.weight": shard}))
    assert "places model.layers.9.mlp.gate_proj.weight" in error_of(hf_sharded, tmp_path / "d", CheckpointError)
    edit_index(hf_sharded, lambda m: m.update({"model.layers.9.mlp.gate_proj.weight": "../outside.safetensors"}))
    assert "not a file name in the model folder" in error_of(hf_sharded, tmp_path / "e", CheckpointError)
    assert not any((tmp_path / d).exists() for d in "abcde")


def test_single_file_is_read_before_a_leftover_index(hf_copy, tmp_path):
    """transformers loads model.safetensors when the folder holds it, whatever index lies beside it."""
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    export_model(hf_copy, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "config.json").is_file()


def test_dense_tensor_problems_name_the_tensor(hf_copy, tmp_path):
    norm = "model.layers.1.post_attention_layernorm.weight"
    edit_weights(hf_copy, lambda t: t.pop(norm))
    assert error_of(hf_copy, tmp_path / "a", CheckpointError) == f"{norm} is missing from the checkpoint"
    edit_weights(hf_copy, lambda t: t.update({norm: np.ones(64, np.float64)}))
    message = error_of(hf_copy, tmp_path / "b", UnsupportedModelError)
    assert norm in message and "F64" in message
    edit_weights(hf_copy, lambda t: t.update({norm: np.ones((1, 64), np.float32)}))
    assert f"{norm} has shape [1, 64], config.json implies [64]" == error_of(hf_copy, tmp_path / "c", CheckpointError)


def test_unreadable_tensor_data_names_the_tensor(hf_copy, monkeypatch):
    """A file that breaks after its header was read (replaced or cut during the export)."""
    from safetensors import SafetensorError

    from colibri_stream.export.hf_checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint(hf_copy)

    def broken(*args, **kwargs):
        raise SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered")

    monkeypatch.setattr("colibri_stream.export.hf_checkpoint.safe_open", broken)
    with pytest.raises(CheckpointError) as info:
        checkpoint.read("model.embed_tokens.weight", (slice(0, 4),))
    assert str(info.value).startswith("cannot read model.embed_tokens.weight from model.safetensors (")


def test_cli_export_reports_broken_checkpoints_in_one_line(hf_copy, tmp_path):
    (hf_copy / "config.json").write_text(json.dumps(dict(json.loads((hf_copy / "config.json").read_text()),
                                                         model_type="deepseek_v32")))
    completed = subprocess.run([sys.executable, "-m", "colibri_stream.cli", "export", str(hf_copy),
                                str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 1 and "Traceback" not in completed.stderr
    assert completed.stderr == ("error: model_type 'deepseek_v32' needs the sparse attention indexer of "
                                "DeepSeek-V3.2, which Colibri does not run; Colibri exports mixtral, qwen2_moe, "
                                "qwen3_moe, olmoe, glm4_moe, glm4_moe_lite, minimax_m2, deepseek_v2, deepseek_v3, "
                                "gpt_oss\n")
    assert not (tmp_path / "out").exists()
