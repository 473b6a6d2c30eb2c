"""The supported Hugging Face architectures: config.json translated to ModelConfig (the checkpoints' tensor
names: tensor_names.py).

The translation follows the transformers 5 config classes (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig,
OlmoeConfig, Glm4MoeConfig, Glm4MoeLiteConfig, MiniMaxM2Config, DeepseekV2Config, DeepseekV3Config, GptOssConfig)
and their modeling code: a key absent from config.json takes the class default, every option that changes the
computation becomes a ModelConfig field or is refused with UnsupportedModelError, and training-only options
(dropout, router jitter and auxiliary loss, initializer range, use_cache, ...) are ignored.
"""

from __future__ import annotations

from typing import Any, Collection

from ..config import ARCHITECTURES, ROPE_TYPES, ModelConfig, RopeConfig
from ..errors import CheckpointError, UnsupportedModelError
from ..model.rope import yarn_mscale

_CAUSAL_LM_CLASSES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}
# Hugging Face model types Colibri knows of and refuses, with what they compute that it does not.
_REFUSED = {"deepseek_v32": "the sparse attention indexer of DeepSeek-V3.2",
            "glm_moe_dsa": "the sparse attention indexer of GLM-5"}
# Model types that name another's architecture: Kimi K2 is DeepSeek-V3's (its config.json says DeepseekV3ForCausalLM).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}

_COMMON_DEFAULTS = dict(hidden_act="silu", tie_word_embeddings=False, head_dim=None, rope_theta=10000.0)
# The transformers config-class defaults of every key the translation reads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        _COMMON_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, sliding_window=None, num_experts_per_tok=2,
        num_experts=8, rope_theta=1e6,
    ),
    "qwen2_moe": dict(
        _COMMON_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6,
        use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
        decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, mlp_only_layers=None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ),
    "qwen3_moe": dict(
        _COMMON_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        attention_bias=False, use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1,
        moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
        mlp_only_layers=None, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ),
    "olmoe": dict(
        _COMMON_DEFAULTS, vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=None, max_position_embeddings=4096, rms_norm_eps=1e-5,
        attention_bias=False, clip_qkv=None, num_experts_per_tok=8, num_experts=64, norm_topk_prob=False,
        bos_token_id=None, eos_token_id=50279, pad_token_id=1,
    ),
    "glm4_moe": dict(
        _COMMON_DEFAULTS, vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
        n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=1, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    ),
    "deepseek_v2": dict(
        _COMMON_DEFAULTS, vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, attention_bias=False, mlp_bias=False,
        first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64,
        n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None,
        topk_method="greedy", norm_topk_prob=False, v_head_dim=128, moe_intermediate_size=1407,
    ),
    "deepseek_v3": dict(
        _COMMON_DEFAULTS, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1,
    ),
    "glm4_moe_lite": dict(
        _COMMON_DEFAULTS, vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
        num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_shared_experts=1,
        n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        rope_interleave=True, attention_bias=False, mlp_layer_types=None, num_nextn_predict_layers=0,
    ),
    "minimax_m2": dict(
        _COMMON_DEFAULTS, vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=196608,
        rms_norm_eps=1e-6, num_experts_per_tok=8, num_local_experts=256, rope_theta=5e6, bos_token_id=200034,
        eos_token_id=200020, pad_token_id=None,
    ),
    "gpt_oss": dict(
        _COMMON_DEFAULTS, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_local_experts=128, head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4, swiglu_alpha=1.702,
        swiglu_limit=7.0, attention_bias=True, layer_types=None, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, rope_theta=150000.0,
    ),
}
# gpt-oss's rope when config.json gives none (GptOssConfig's default). Its base is config.json's rope_theta (or
# the class default), as transformers fills it in: this dict names none.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# DeepSeek-V3's config.json names its routing, which DeepseekV3Config does not read: transformers always routes
# by noaux_tc over sigmoid scores with a MoE block in every layer from first_k_dense_replace on, so another value
# (which the authors' own modeling code would follow) is refused.
_DEEPSEEK_ROUTING = dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
# The epsilon of DeepSeek-V3's q_a_layernorm and kv_a_layernorm: transformers (and DeepSeek's own code) build them
# without the config's rms_norm_eps, so they keep DeepseekV3RMSNorm's default.
_LATENT_NORM_EPS = 1e-6
# The default share of each head that GLM-4.5 rotates (Glm4MoeConfig sets it when config.json does not).
_GLM_PARTIAL_ROTARY_FACTOR = 0.5


