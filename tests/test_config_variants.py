"""Options of published checkpoints' config.json that tests/test_parity.py's VARIANTS and tests/test_real_configs.py
leave out, per family, against transformers.

Each case builds a tiny random model, rewrites its config.json the way the published file has it where
save_pretrained would not write that (legacy rope_theta and rope_scaling, keys the config class does not read,
keys left out), exports it in float32 and compares the NumPy backend's logits and greedy tokens with those of the
model transformers reads from that same config.json. An option Colibri does not compute is refused at export in
one line that names it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from colibri_stream.errors import UnsupportedModelError  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from test_parity import colibri_greedy, colibri_logits, prompt_ids, reference_greedy, reference_logits  # noqa: E402
from test_parity import relative_error  # noqa: E402
from tiny_models import DROP, build_hf_model, edit_config_json, load_hf_model  # noqa: E402

# (id, architecture, hf_config overrides, config.json edits)
VARIANTS = [
    # gpt-oss without rope parameters: GptOssConfig's YaRN over config.json's own rope_theta, not its default base
    ("gpt_oss-rope_theta-without-rope_scaling", "gpt_oss", {}, dict(rope_parameters=DROP, rope_theta=1e4)),
    ("gpt_oss-rope_scaling-null", "gpt_oss", {}, dict(rope_parameters=DROP, rope_scaling=None, rope_theta=5e5)),
    ("gpt_oss-layer_types-left-out", "gpt_oss", {}, dict(layer_types=DROP)),  # GptOssConfig's alternation
    ("gpt_oss-attention_bias-false", "gpt_oss", dict(attention_bias=False), {}),
    ("gpt_oss-tied-embeddings", "gpt_oss", dict(tie_word_embeddings=True, num_key_value_heads=4), {}),
    # Qwen3-Coder-480B's and the 2507 releases' keys: Qwen2-MoE's names, which Qwen3MoeConfig does not read
    ("qwen3_moe-coder-keys", "qwen3_moe", {},
     dict(rope_parameters=DROP, rope_scaling=None, rope_theta=1e7, qkv_bias=False, use_qk_norm=True,
          shared_expert_intermediate_size=0, sliding_window=None, use_sliding_window=False, max_window_layers=3,
          mlp_only_layers=[])),
    ("qwen3_moe-sliding-without-window", "qwen3_moe", dict(use_sliding_window=True, sliding_window=None), {}),
    # transformers 5's layer_types name the sliding layers (max_window_layers is then not read)
    ("qwen2_moe-layer_types", "qwen2_moe",
     dict(use_sliding_window=True, sliding_window=5, max_window_layers=0,
          layer_types=["full_attention", "sliding_attention", "sliding_attention"]), {}),
    ("olmoe-tied-embeddings", "olmoe", dict(tie_word_embeddings=True), {}),
    # Moonlight: DeepSeek-V3 without q LoRA, one group, no rope scaling; the authors' routing keys
    ("deepseek_v3-moonlight", "deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1,
                                                  routed_scaling_factor=2.446),
     dict(rope_parameters=DROP, rope_scaling=None, rope_theta=5e4, topk_method="noaux_tc", scoring_func="sigmoid",
          moe_layer_freq=1, ep_size=1, seq_aux=True, aux_loss_alpha=0.001)),
    # YaRN whose mscale and mscale_all_dim are 0: transformers takes them as absent
    ("deepseek_v3-yarn-mscale-zero", "deepseek_v3", {},
     dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0, "mscale_all_dim": 0,
                           "original_max_position_embeddings": 64})),
    ("deepseek_v2-tied-embeddings", "deepseek_v2", dict(tie_word_embeddings=True), {}),
    ("glm4_moe_lite-tied-embeddings", "glm4_moe_lite", dict(tie_word_embeddings=True), {}),
    # MiniMax-M2's legacy rotary_dim beside a legacy rope_scaling that names no partial_rotary_factor
    ("minimax_m2-rotary_dim-with-rope_scaling", "minimax_m2", {},
     dict(rope_parameters=DROP, rotary_dim=12, rope_theta=5e6,
          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
]


@pytest.mark.parametrize("arch,overrides,edits", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_published_option_matches_transformers(arch, overrides, edits, tmp_path):
    build_hf_model(arch, tmp_path / "hf", seed=3, **overrides)
    edit_config_json(tmp_path / "hf", **edits)
    hf_model = load_hf_model(tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model = load_model(tmp_path / "model")
    ids = prompt_ids(seed=5)
    assert relative_error(colibri_logits(model, ids), reference_logits(hf_model, ids)) < 1e-4
    assert colibri_greedy(model, ids, 8) == reference_greedy(hf_model, ids, 8)


# (id, architecture, config.json edits, words of the refusal)
REFUSED = [
    # transformers 5's rope parameters per layer type (a dict of dicts): one rope for every layer is computed
    ("gpt_oss-rope-per-layer-type", "gpt_oss",
     dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e5}}),
     ["per-layer-type rope parameters"]),
    ("qwen2_moe-sliding-without-window", "qwen2_moe", dict(use_sliding_window=True, sliding_window=None,
                                                           max_window_layers=3, layer_types=DROP),
     ["sliding_attention", "sliding_window is null"]),
]


@pytest.mark.parametrize("arch,edits,words", [v[1:] for v in REFUSED], ids=[v[0] for v in REFUSED])
def test_unsupported_option_is_refused_at_export_in_one_line(arch, edits, words, tmp_path):
    build_hf_model(arch, tmp_path / "hf")
    edit_config_json(tmp_path / "hf", **edits)
    with pytest.raises(UnsupportedModelError) as info:
        export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message
