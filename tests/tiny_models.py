"""Tiny random Hugging Face MoE models of every supported architecture, built with transformers on the CPU.

Each has several layers, 8 experts, top-2 or more routing and grouped-query attention, so every code path of the
runtime (GQA, qk-norm, shared experts, dense layers, biases; sigmoid routing with a correction bias, groups,
scaling and partial rotary in GLM-4.5 and MiniMax-M2) is exercised. Weights are drawn with a larger spread
than transformers' default so logits are far from ties and greedy decoding is a meaningful comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # softmax-routed, whole-head rotary
SIGMOID_ROUTED = ("glm4_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite")
LATENT_SOFTMAX_ROUTED = ("deepseek_v2",)  # latent attention, softmax routing without renormalisation
ALL_ARCHITECTURES = ARCHITECTURES + SIGMOID_ROUTED + LATENT_SOFTMAX_ROUTED
# what the GPU backend runs too (deepseek_v3's latent attention and gpt_oss's sinks and biased experts eagerly)
GPU_ARCHITECTURES = ARCHITECTURES + ("glm4_moe", "minimax_m2", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gpt_oss")
VOCAB_SIZE = 256
DROP = "<drop>"  # edit_config_json: leave the key out of config.json


def hf_config(arch: str, **overrides):
    """A transformers config object of `arch` with tiny dimensions (float32)."""
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "mixtral":
        cfg = dict(common, intermediate_size=48, num_local_experts=8)
        cls = transformers.MixtralConfig
    elif arch == "qwen2_moe":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                   num_experts=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])
        cls = transformers.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                   norm_topk_prob=True, head_dim=24)
        cls = transformers.Qwen3MoeConfig
    elif arch == "olmoe":
        cfg = dict(common, intermediate_size=32, num_experts=8, norm_topk_prob=False, clip_qkv=None)
        cls = transformers.OlmoeConfig
    elif arch == "glm4_moe":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                   first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   use_qk_norm=True, attention_bias=True)  # head_dim 16, the first 8 rotated (factor 0.5)
        cls = transformers.Glm4MoeConfig
    elif arch == "minimax_m2":
        cfg = dict(common, intermediate_size=32, num_local_experts=8, head_dim=24, rotary_dim=12)
        cls = transformers.MiniMaxM2Config
    elif arch == "deepseek_v3":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                   first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
                   rope_interleave=True, num_key_value_heads=4)
        cls = transformers.DeepseekV3Config
    elif arch == "deepseek_v2":
        # DeepSeek-V2-Lite's options: no q LoRA, softmax routing without renormalisation, scaled, two shared experts,
        # a dense first layer
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
                   first_k_dense_replace=1, routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=16,
                   qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, num_key_value_heads=4)
        cls = transformers.DeepseekV2Config
    elif arch == "glm4_moe_lite":
        # GLM-4.7-Flash: DeepSeek-V3's latent attention and routing, the MoE layers named one by one (a dense layer
        # between two MoE ones), no q LoRA here (DeepSeek-V3's tiny model has one)
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                   n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=None,
                   kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, rope_interleave=True,
                   num_key_value_heads=4, mlp_layer_types=["sparse", "dense", "sparse"])
        cls = transformers.Glm4MoeLiteConfig
    elif arch == "gpt_oss":
        # swiglu_limit below the spread of the experts' products, so both clamps act; a window shorter than the
        # prompt; YaRN as GptOssConfig sets it
        cfg = dict(common, intermediate_size=32, num_local_experts=8, head_dim=16, sliding_window=6,
                   swiglu_limit=0.5, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = transformers.GptOssConfig
    else:
        raise ValueError(f"unknown architecture {arch}")
    cfg.update(overrides)
    return cls(**cfg)


def build_hf_model(arch: str, folder: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Create, randomise and save a tiny model; returns the float32 torch model (eval mode)."""
    return save_random_model(hf_config(arch, **overrides), folder, seed, max_shard_size)


def save_random_model(config, folder: str | Path, seed: int = 0, max_shard_size: str | None = None):
    """A float32 model of a transformers `config` with random weights (spread as above), saved to `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))  # norms away from 1 so a missing norm shows
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("sinks"):  # gpt-oss's per-head logits: of the attention scores' size
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(config.initializer_range * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at initialisation; trained ones are not
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def edit_config_json(folder: str | Path, **changes) -> None:
    """Rewrites a saved model's config.json with `changes` (DROP leaves a key out): the keys a published config.json
    has as the Hub serves it (legacy rope_theta and rope_scaling, keys its config class does not read), which
    save_pretrained would have rewritten."""
    path = Path(folder) / "config.json"
    raw = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({key: value for key, value in raw.items() if value != DROP}, indent=2))


def load_hf_model(folder: str | Path):
    """The float32 transformers model saved in `folder`, its config.json read as from_pretrained reads it (eval
    mode): the reference for a config.json that edit_config_json changed."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