# Keys that set a model's shape or routing. Absent, transformers would take its config class's default (the sizes of
# one published model), which for any other checkpoint computes something else, sometimes with weights of the
# right shapes (a head count, top-k); so config.json must state them. The expert width key differs per family.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok")
_EXPERT_WIDTH_KEY = {"mixtral": "intermediate_size", "olmoe": "intermediate_size",
                     "qwen2_moe": "moe_intermediate_size", "qwen3_moe": "moe_intermediate_size",
                     "glm4_moe": "moe_intermediate_size", "glm4_moe_lite": "moe_intermediate_size",
                     "minimax_m2": "intermediate_size",
                     "deepseek_v2": "moe_intermediate_size", "deepseek_v3": "moe_intermediate_size",
                     "gpt_oss": "intermediate_size"}
# The keys that may give the routed-expert count (transformers aliases them), the config class's own name first.
_EXPERT_COUNT_KEYS = {"mixtral": ("num_local_experts", "num_experts"), "glm4_moe": ("n_routed_experts",
                      "num_local_experts"), "glm4_moe_lite": ("n_routed_experts", "num_local_experts"),
                      "minimax_m2": ("num_local_experts", "num_experts"),
                      "deepseek_v2": ("n_routed_experts", "num_local_experts"),
                      "deepseek_v3": ("n_routed_experts", "num_local_experts"), "gpt_oss": ("num_local_experts",)}
