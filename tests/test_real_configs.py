"""The published config.json of every supported model family, as its authors wrote it (tests/data/hf_configs).

Two checks per config: the translation gives the native fields that the published model computes with (no
weights needed), and a shrunk copy (every key and flag kept, only the sizes made tiny) exports and runs on the
NumPy backend to transformers' float32 logits. The shrunk copy's config.json is the published one with new sizes,
not what save_pretrained would rewrite it to, so the legacy keys (rope_theta, rope_scaling: null, num_local_experts,
sliding_window: null, max_window_layers, ...) go through the exporter as they come from the Hugging Face Hub.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from colibri_stream.config import RopeConfig  # noqa: E402
from colibri_stream.errors import UnsupportedModelError  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.export.architectures import detect_architecture, translate_config  # noqa: E402
from colibri_stream.export.quantized_sources import quantized_source  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from test_parity import colibri_greedy, colibri_logits, prompt_ids, reference_greedy, reference_logits  # noqa: E402
from test_parity import relative_error  # noqa: E402
from tiny_models import VOCAB_SIZE, save_random_model  # noqa: E402

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
QWEN2_BIAS = "model.layers.0.self_attn.q_proj.bias"  # Qwen2-MoE configs leave the attention bias to the weights


def published(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def translate(raw: dict, names=()):
    return translate_config(raw, {}, set(names), "bfloat16", "bfloat16")


def window(layers: int, value=None) -> tuple:
    return (value,) * layers


# What each published model computes with: the fields its config.json must translate to.
EXPECTED = {
    "mixtral-8x7b-v0.1": dict(
        architecture="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, moe_intermediate_size=14336, moe_layers=tuple(range(32)),
        intermediate_size=0, norm_topk_prob=True, shared_expert_intermediate_size=0, qk_norm="none", qkv_bias=False,
        o_bias=False, clip_qkv=None, sliding_windows=window(32), rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
        pad_token_id=None),
    "mixtral-8x22b-v0.1": dict(
        architecture="mixtral", vocab_size=32000, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, moe_intermediate_size=16384, moe_layers=tuple(range(56)),
        norm_topk_prob=True, sliding_windows=window(56), rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5,
        max_position_embeddings=65536),
    "qwen3-30b-a3b": dict(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768, moe_layers=tuple(range(48)),
        intermediate_size=0, norm_topk_prob=True, shared_expert_intermediate_size=0, qk_norm="per_head",
        qkv_bias=False, o_bias=False, clip_qkv=None, sliding_windows=window(48), rope=RopeConfig(theta=1e6),
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645,), pad_token_id=None),
    "qwen3-235b-a22b": dict(
        architecture="qwen3_moe", hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
        num_experts=128, top_k=8, moe_intermediate_size=1536, moe_layers=tuple(range(94)), intermediate_size=0,
        norm_topk_prob=True, qk_norm="per_head", sliding_windows=window(94), rope=RopeConfig(theta=1e6)),
    "olmoe-1b-7b": dict(
        architecture="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=1024, moe_layers=tuple(range(16)),
        intermediate_size=0, norm_topk_prob=False, qk_norm="full", qkv_bias=False, o_bias=False, clip_qkv=None,
        sliding_windows=window(16), rope=RopeConfig(theta=1e4), rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=4096, bos_token_id=None, eos_token_ids=(50279,), pad_token_id=1),
    "qwen1.5-moe-a2.7b": dict(
        architecture="qwen2_moe", vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=16,
        num_kv_heads=16, head_dim=128, num_experts=60, top_k=4, moe_intermediate_size=1408,
        moe_layers=tuple(range(24)), intermediate_size=0, norm_topk_prob=False,
        shared_expert_intermediate_size=5632, shared_expert_gate=True, qk_norm="none", qkv_bias=True, o_bias=False,
        sliding_windows=window(24), rope=RopeConfig(theta=1e6), rms_norm_eps=1e-6, max_position_embeddings=8192),
    "qwen2-57b-a14b": dict(
        architecture="qwen2_moe", vocab_size=151936, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=2560, moe_layers=tuple(range(28)),
        intermediate_size=0, norm_topk_prob=False, shared_expert_intermediate_size=20480, shared_expert_gate=True,
        qkv_bias=True, sliding_windows=window(28), rope=RopeConfig(theta=1e6), max_position_embeddings=131072,
        bos_token_id=151643, eos_token_ids=(151643,)),
    "glm-4.5-air": dict(
        architecture="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
        head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=1408, moe_layers=tuple(range(1, 46)),
        intermediate_size=10944, norm_topk_prob=True, shared_expert_intermediate_size=1408, shared_expert_gate=False,
        router_scoring="sigmoid", score_correction_bias=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        qk_norm="none", qkv_bias=True, o_bias=False, clip_qkv=None, sliding_windows=window(46), rotary_dim=64,
        rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        bos_token_id=None, eos_token_ids=(151329, 151336, 151338), pad_token_id=151329),
    "minimax-m2.5-bf16": dict(
        architecture="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=62, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=256, top_k=8, moe_intermediate_size=1536, moe_layers=tuple(range(62)),
        intermediate_size=0, norm_topk_prob=True, shared_expert_intermediate_size=0, router_scoring="sigmoid",
        score_correction_bias=True, n_group=1, routed_scaling_factor=1.0, qk_norm="full", qkv_bias=False,
        o_bias=False, sliding_windows=window(62), rotary_dim=64, rope=RopeConfig(theta=5e6), rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=196608, bos_token_id=200034, eos_token_ids=(200020,),
        pad_token_id=None),
    "gpt-oss-120b": dict(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64, num_kv_heads=8,
        head_dim=64, num_experts=128, top_k=4, moe_intermediate_size=2880, moe_layers=tuple(range(36)),
        intermediate_size=0, norm_topk_prob=True, shared_expert_intermediate_size=0, router_scoring="softmax",
        router_bias=True, attention_sinks=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
        qk_norm="none", qkv_bias=True, o_bias=True, sliding_windows=(128, None) * 18, rotary_dim=None,
        rope=RopeConfig(type="yarn", theta=150000.0, factor=32.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, truncate=False),
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=None,
        eos_token_ids=(200002,), pad_token_id=199999),
    "kimi-k2-instruct": dict(
        architecture="deepseek_v3", vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64,
        num_kv_heads=64, head_dim=192, rotary_dim=64, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        v_head_dim=128, rope_interleave=True, num_experts=384, top_k=8, moe_intermediate_size=2048,
        moe_layers=tuple(range(1, 61)), intermediate_size=18432, shared_expert_intermediate_size=2048,
        router_scoring="sigmoid", score_correction_bias=True, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.827,
        rope=RopeConfig(type="yarn", theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        softmax_scale=pytest.approx(192**-0.5 * (0.1 * math.log(32) + 1) ** 2, rel=1e-12),
        rms_norm_eps=1e-6, max_position_embeddings=131072, bos_token_id=163584, eos_token_ids=(163585,)),
}
# The tensors that tell the exporter a router has a correction bias (as the published checkpoints have).
BIASES = {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.block_sparse_moe.e_score_correction_bias"}
NAMES = sorted(EXPECTED)


def test_every_stored_config_is_checked():
    stored = {p.stem for p in CONFIGS.glob("*.json")}
    assert stored == set(NAMES) | {"qwen1.5-moe-a2.7b-chat-gptq-int4", "deepseek-v3"}


@pytest.mark.parametrize("name", NAMES)
def test_published_config_translates_to_what_the_model_computes(name):
    config = translate(published(name), names={QWEN2_BIAS} | BIASES)
    expected = EXPECTED[name]
    assert {k: getattr(config, k) for k in expected} == expected


def test_qwen2_moe_without_attention_biases_in_the_weights():
    assert not translate(published("qwen2-57b-a14b")).qkv_bias


def test_qwen_layer_options_on_published_configs():
    # Qwen3-235B with the dense layers and the sliding window its config class can express.
    raw = dict(published("qwen3-235b-a22b"), decoder_sparse_step=2, mlp_only_layers=[0, 5])
    config = translate(raw)
    assert config.moe_layers == tuple(i for i in range(94) if i % 2 == 1 and i != 5)
    assert config.intermediate_size == 12288
    raw = dict(published("qwen3-30b-a3b"), use_sliding_window=True, sliding_window=4096)
    assert translate(raw).sliding_windows == window(48, 4096)
    # Qwen2-MoE: sliding layers are the even-numbered ones below max_window_layers (1-based odd).
    raw = dict(published("qwen2-57b-a14b"), use_sliding_window=True, max_window_layers=4)
    assert translate(raw).sliding_windows == (131072, None, 131072, None) + window(24)


def test_qwen3_yarn_as_its_model_card_enables_it():
    """The Qwen3 model cards extend the context by adding rope_scaling to the published config.json."""
    raw = dict(published("qwen3-30b-a3b"),
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert translate(raw).rope == RopeConfig(type="yarn", theta=1e6, factor=4.0,
                                             original_max_position_embeddings=32768)


def test_pre_quantised_published_config_of_an_unsupported_format_is_refused():
    with pytest.raises(UnsupportedModelError, match="quant_method 'gptq' is not supported; Colibri imports fp8"):
        quantized_source(published("qwen1.5-moe-a2.7b-chat-gptq-int4"))


def unquantised(name: str) -> dict:
    """A published FP8 config as its bf16 conversion has it: without quantization_config."""
    return {k: v for k, v in published(name).items() if k != "quantization_config"}


def test_deepseek_v3_translates_to_what_it_computes():
    raw = published("deepseek-v3")
    assert quantized_source(raw).expert_format() == dict(expert_dtype="fp8", expert_scales="block")  # as shipped
    config = translate(raw, names={"model.layers.3.mlp.gate.e_score_correction_bias"})
    mscale = 0.1 * math.log(40) + 1  # YaRN's mscale_all_dim correction, squared on the softmax scale
    expected = dict(
        architecture="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        head_dim=192, rotary_dim=64, attention="mla", q_lora_rank=1536, kv_lora_rank=512, v_head_dim=128,
        rope_interleave=True, num_experts=256, top_k=8, moe_intermediate_size=2048, moe_layers=tuple(range(3, 61)),
        intermediate_size=18432, shared_expert_intermediate_size=2048, router_scoring="sigmoid",
        score_correction_bias=True, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope=RopeConfig(type="yarn", theta=1e4, factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, bos_token_id=0, eos_token_ids=(1,))
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# Shrunk copies against transformers
# ------------------------------------------------------------------------------------------------------------------

def shrunk(raw: dict) -> dict:
    """The published config with tiny sizes: same keys, flags, head ratios and explicit head_dim (or not)."""
    out = dict(raw)
    layers = 3
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    group = heads // kv
    small_kv = 1 if group > 1 else 4
    out.update(num_attention_heads=small_kv * group, num_key_value_heads=small_kv, num_hidden_layers=layers,
               vocab_size=VOCAB_SIZE, initializer_range=0.08)
    if "head_dim" in raw:  # keep head_dim apart from hidden / heads, as Qwen3 has it
        out.update(head_dim=16, hidden_size=48)
    else:
        out.update(hidden_size=16 * out["num_attention_heads"])
    experts_key = next(k for k in ("num_local_experts", "n_routed_experts", "num_experts") if k in raw)
    out[experts_key] = min(raw[experts_key], 2 * raw["num_experts_per_tok"], 16)
    out["num_experts_per_tok"] = min(raw["num_experts_per_tok"], out[experts_key] // 2)
    if "moe_intermediate_size" in raw:
        out.update(moe_intermediate_size=24, intermediate_size=40)
    else:
        out.update(intermediate_size=24)
    if raw.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = 32
    if "rotary_dim" in raw:  # MiniMax-M2: the same share of the smaller head
        out["rotary_dim"] = raw["rotary_dim"] * out["head_dim"] // raw["head_dim"]
    if "layer_types" in raw:  # gpt-oss: the first layers' kinds
        out["layer_types"] = raw["layer_types"][:layers]
    if "attn_type_list" in raw:
        out["attn_type_list"] = raw["attn_type_list"][:layers]
    if "max_window_layers" in raw:
        out["max_window_layers"] = round(raw["max_window_layers"] * layers / raw["num_hidden_layers"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids inside the tiny vocabulary
        if isinstance(raw.get(key), int):
            out[key] = raw[key] % VOCAB_SIZE
    return out


def build_shrunk(raw: dict, folder: Path, seed: int = 0):
    """A random float32 transformers model of `raw` (read the way from_pretrained reads it), whose config.json is
    `raw` itself."""
    import transformers

    config = transformers.AutoConfig.for_model(detect_architecture(raw)).__class__.from_dict(raw)
    model = save_random_model(config, folder, seed)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return model


PARITY = [
    ("mixtral-8x7b-v0.1", {}),
    ("mixtral-8x22b-v0.1", {"sliding_window": 6}),
    ("mixtral-8x7b-v0.1", {"head_dim": 24}),  # MixtralConfig takes an explicit head_dim too
    ("qwen3-30b-a3b", {}),
    ("qwen3-235b-a22b", {"decoder_sparse_step": 2, "mlp_only_layers": [2], "attention_bias": True}),
    ("qwen3-30b-a3b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ("olmoe-1b-7b", {}),
    ("olmoe-1b-7b", {"clip_qkv": 0.3, "num_key_value_heads": 2}),
    ("qwen1.5-moe-a2.7b", {}),
    ("qwen2-57b-a14b", {}),
    ("qwen2-57b-a14b", {"head_dim": 8}),
    ("qwen2-57b-a14b", {"use_sliding_window": True, "sliding_window": 5, "mlp_only_layers": [1]}),
    ("glm-4.5-air", {}),
    ("glm-4.5-air", {"use_qk_norm": True, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}),
    ("glm-4.5-air", {"use_qk_norm": True, "routed_scaling_factor": 2.5}),  # GLM-4.5's and GLM-4.6's options
    ("minimax-m2.5-bf16", {}),
    ("deepseek-v3", {"first_k_dense_replace": 1}),  # one dense layer, two MoE
    ("deepseek-v3", {"first_k_dense_replace": 1, "q_lora_rank": None, "rope_scaling": None}),
    ("kimi-k2-instruct", {}),  # model_type kimi_k2: DeepSeek-V3's architecture, one group, Kimi's YaRN
    ("gpt-oss-120b", {}),
    ("gpt-oss-120b", {"sliding_window": 6}),  # a window shorter than the prompt
]


@pytest.mark.parametrize("name,changes", PARITY, ids=[f"{n}-{'-'.join(c) or 'published'}" for n, c in PARITY])
def test_shrunk_published_config_matches_transformers(name, changes, tmp_path):
    raw = dict(shrunk(unquantised(name)), **changes)
    hf_model = build_shrunk(raw, tmp_path / "hf")
    config = export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    if "qk_nope_head_dim" in raw:  # Multi-head Latent Attention: query/key heads of the two parts
        assert config.head_dim == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    else:
        assert config.head_dim == raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    model = load_model(tmp_path / "model")
    ids = prompt_ids(seed=2)
    assert relative_error(colibri_logits(model, ids), reference_logits(hf_model, ids)) < 1e-4
    assert colibri_greedy(model, ids, 4) == reference_greedy(hf_model, ids, 4)
