"""The NumPy runtime computes what transformers computes, for every supported architecture and option.

Reference: the transformers model in float32 on the CPU. Tolerances:
- float32 export: logits within 1e-4 of the reference, relative to the largest reference logit; 32 greedy tokens equal.
- bfloat16 / int8 exports: compared with the reference whose weights were rounded the same way (bf16 rounding,
  or per-row int8 quantisation of the routed experts): the same 1e-4, since only storage differs. Against the
  unrounded float32 reference they must stay within 5e-2 (bf16) and 1e-1 (int8) relative.
The KV cache is float32 here (the reference's), so only the weights' storage differs; bf16 KV against float32 KV is
tests/test_kv_dtype.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from colibri_stream.batch import single_sequence_batch  # noqa: E402
from tiny_models import ALL_ARCHITECTURES, VOCAB_SIZE, build_hf_model  # noqa: E402

PROMPT_LEN = 32
NEW_TOKENS = 32
BLOCK_SIZE = 8


def prompt_ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB_SIZE, PROMPT_LEN)  # [S]


def reference_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids)[None]).logits[0].float().numpy()  # [S, V]


def reference_greedy(hf_model, ids: np.ndarray, steps: int) -> list[int]:
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf_model(torch.tensor(tokens)[None]).logits[0, -1].argmax()))
    return tokens[len(ids):]


def colibri_logits(model, ids: np.ndarray, kv_cache_dtype: str = "fp32") -> np.ndarray:
    """Logits of every prompt position; the KV cache float32 unless asked (the reference's, for exact comparisons)."""
    blocks = -(-len(ids) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE, kv_cache_dtype)
    batch = single_sequence_batch(ids, 0, np.arange(blocks), BLOCK_SIZE)
    batch.logits_indices = np.arange(len(ids))
    return model.forward(batch, kv)  # [S, V]


def colibri_greedy(model, ids: np.ndarray, steps: int, kv_cache_dtype: str = "fp32") -> list[int]:
    """Prefill, then one token at a time through the KV cache (blocks deliberately out of order; float32 unless
    asked)."""
    blocks = -(-(len(ids) + steps) // BLOCK_SIZE)
    table = np.random.default_rng(1).permutation(blocks)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE, kv_cache_dtype)
    out: list[int] = []
    logits = model.forward(single_sequence_batch(ids, 0, table, BLOCK_SIZE), kv)
    for step in range(steps):
        out.append(int(logits[-1].argmax()))
        if step + 1 < steps:
            logits = model.forward(single_sequence_batch(np.array([out[-1]]), len(ids) + step, table, BLOCK_SIZE), kv)
    return out


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def round_like_export(hf_model, dtype: str):
    """The reference model with its weights rounded the way an export in `dtype` stores them."""
    import copy

    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if dtype == "bf16":
                param.copy_(param.to(torch.bfloat16).float())
            elif dtype == "int8" and ".experts." in name:
                # Per output row: scale = max|row| / 127, q = round(w / scale). Fused [E, out, in] or [out, in].
                scale = param.abs().amax(dim=-1, keepdim=True) / 127.0
                scale = torch.where(scale == 0, torch.ones_like(scale), scale)
                param.copy_(torch.clamp(torch.round(param / scale), -127, 127) * scale)
    return rounded


@pytest.fixture(scope="module", params=ALL_ARCHITECTURES)
def hf_tiny(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(f"hf_{arch}")
    return arch, folder, build_hf_model(arch, folder)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_logits_and_greedy_match_transformers(hf_tiny, dtype, tmp_path):
    arch, hf_dir, hf_model = hf_tiny
    export_model(hf_dir, tmp_path / "model", dtype="fp32" if dtype == "int8" else dtype,
                 quantize="int8" if dtype == "int8" else None, progress=False)
    model = load_model(tmp_path / "model", verify=True)
    ids = prompt_ids()
    reference_model = hf_model if dtype == "fp32" else round_like_export(hf_model, dtype)

    ours = colibri_logits(model, ids)
    assert relative_error(ours, reference_logits(reference_model, ids)) < 1e-4, arch
    if dtype != "fp32":
        unrounded = reference_logits(hf_model, ids)
        assert np.abs(ours - unrounded).mean() < 3e-2 * np.abs(unrounded).mean(), arch
    assert colibri_greedy(model, ids, NEW_TOKENS) == reference_greedy(reference_model, ids, NEW_TOKENS), arch


VARIANTS = [
    ("mixtral", {"sliding_window": 8}),
    ("mixtral", {"tie_word_embeddings": True}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}),  # transformers still builds it, with no width
    ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [0]}),
    ("mixtral", {"head_dim": 32}),  # not hidden / heads (16)
    ("olmoe", {"num_experts_per_tok": 8}),  # every expert
    ("qwen3_moe", {"attention_bias": True}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 5}),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}}),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}}),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 128}}),
    ("olmoe", {"clip_qkv": 0.5, "attention_bias": True, "norm_topk_prob": True}),
    ("glm4_moe", {"use_qk_norm": False, "attention_bias": False}),
    ("glm4_moe", {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}),
    ("glm4_moe", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}),  # groups of 2, 3 experts of 4 kept
    ("glm4_moe", {"n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0}),
    ("glm4_moe", {"partial_rotary_factor": 1.0, "first_k_dense_replace": 2}),
    ("glm4_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5}}),
    ("minimax_m2", {"rotary_dim": None}),  # the whole head
    ("minimax_m2", {"num_experts_per_tok": 4, "head_dim": 16, "rotary_dim": 8}),
    ("deepseek_v3", {"q_lora_rank": None}),  # one q_proj
    ("deepseek_v3", {"rope_interleave": False, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}),
    ("deepseek_v3", {"n_shared_experts": 2, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 0.8,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v2", {"q_lora_rank": 24, "first_k_dense_replace": 0, "num_experts_per_tok": 3}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                     "num_experts_per_tok": 3}),  # groups of 2 ranked by their best score, 3 experts of 4 kept
    ("deepseek_v2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                         "original_max_position_embeddings": 128, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}),
    ("glm4_moe_lite", {"q_lora_rank": 24, "mlp_layer_types": None}),  # q LoRA; transformers' default: dense first
    ("glm4_moe_lite", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3, "n_shared_experts": 2,
                       "rope_interleave": False, "mlp_layer_types": ["sparse"] * 3}),
    ("glm4_moe_lite", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                           "original_max_position_embeddings": 128, "mscale": 1.0,
                                           "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    # Options every family reads: the norms' epsilon, tied embeddings, rope variants beside those above
    ("mixtral", {"rms_norm_eps": 1e-3}),
    ("mixtral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "beta_fast": 16.0,
                                     "original_max_position_embeddings": 64, "attention_factor": 1.3},
                 "head_dim": 16}),  # transformers' YaRN needs head_dim given (MixtralConfig's None fails it)
    ("mixtral", {"router_jitter_noise": 0.5}),  # training only: transformers adds no noise in eval mode
    ("qwen2_moe", {"qkv_bias": False, "norm_topk_prob": True}),
    ("qwen2_moe", {"tie_word_embeddings": True, "head_dim": 24}),
    ("qwen2_moe", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}),
    ("qwen3_moe", {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "norm_topk_prob": False}),
    # Qwen3's published max_window_layers, and a layer_types key, which Qwen3MoeConfig does not read: the window
    # is every layer's
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                   "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ("olmoe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "truncate": False,
                                   "original_max_position_embeddings": 64}, "num_key_value_heads": None}),  # None: as many as query heads
    ("glm4_moe", {"head_dim": 24, "rms_norm_eps": 1e-6}),  # head_dim above hidden / heads (16), 12 rotated
    ("glm4_moe", {"n_shared_experts": 0, "tie_word_embeddings": True}),  # transformers builds a zero-width one
    ("glm4_moe", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                      "partial_rotary_factor": 0.5}}),  # Llama 3's bands over the rotated half
    ("minimax_m2", {"router_jitter_noise": 0.5, "tie_word_embeddings": True}),
    ("minimax_m2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e6, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5}}),
    ("deepseek_v3", {"tie_word_embeddings": True, "v_head_dim": 12, "n_shared_experts": 0}),
    ("deepseek_v3", {"rms_norm_eps": 1e-2}),  # the decoder's norms; the latents' keep 1e-6, as transformers does
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                         "original_max_position_embeddings": 64}}),  # Kimi K2's YaRN
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
    # mscale_all_dim scales the softmax under any rope type but the default, not YaRN's alone
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0,
                                         "mscale_all_dim": 1.0}}),
]


@pytest.mark.parametrize("arch,overrides", VARIANTS, ids=[f"{a}-{'-'.join(o)}" for a, o in VARIANTS])
def test_config_options_match_transformers(arch, overrides, tmp_path):
    hf_model = build_hf_model(arch, tmp_path / "hf", seed=3, **overrides)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False)
    model = load_model(tmp_path / "model")
    ids = prompt_ids(seed=5)
    assert relative_error(colibri_logits(model, ids), reference_logits(hf_model, ids)) < 1e-4
    assert colibri_greedy(model, ids, 8) == reference_greedy(hf_model, ids, 8)