_DEFAULT_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def _unsupported(message: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {message}")


def _invalid(message: str, file: str = "config.json") -> CheckpointError:
    return CheckpointError(f"{file}: {message}")


def _int(value: Any, key: str, minimum: int = 1, file: str = "config.json") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _invalid(f"{key} must be an integer of at least {minimum}, got {value!r}", file)
    return value


def _number(value: Any, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise _invalid(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _bool(value: Any, key: str) -> bool:
    """A JSON boolean; a string such as "false" would otherwise read as true."""
    if not isinstance(value, bool):
        raise _invalid(f"{key} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, key: str, file: str) -> tuple[int, ...]:
    values = [] if value is None else value if isinstance(value, list) else [value]
    return tuple(_int(v, key, minimum=0, file=file) for v in values)


def detect_architecture(raw: dict[str, Any]) -> str:
    """The architecture named by config.json's model_type (or, without one, its architectures list)."""
    supported = ", ".join(ARCHITECTURES)
    model_type = raw.get("model_type")
    classes = raw.get("architectures") or []
    if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
        raise _invalid(f"architectures must be a list of class names, got {classes!r}")
    named = [_CAUSAL_LM_CLASSES[name] for name in classes if name in _CAUSAL_LM_CLASSES]
    if model_type is None:
        if named:
            return named[0]
        raise UnsupportedModelError(f"config.json names no supported model_type or architecture ({classes}); "
                                    f"Colibri exports {supported}")
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type in _REFUSED:
        raise UnsupportedModelError(f"model_type {model_type!r} needs {_REFUSED[model_type]}, which Colibri does "
                                    f"not run; Colibri exports {supported}")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; Colibri exports {supported}")
    if named and model_type not in named:
        raise _invalid(f"model_type {model_type!r} disagrees with architectures {classes}")
    return model_type


def translate_config(raw: dict[str, Any], generation: dict[str, Any], tensor_names: Collection[str],
                     dtype: str, expert_dtype: str) -> ModelConfig:
    """ModelConfig of a Hugging Face config.json (and generation_config.json) for the given storage dtypes.

    `tensor_names` settles the one option that legacy configs leave to the weights: Qwen2-MoE's qkv_bias.
    quantization_config is not read here: it says how the weights are stored (export/quantized_sources.py).
    """
    arch = detect_architecture(raw)
    if raw.get("per_layer_config") is not None:
        raise _unsupported("per_layer_config is set: per-layer configs are not supported")
    missing = [key for key in (*_REQUIRED_KEYS, _EXPERT_WIDTH_KEY[arch]) if raw.get(key) is None]
    count_keys = _EXPERT_COUNT_KEYS.get(arch, _DEFAULT_EXPERT_COUNT_KEYS)
    if all(raw.get(key) is None for key in count_keys):
        missing.append(count_keys[0])
    if missing:
        raise _invalid(f"{', '.join(missing)} missing: Colibri does not guess a model's shape "
                       "from transformers' defaults")
    if arch == "gpt_oss" and not _rope_parameters(raw):
        raw = dict(raw, rope_parameters=_GPT_OSS_ROPE)
    cfg = {**_DEFAULTS[arch], **raw}

    if cfg["hidden_act"] not in ("silu", "swish"):
        raise _unsupported(f"hidden_act {cfg['hidden_act']!r} is not supported (Colibri implements silu)")
    hidden = _int(cfg["hidden_size"], "hidden_size")
    num_layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    num_heads = _int(cfg["num_attention_heads"], "num_attention_heads")
    kv_heads = cfg["num_key_value_heads"]
    num_kv_heads = _int(num_heads if kv_heads is None else kv_heads, "num_key_value_heads")
    if num_heads % num_kv_heads:
        raise _invalid(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})")
    head_dim = _int(cfg["head_dim"] or hidden // num_heads, "head_dim")
    num_experts = _num_experts(raw, cfg, count_keys)
    top_k = _int(cfg["num_experts_per_tok"], "num_experts_per_tok")
    if top_k > num_experts:
        raise _invalid(f"num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")

    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_int(cfg["vocab_size"], "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        top_k=top_k,
        rope=_rope(raw, cfg),
        rotary_dim=_rotary_dim(raw, arch, head_dim),
        rms_norm_eps=_number(cfg["rms_norm_eps"], "rms_norm_eps"),
        tie_word_embeddings=_bool(cfg["tie_word_embeddings"], "tie_word_embeddings"),
        max_position_embeddings=_int(cfg["max_position_embeddings"], "max_position_embeddings"),
        dtype=dtype,
        expert_dtype=expert_dtype,
        **_special_tokens(cfg, generation),
    )
    if arch == "mixtral":
        fields.update(moe_intermediate_size=_int(cfg["intermediate_size"], "intermediate_size"),
                      moe_layers=tuple(range(num_layers)), norm_topk_prob=True,
                      sliding_windows=(_window(cfg["sliding_window"], "sliding_window"),) * num_layers)
    elif arch == "olmoe":
        if head_dim * num_heads != hidden:
            raise _unsupported(f"head_dim {head_dim} is not hidden_size / num_attention_heads; OLMoE's qk-norm spans "
                        "hidden_size, so transformers cannot run this config")
        if raw.get("sliding_window") is not None:
            raise _unsupported("sliding_window is not an OLMoE option "
                               "(transformers applies it only under flash attention)")
        clip, bias = cfg["clip_qkv"], _bool(cfg["attention_bias"], "attention_bias")
        fields.update(moe_intermediate_size=_int(cfg["intermediate_size"], "intermediate_size"),
                      moe_layers=tuple(range(num_layers)),
                      norm_topk_prob=_bool(cfg["norm_topk_prob"], "norm_topk_prob"),
                      qk_norm="full", qkv_bias=bias, o_bias=bias,
                      clip_qkv=None if clip is None else _number(clip, "clip_qkv"),
                      sliding_windows=(None,) * num_layers)
    elif arch == "gpt_oss":
        bias = _bool(cfg["attention_bias"], "attention_bias")
        layer_types = cfg["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(num_layers)]  # as GptOssConfig fills them in
        window = cfg["sliding_window"]
        fields.update(moe_intermediate_size=_int(cfg["intermediate_size"], "intermediate_size"),
                      moe_layers=tuple(range(num_layers)), norm_topk_prob=True, qkv_bias=bias, o_bias=bias,
                      attention_sinks=True, router_bias=True, expert_bias=True,
                      swiglu_limit=_number(cfg["swiglu_limit"], "swiglu_limit"),
                      swiglu_alpha=_number(cfg["swiglu_alpha"], "swiglu_alpha"),
                      sliding_windows=_windows_of_layer_types(layer_types, num_layers, window,
                                                              "sliding_window is null"))
    elif arch == "deepseek_v2":
        fields.update(_deepseek_v2_routing(cfg, num_layers))
        fields.update(_latent_attention(cfg, fields["rope"], _rope_parameters(raw), interleaved=True))
    elif arch in ("glm4_moe", "glm4_moe_lite", "minimax_m2", "deepseek_v3"):
        fields.update(_sigmoid_routed(arch, cfg, num_layers, tensor_names))
        if arch in ("deepseek_v3", "glm4_moe_lite"):
            fields.update(_latent_attention(cfg, fields["rope"], _rope_parameters(raw)))
    else:
        fields.update(_qwen_mlp(cfg, num_layers))
        if arch == "qwen2_moe":
            qkv_bias = cfg["qkv_bias"] if "qkv_bias" in raw else "model.layers.0.self_attn.q_proj.bias" in tensor_names
            fields.update(qkv_bias=_bool(qkv_bias, "qkv_bias"), sliding_windows=_qwen2_windows(cfg, num_layers))
            shared = _int(cfg["shared_expert_intermediate_size"], "shared_expert_intermediate_size", minimum=0)
            fields.update(shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
        else:
            use_sliding = _bool(cfg["use_sliding_window"], "use_sliding_window")
            window = _window(cfg["sliding_window"], "sliding_window") if use_sliding else None
            bias = _bool(cfg["attention_bias"], "attention_bias")
            fields.update(qk_norm="per_head", qkv_bias=bias, o_bias=bias,
                          sliding_windows=(window,) * num_layers)
    return ModelConfig(**fields)


def _num_experts(raw: dict[str, Any], cfg: dict[str, Any], keys: tuple[str, ...]) -> int:
    """The routed-expert count from whichever of `keys` config.json gives (transformers aliases them)."""
    given = {key: raw[key] for key in keys if raw.get(key) is not None}
    if len(set(given.values())) > 1:
        raise _invalid(" and ".join(f"{key} ({value})" for key, value in given.items()) + " disagree")
    value = next(iter(given.values()), cfg[keys[0]])
    if value == 0:
        raise _unsupported("num_experts is 0: the model has no routed experts, it is not a mixture of experts")
    return _int(value, "num_experts")


def _qwen_mlp(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen2/3-MoE: which layers are MoE blocks (the others use a dense MLP) and the widths."""
    step = _int(cfg["decoder_sparse_step"], "decoder_sparse_step")
    mlp_only = cfg["mlp_only_layers"] or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in mlp_only):
        raise _invalid(f"mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    moe_layers = tuple(layer for layer in range(num_layers) if layer not in mlp_only and (layer + 1) % step == 0)
    dense = len(moe_layers) < num_layers
    return dict(moe_layers=moe_layers,
                moe_intermediate_size=_int(cfg["moe_intermediate_size"], "moe_intermediate_size"),
                intermediate_size=_int(cfg["intermediate_size"], "intermediate_size") if dense else 0,
                norm_topk_prob=_bool(cfg["norm_topk_prob"], "norm_topk_prob"))


def _sigmoid_routed(arch: str, cfg: dict[str, Any], num_layers: int,
                    tensor_names: Collection[str]) -> dict[str, Any]:
    """GLM-4.5, MiniMax-M2 and DeepSeek-V3: sigmoid scores with a correction bias for the choice. GLM-4.5 and
    DeepSeek-V3 add the groups, renormalisation and scaling of their config, an ungated shared expert of
    n_shared_experts routed widths and dense first layers (GLM-4.5 also optional per-head qk-norm and q/k/v
    biases); MiniMax-M2 renormalises always and has RMSNorm over the whole q and k projections."""
    fields: dict[str, Any] = dict(router_scoring="sigmoid", sliding_windows=(None,) * num_layers)
    if arch == "minimax_m2":
        _refuse_other_values(cfg, dict(scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer",
                                       shared_intermediate_size=0), "MiniMax-M2")
        if any(kind != 1 for kind in cfg.get("attn_type_list") or []):
            raise _unsupported("attn_type_list names linear-attention layers (type 0); Colibri runs full "
                               "attention (type 1) only")
        moe_layers = tuple(range(num_layers))
        fields.update(moe_intermediate_size=_int(cfg["intermediate_size"], "intermediate_size"),
                      moe_layers=moe_layers, norm_topk_prob=True, qk_norm="full")
        bias_names = ("mlp.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias")
    else:
        moe_layers = (_glm_lite_moe_layers(cfg, num_layers) if arch == "glm4_moe_lite"
                      else _leading_dense(cfg, num_layers))
        n_group = _int(cfg["n_group"], "n_group")
        topk_group = _int(cfg["topk_group"], "topk_group")
        if arch == "deepseek_v3":
            _refuse_other_values(cfg, _DEEPSEEK_ROUTING, "transformers' DeepSeek-V3")
        if arch == "glm4_moe":
            fields.update(qk_norm="per_head" if _bool(cfg["use_qk_norm"], "use_qk_norm") else "none",
                          qkv_bias=_bool(cfg["attention_bias"], "attention_bias"))
        fields.update(_moe_widths(cfg, moe_layers, num_layers),
                      norm_topk_prob=_bool(cfg["norm_topk_prob"], "norm_topk_prob"),
                      n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=_number(cfg["routed_scaling_factor"], "routed_scaling_factor"))
        bias_names = ("mlp.gate.e_score_correction_bias",)
    # transformers starts the bias at zero and loads it where the checkpoint has one: absent, it chooses by score
    fields["score_correction_bias"] = bool(moe_layers) and any(
        f"model.layers.{moe_layers[0]}.{name}" in tensor_names for name in bias_names)
    return fields


def _leading_dense(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The MoE layers of a family whose first first_k_dense_replace layers are dense (GLM-4.5, DeepSeek-V2/V3)."""
    dense_first = min(_int(cfg["first_k_dense_replace"], "first_k_dense_replace", minimum=0), num_layers)
    return tuple(range(dense_first, num_layers))


def _moe_widths(cfg: dict[str, Any], moe_layers: tuple[int, ...], num_layers: int) -> dict[str, Any]:
    """The MoE layers and the widths of GLM's and DeepSeek's MLPs: routed experts of moe_intermediate_size, an
    ungated shared expert of n_shared_experts routed widths, dense layers (where some are) of intermediate_size."""
    width = _int(cfg["moe_intermediate_size"], "moe_intermediate_size")
    return dict(moe_layers=moe_layers, moe_intermediate_size=width,
                intermediate_size=(_int(cfg["intermediate_size"], "intermediate_size")
                                   if len(moe_layers) < num_layers else 0),
                shared_expert_intermediate_size=width * _int(cfg["n_shared_experts"], "n_shared_experts", minimum=0))


def _glm_lite_moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """GLM-4.7-Flash's MoE layers: those `mlp_layer_types` names "sparse" (the others "dense"); absent, every
    layer but the first, as Glm4MoeLiteConfig fills it in. transformers reads no first_k_dense_replace for this
    family, so one that names another split than the one computed is refused."""
    kinds = cfg["mlp_layer_types"]
    if kinds is None:
        kinds = ["dense"] + ["sparse"] * (num_layers - 1)
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
        raise _invalid(f"mlp_layer_types must list \"dense\" or \"sparse\" for each of the {num_layers} layers, "
                       f"got {kinds!r}")
    moe_layers = tuple(layer for layer, kind in enumerate(kinds) if kind == "sparse")
    first_dense = cfg.get("first_k_dense_replace")
    if first_dense is not None and moe_layers != tuple(range(min(first_dense, num_layers), num_layers)):
        raise _unsupported(f"first_k_dense_replace {first_dense!r} disagrees with mlp_layer_types {kinds} "
                           "(transformers computes the layer types)")
    return moe_layers


def _deepseek_v2_routing(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek-V2 (and -Lite, Coder-V2): a softmax over the routed experts, the top_k best taken as they are (no
    renormalisation: transformers reads no norm_topk_prob for this family) times routed_scaling_factor, with
    topk_method group_limited_greedy only from the topk_group groups whose best score is highest; n_shared_experts
    ungated shared experts of the routed width; the first first_k_dense_replace layers dense. The authors' keys
    that would compute otherwise are refused."""
    _refuse_other_values(cfg, dict(scoring_func="softmax", moe_layer_freq=1, norm_topk_prob=False, mlp_bias=False),
                         "transformers' DeepSeek-V2")
    method = cfg["topk_method"]
    if method not in ("greedy", "group_limited_greedy"):
        raise _unsupported(f"topk_method {method!r} is not supported (DeepSeek-V2 routes by greedy or "
                           "group_limited_greedy)")
    fields: dict[str, Any] = {}
    if method == "group_limited_greedy":
        fields.update(n_group=_int(cfg["n_group"], "n_group"), topk_group=_int(cfg["topk_group"], "topk_group"),
                      group_ranking="max")
    return dict(fields, **_moe_widths(cfg, _leading_dense(cfg, num_layers), num_layers), router_scoring="softmax",
                norm_topk_prob=False,
                routed_scaling_factor=_number(cfg["routed_scaling_factor"], "routed_scaling_factor"),
                sliding_windows=(None,) * num_layers)


def _refuse_other_values(cfg: dict[str, Any], computed: dict[str, Any], model: str) -> None:
    """UnsupportedModelError for the first key of `computed` that config.json sets to another value than the one
    `model` computes with (whatever the key says)."""
    for key, value in computed.items():
        if cfg.get(key, value) != value:
            raise _unsupported(f"{key} {cfg[key]!r} is not supported ({model} computes {value!r})")


def _latent_attention(cfg: dict[str, Any], rope: RopeConfig, rope_parameters: dict[str, Any],
                      interleaved: bool | None = None) -> dict[str, Any]:
    """DeepSeek-V2/V3's Multi-head Latent Attention: query and key heads of qk_nope_head_dim + qk_rope_head_dim
    (the rope part last), the latent, and the softmax scale's mscale_all_dim correction (squared, as DeepSeek
    applies it) under any rope type but the default, as transformers' yarn_apply_mscale applies it. `interleaved`:
    the rope pairing where the family fixes it (DeepSeek-V2 rotates adjacent pairs as complex numbers), else the
    config's rope_interleave."""
    if _bool(cfg["attention_bias"], "attention_bias"):
        raise _unsupported("attention_bias is not supported with Multi-head Latent Attention")
    nope = _int(cfg["qk_nope_head_dim"], "qk_nope_head_dim")
    rope_dim = _int(cfg["qk_rope_head_dim"], "qk_rope_head_dim")
    scale = (nope + rope_dim) ** -0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    if rope.type != "default" and mscale_all_dim:
        scale *= yarn_mscale(rope.factor, _number(mscale_all_dim, "mscale_all_dim")) ** 2
    q_rank = cfg["q_lora_rank"]
    return dict(attention="mla", head_dim=nope + rope_dim, rotary_dim=rope_dim,
                num_kv_heads=_int(cfg["num_attention_heads"], "num_attention_heads"),
                q_lora_rank=0 if q_rank is None else _int(q_rank, "q_lora_rank"),
                kv_lora_rank=_int(cfg["kv_lora_rank"], "kv_lora_rank"),
                v_head_dim=_int(cfg["v_head_dim"], "v_head_dim"),
                rope_interleave=(_bool(cfg["rope_interleave"], "rope_interleave") if interleaved is None
                                 else interleaved), softmax_scale=scale,
                latent_norm_eps=_LATENT_NORM_EPS)


def multi_token_prediction_layers(raw: dict[str, Any]) -> range:
    """The layer indices after the decoder's that hold GLM-4.5's, GLM-4.7-Flash's and DeepSeek-V3's
    multi-token-prediction modules (not exported)."""
    arch = detect_architecture(raw)
    if arch not in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
        return range(0)
    cfg = {**_DEFAULTS[arch], **raw}
    count = _int(cfg["num_nextn_predict_layers"], "num_nextn_predict_layers", minimum=0)
    layers = _int(cfg["num_hidden_layers"], "num_hidden_layers")
    return range(layers, layers + count)


def _window(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _unsupported(f"{key} {value!r} is not a usable attention window (a positive number of tokens or null)")
    return value


def _qwen2_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen2-MoE: per-layer windows from layer_types, computed the way Qwen2MoeConfig does when absent."""
    use_sliding = _bool(cfg["use_sliding_window"], "use_sliding_window")
    layer_types = cfg["layer_types"]
    if layer_types is None:
        max_window_layers = _int(cfg["max_window_layers"], "max_window_layers", minimum=0)
        sliding = [use_sliding and (i + 1) % 2 == 1 and i < max_window_layers for i in range(num_layers)]
        layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    # Qwen2MoeConfig sets sliding_window to 0 unless use_sliding_window: such a layer would see nothing.
    window = cfg["sliding_window"] if use_sliding else None
    return _windows_of_layer_types(layer_types, num_layers, window,
                                   "sliding_window is null" if use_sliding else "use_sliding_window is false")


def _windows_of_layer_types(layer_types: Any, num_layers: int, window: Any,
                            no_window_reason: str) -> tuple[int | None, ...]:
    """Per-layer windows: `window` for each sliding_attention layer (refused with `no_window_reason` when None),
    None for the full-attention ones."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise _invalid(f"layer_types must list one type per layer ({num_layers})")
    windows: list[int | None] = []
    for layer, kind in enumerate(layer_types):
        if kind in ("full_attention", "attention"):
            windows.append(None)
        elif kind == "sliding_attention":
            if window is None:
                raise _unsupported(f"layer_types makes layer {layer} sliding_attention but {no_window_reason}, "
                                   "leaving it no window")
            windows.append(_window(window, "sliding_window"))
        else:
            raise _unsupported(f"layer type {kind!r} (layer {layer}) is not supported "
                               "(full_attention, sliding_attention)")
    return tuple(windows)


def _rope_parameters(raw: dict[str, Any]) -> Any:
    """config.json's rope parameters: the legacy rope_scaling where it has one (transformers prefers it), else v5's
    rope_parameters; {} for neither."""
    return raw.get("rope_scaling") or raw.get("rope_parameters") or {}


def _rope(raw: dict[str, Any], cfg: dict[str, Any]) -> RopeConfig:
    """RopeConfig from v5 rope_parameters or legacy rope_theta + rope_scaling, as transformers standardises them."""
    params = _rope_parameters(raw)
    if not isinstance(params, dict):
        raise _invalid(f"rope parameters must be an object, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise _unsupported("per-layer-type rope parameters are not supported")
    theta = params.get("rope_theta")
    theta = _number(cfg["rope_theta"] if theta is None else theta, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _unsupported(f"rope type {rope_type!r} is not supported (Colibri implements {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return RopeConfig(type="default", theta=theta)

    def required(key: str) -> Any:
        if key not in params:
            raise _invalid(f"{rope_type} rope parameters lack {key}")
        return params[key]

    def optional(key: str) -> float | None:
        return None if params.get(key) is None else _number(params[key], key)

    def mscale(key: str) -> float | None:  # transformers takes 0 as absent
        return None if params.get(key) == 0 else optional(key)

    if rope_type == "linear":
        return RopeConfig(type="linear", theta=theta, factor=_number(required("factor"), "factor"))
    # transformers prefers a top-level original_max_position_embeddings, then the rope one, then the model's maximum
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = _int(original or cfg["max_position_embeddings"], "original_max_position_embeddings")
    if rope_type == "llama3":
        return RopeConfig(type="llama3", theta=theta, factor=_number(required("factor"), "factor"),
                          original_max_position_embeddings=original,
                          low_freq_factor=_number(required("low_freq_factor"), "low_freq_factor"),
                          high_freq_factor=_number(required("high_freq_factor"), "high_freq_factor"))
    factor = required("factor")
    factor = cfg["max_position_embeddings"] / original if factor is None else _number(factor, "factor")
    return RopeConfig(type="yarn", theta=theta, factor=factor, original_max_position_embeddings=original,
                      attention_factor=optional("attention_factor"), beta_fast=optional("beta_fast"),
                      beta_slow=optional("beta_slow"), mscale=mscale("mscale"), mscale_all_dim=mscale("mscale_all_dim"),
                      truncate=_bool(params.get("truncate", True), "truncate"))


def _rotary_dim(raw: dict[str, Any], arch: str, head_dim: int) -> int | None:
    """The leading dimensions of each head that rotary embedding rotates (None: all), from partial_rotary_factor
    (in the rope parameters or at the top level), MiniMax-M2's rotary_dim, or GLM-4.5's default."""
    params = _rope_parameters(raw)
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None and arch == "minimax_m2" and raw.get("rotary_dim") is not None:
        factor = _int(raw["rotary_dim"], "rotary_dim") / head_dim
    if factor is None:
        factor = _GLM_PARTIAL_ROTARY_FACTOR if arch == "glm4_moe" else 1.0
    factor = _number(factor, "partial_rotary_factor")
    if factor == 1:
        return None
    if arch not in ("glm4_moe", "minimax_m2"):
        raise _unsupported(f"partial_rotary_factor {factor:g} is not an option of {arch} "
                           "(its rotary embedding spans the whole head)")
    dims = int(head_dim * factor)  # as transformers rounds it
    if not 0 < dims <= head_dim or dims % 2:
        raise _unsupported(f"partial_rotary_factor {factor:g} rotates {dims} of head_dim {head_dim} dimensions; "
                           "Colibri rotates an even number of them, at least 2")
    return dims


def _special_tokens(cfg: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """bos, eos and pad ids: generation_config.json's where it sets them (as transformers' generate does); an
    invalid id names the file it came from."""
    def ids(key: str) -> tuple[int, ...]:
        if generation.get(key) is not None:
            return _token_ids(generation[key], key, "generation_config.json")
        return _token_ids(cfg[key], key, "config.json")

    bos, pad = ids("bos_token_id"), ids("pad_token_id")
    if len(bos) > 1 or len(pad) > 1:
        raise _invalid("bos_token_id and pad_token_id must be single ids")
    return dict(bos_token_id=bos[0] if bos else None, pad_token_id=pad[0] if pad else None,
                eos_token_ids=ids("eos_token_id"))
