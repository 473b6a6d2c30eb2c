"""gpt-oss on the NumPy reference: exported from transformers' checkpoints, the same logits and greedy tokens.

Tiny random gpt-oss models with non-zero sinks and biases, both layer types and a window (6) shorter than the
prompt (32), top-k 2 and 4; float32 exports against transformers in float32 (tests/test_parity.py's tolerances),
and a bf16 checkpoint as transformers saves one.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.checkpoint import read_config  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.hf_checkpoint import HFCheckpoint  # noqa: E402
from colibri_stream.loader import check_features, load_model  # noqa: E402
from test_parity import colibri_greedy, colibri_logits, prompt_ids, reference_greedy, reference_logits  # noqa: E402
from test_parity import relative_error  # noqa: E402
from tiny_models import build_hf_model  # noqa: E402

VARIANTS = [
    {},  # sliding, full, sliding; top-2
    {"num_experts_per_tok": 4, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
    {"layer_types": ["full_attention"] * 3, "attention_bias": False},
    {"layer_types": None},  # GptOssConfig's default: sliding at even layers
    {"tie_word_embeddings": True, "rms_norm_eps": 1e-3, "swiglu_limit": 2.0, "swiglu_alpha": 1.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},  # no YaRN
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=["default", "top4", "full-nobias", "default-layer-types",
                                                     "tied-eps-swiglu", "default-rope"])
def test_gpt_oss_matches_transformers(overrides, tmp_path):
    hf_model = build_hf_model("gpt_oss", tmp_path / "hf", seed=3, **overrides)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model = load_model(tmp_path / "model")
    config = model.config
    assert config.attention_sinks and config.router_bias and config.expert_bias
    assert (config.swiglu_limit, config.swiglu_alpha) == (hf_model.config.swiglu_limit, hf_model.config.swiglu_alpha)
    expected_windows = tuple(6 if kind == "sliding_attention" else None for kind in hf_model.config.layer_types)
    assert config.sliding_windows == expected_windows
    ids = prompt_ids(seed=5)
    assert relative_error(colibri_logits(model, ids), reference_logits(hf_model, ids)) < 1e-4
    assert colibri_greedy(model, ids, 16) == reference_greedy(hf_model, ids, 16)


def test_gpt_oss_from_a_bf16_checkpoint(tmp_path):
    import transformers

    build_hf_model("gpt_oss", tmp_path / "hf32", seed=4).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert HFCheckpoint(tmp_path / "hf").tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == "BF16"
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model = load_model(tmp_path / "model")
    # the bf16 weights widened, what the export holds (rope's tables computed afresh in float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = prompt_ids(seed=6)
    assert relative_error(colibri_logits(model, ids), reference_logits(reference, ids)) < 1e-4
    assert colibri_greedy(model, ids, 8) == reference_greedy(reference, ids, 8)


def test_gpu_backend_takes_gpt_oss_in_every_expert_format(tmp_path):
    """Sinks run inside the attention kernels, biases and the clamped SwiGLU inside the MoE kernels in every expert
    format, so decode steps are captured (GPU expert slots: tests/test_gpu_tiers.py)."""
    build_hf_model("gpt_oss", tmp_path / "hf", seed=3)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="bf16", progress=False)
    config = read_config(tmp_path / "model")
    check_features(config, CupyBackend)
    for quantized in (dict(expert_dtype="int8"), dict(expert_dtype="int4", expert_group_size=32),
                      dict(expert_dtype="fp8", expert_scales="block")):
        check_features(dataclasses.replace(config, **quantized), CupyBackend)
    assert CupyBackend.captures(config, "bfloat16")  # sinks in the attention kernels: decode steps captured in CUDA graphs
