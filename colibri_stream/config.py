"""Frozen configuration dataclasses.

`ModelConfig` is the `config.json` of a native model folder: the minimal complete description of the computation.
It is validated when built and rejects unknown keys, so a folder written by a newer exporter, or edited by hand,
fails loudly instead of computing something else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ConfigError
from .field_types import type_error

FORMAT_VERSION = 1
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "glm4_moe_lite", "minimax_m2", "deepseek_v2",
                 "deepseek_v3", "gpt_oss")
STORAGE_DTYPES = ("float32", "bfloat16", "float16")
EXPERT_DTYPES = STORAGE_DTYPES + ("int8", "int4", "fp8", "mxfp4")  # expert_codecs.py: one codec each
INT4_GROUP_SIZES = (32, 64, 128)  # int4: input channels per scale
MXFP4_BLOCK = 32  # mxfp4: input channels per shared exponent (OCP Microscaling), which must divide H and I
FP8_SCALES = ("block", "channel")  # fp8: a scale per 128 x 128 tile, or per output channel
EXPERT_FORMAT_FIELDS = {"int4": ("expert_group_size", "expert_zero_point"), "fp8": ("expert_scales",)}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
QK_NORMS = ("none", "per_head", "full")
ROUTER_SCORINGS = ("softmax", "sigmoid")
# how a group of experts ranks for group-limited routing: the sum of its two best scores (DeepSeek-V3, GLM-4.5), or
# its best score (DeepSeek-V2's group_limited_greedy)
GROUP_RANKINGS = ("top2_sum", "max")
ATTENTIONS = ("gqa", "mla")  # grouped-query attention | Multi-head Latent Attention (model/transformer.py)
# Upper bounds of config.json's sizes, far above every published model's (Llama 4 Scout: 10 M positions; vocabularies
# up to 262 144; hidden sizes up to 18 432; 384 experts): a value past them is a corrupt or hostile file, refused
# before any table is allocated from it.
SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 18, "num_layers": 1 << 12, "num_heads": 1 << 12,
               "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "num_experts": 1 << 16, "top_k": 1 << 16,
               "moe_intermediate_size": 1 << 18, "intermediate_size": 1 << 18,
               "shared_expert_intermediate_size": 1 << 18, "max_position_embeddings": 1 << 24}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: the base and one of the scaling schemes these models use."""

    type: str = "default"  # default | linear | llama3 | yarn
    theta: float = 10000.0
    factor: float = 1.0  # linear, llama3, yarn: context stretch
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (defaults 32)
    beta_slow: float | None = None  # yarn (defaults 1)
    attention_factor: float | None = None  # yarn: scale on cos/sin (derived from factor when None)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise CheckpointError(f"config.json: rope {message}")

        if error := type_error(self):
            fail(error)
        if self.type not in ROPE_TYPES:
            fail(f"type {self.type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.theta <= 0 or self.factor <= 0:
            fail("theta and factor must be positive")
        if self.original_max_position_embeddings is not None and not (
                0 < self.original_max_position_embeddings <= SIZE_LIMITS["max_position_embeddings"]):
            fail(f"original_max_position_embeddings must be positive and at most "
                 f"{SIZE_LIMITS['max_position_embeddings']}, got {self.original_max_position_embeddings}")
        if self.type == "llama3" and None in (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        ):
            fail("llama3 needs low_freq_factor, high_freq_factor and original_max_position_embeddings")
        if self.type == "yarn" and self.original_max_position_embeddings is None:
            fail("yarn needs original_max_position_embeddings")


@dataclass(frozen=True)
class ClampedSwiglu:
    """The routed experts' clamped SwiGLU (ModelConfig.swiglu_limit, swiglu_alpha) in place of silu(gate) * up."""

    limit: float
    alpha: float


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to compute a model; written as `config.json` in the model folder."""

    architecture: str  # one of ARCHITECTURES (informational: the fields below define the computation)
    vocab_size: int
    hidden_size: int  # H
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # D of each query and key head (mla: head_dim - rotary_dim without rotary, then rotary_dim with)
    num_experts: int  # E routed experts per MoE layer
    top_k: int  # experts per token
    moe_intermediate_size: int  # I of one routed expert
    moe_layers: tuple[int, ...]  # layers whose MLP is a MoE block; the others use a dense MLP
    intermediate_size: int = 0  # dense MLP width for the non-MoE layers (0 when every layer is MoE)
    router_scoring: str = "softmax"  # softmax over all experts | sigmoid of each expert's logit; then top-k
    score_correction_bias: bool = False  # a per-expert bias [E] added to the scores for choosing experts only
    router_bias: bool = False  # a per-expert bias [E] added to the router's logits (choice and weights alike)
    n_group: int = 1  # experts in n_group equal groups; only the topk_group best groups are chosen from
    topk_group: int = 1
    group_ranking: str = "top2_sum"  # a group's rank (GROUP_RANKINGS): its two best scores summed, or its best
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (after renormalising)
    expert_bias: bool = False  # each routed expert adds gate_bias [I], up_bias [I], down_bias [H] (float32)
    swiglu_limit: float | None = None  # routed experts' clamped SwiGLU: (clip(up, +-limit) + 1) * g * sigmoid(alpha
    # g) with g = min(gate, limit); None: silu(gate) * up
    swiglu_alpha: float = 1.702
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # sigmoid(x @ w) scales the shared expert's output
    qk_norm: str = "none"  # none | per_head (RMSNorm over D) | full (RMSNorm over all heads' q and k)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None  # clamp q, k, v to [-c, c] after projection (and qk-norm)
    rotary_dim: int | None = None  # dimensions of each head rotary embedding rotates (gqa: the leading ones; mla:
    # the last, its rope part); None: all D
    rope_interleave: bool = False  # rotary pairs dimensions (2i, 2i + 1) of the rotated part, not (i, i + R/2)
    attention: str = "gqa"  # gqa: q, k, v projections, K heads cached | mla: a latent and a rope key cached per token
    q_lora_rank: int = 0  # mla: width of the query's low-rank path (q_a_proj, q_a_norm, q_b_proj); 0: one q_proj
    kv_lora_rank: int = 0  # mla: width R of the latent, expanded to each head's keys and values by kv_b_proj
    v_head_dim: int = 0  # mla: width of each head's value
    latent_norm_eps: float = 1e-6  # mla: RMSNorm epsilon of q_a_norm and kv_a_norm (the other norms: rms_norm_eps)
    softmax_scale: float | None = None  # attention logits' scale; None: head_dim ** -0.5
    attention_sinks: bool = False  # a learned logit per query head and layer in the softmax denominator
    sliding_windows: tuple[int | None, ...] = ()  # per layer: window in tokens, None for full attention
    rope: RopeConfig = field(default_factory=RopeConfig)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"  # storage dtype of dense.safetensors
    expert_dtype: str = "bfloat16"  # format of routed experts in experts.bin (expert_codecs.py)
    expert_group_size: int = 0  # int4: input channels per scale (INT4_GROUP_SIZES); 0 for other formats
    expert_zero_point: bool = False  # int4: asymmetric, a zero point per group
    expert_scales: str = ""  # fp8: FP8_SCALES; "" for other formats
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dense_file: str = "dense.safetensors"
    experts_file: str = "experts.bin"
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise CheckpointError(f"config.json: {message}")

        if error := type_error(self):
            fail(error)
        if self.format_version != FORMAT_VERSION:
            fail(f"format_version {self.format_version} is not supported (this Colibri reads {FORMAT_VERSION})")
        if self.architecture not in ARCHITECTURES:
            fail(f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                fail(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) < 0:
                fail(f"{name} must not be negative, got {getattr(self, name)!r}")
        for name, limit in SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                fail(f"{name} {getattr(self, name)} is beyond any model this engine runs (at most {limit})")
        if self.head_dim % 2:
            fail(f"head_dim ({self.head_dim}) must be even: rotary embedding rotates pairs of dimensions")
        token_ids = {"bos_token_id": (self.bos_token_id,), "pad_token_id": (self.pad_token_id,),
                     "eos_token_ids": self.eos_token_ids}
        for name, ids in token_ids.items():
            if any(token is not None and token < 0 for token in ids):
                fail(f"{name} must not be negative, got {getattr(self, name)!r}")
        for name in ("dense_file", "experts_file"):
            file = getattr(self, name)
            if Path(file).name != file or file in ("", ".."):
                fail(f"{name} {file!r} is not a file name inside the model folder")
        if self.num_heads % self.num_kv_heads:
            fail(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            fail(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if any(not 0 <= layer < self.num_layers for layer in self.moe_layers) or list(self.moe_layers) != sorted(
            set(self.moe_layers)
        ):
            fail(f"moe_layers must be increasing layer indices below {self.num_layers}")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            fail("intermediate_size must be positive when some layers use a dense MLP")
        if self.router_scoring not in ROUTER_SCORINGS:
            fail(f"router_scoring {self.router_scoring!r} is not one of {', '.join(ROUTER_SCORINGS)}")
        if self.n_group <= 0 or self.num_experts % self.n_group:
            fail(f"n_group ({self.n_group}) must be a positive divisor of num_experts ({self.num_experts})")
        if self.group_ranking not in GROUP_RANKINGS:
            fail(f"group_ranking {self.group_ranking!r} is not one of {', '.join(GROUP_RANKINGS)}")
        if self.n_group > 1 and self.group_ranking == "top2_sum" and self.num_experts // self.n_group < 2:
            fail(f"groups of experts are ranked by their two best scores: n_group {self.n_group} leaves fewer than "
                 "two experts a group")
        if not 0 < self.topk_group <= self.n_group:
            fail(f"topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            fail(f"top_k ({self.top_k}) exceeds the experts of the topk_group ({self.topk_group}) groups chosen")
        if self.routed_scaling_factor <= 0:
            fail(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor!r}")
        if self.attention not in ATTENTIONS:
            fail(f"attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.attention == "mla":
            if self.kv_lora_rank <= 0 or self.v_head_dim <= 0 or self.q_lora_rank < 0:
                fail("mla needs a positive kv_lora_rank and v_head_dim and a q_lora_rank of 0 or more")
            if self.rotary_dim is None or self.rotary_dim >= self.head_dim:
                fail("mla needs a rotary_dim below head_dim (the rope part of each query and key head)")
            if self.qk_norm != "none" or self.qkv_bias or self.o_bias or self.clip_qkv is not None:
                fail("mla has no qk_norm, attention biases or clip_qkv")
            if self.attention_sinks:
                fail("mla has no attention sinks")
            if any(w is not None for w in self.sliding_windows):
                fail("mla attends to the whole context: sliding windows are gqa's")
        elif self.q_lora_rank or self.kv_lora_rank or self.v_head_dim or self.rope_interleave:
            fail("q_lora_rank, kv_lora_rank, v_head_dim and rope_interleave are options of mla attention")
        if self.softmax_scale is not None and self.softmax_scale <= 0:
            fail(f"softmax_scale must be positive or null, got {self.softmax_scale!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            fail(f"rotary_dim ({self.rotary_dim}) must be a positive even number of at most head_dim "
                 f"({self.head_dim})")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            fail("shared_expert_gate needs a shared expert")
        if self.qk_norm not in QK_NORMS:
            fail(f"qk_norm {self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if len(self.sliding_windows) != self.num_layers:
            fail(f"sliding_windows needs one entry per layer ({self.num_layers}), got {len(self.sliding_windows)}")
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            fail("sliding windows must be positive or null")
        if self.hidden_act != "silu":
            fail(f"hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.dtype not in STORAGE_DTYPES:
            fail(f"dtype {self.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
        if self.expert_dtype not in EXPERT_DTYPES:
            fail(f"expert_dtype {self.expert_dtype!r} is not one of {', '.join(EXPERT_DTYPES)}")
        int4, fp8 = self.expert_dtype == "int4", self.expert_dtype == "fp8"
        if int4 and self.expert_group_size not in INT4_GROUP_SIZES:
            fail(f"int4 experts need expert_group_size {' or '.join(map(str, INT4_GROUP_SIZES))}, "
                 f"got {self.expert_group_size}")
        if not int4 and (self.expert_group_size or self.expert_zero_point):
            fail(f"expert_group_size and expert_zero_point are int4's; experts are {self.expert_dtype}")
        if fp8 and self.expert_scales not in FP8_SCALES:
            fail(f"fp8 experts need expert_scales {' or '.join(FP8_SCALES)}, got {self.expert_scales!r}")
        if not fp8 and self.expert_scales:
            fail(f"expert_scales is fp8's; experts are {self.expert_dtype}")
        if self.expert_dtype == "mxfp4" and (self.hidden_size % MXFP4_BLOCK
                                             or self.moe_intermediate_size % MXFP4_BLOCK):
            fail(f"mxfp4 experts need hidden_size and moe_intermediate_size multiples of {MXFP4_BLOCK}, got "
                 f"{self.hidden_size} and {self.moe_intermediate_size}")
        if self.rms_norm_eps <= 0 or self.latent_norm_eps <= 0:
            fail("rms_norm_eps and latent_norm_eps must be positive")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            fail("clip_qkv must be positive or null")
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            fail("swiglu_limit must be positive or null")

    def clamped_swiglu(self) -> ClampedSwiglu | None:
        """The routed experts' clamped SwiGLU, None where they compute silu(gate) * up."""
        return None if self.swiglu_limit is None else ClampedSwiglu(self.swiglu_limit, self.swiglu_alpha)

    def plain_experts(self) -> bool:
        """Whether the routed experts compute silu(gate) * up without biases (gpt-oss's do not)."""
        return not self.expert_bias and self.swiglu_limit is None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        # A format's parameters only where the format has them: config.json of the others stays as it was
        for name in sum(EXPERT_FORMAT_FIELDS.values(), ()):
            if name not in EXPERT_FORMAT_FIELDS.get(self.expert_dtype, ()):
                del data[name]
        data["format"] = "colibri"
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; unknown or missing keys are errors."""
        if not isinstance(data, dict):
            raise CheckpointError("config.json: expected a JSON object")
        data = dict(data)
        if data.pop("format", None) != "colibri":
            raise CheckpointError('config.json: not a Colibri model folder (missing "format": "colibri"); '
                                  "convert a Hugging Face checkpoint with `colibri export`")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CheckpointError(f"config.json: unknown keys {unknown}")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise CheckpointError(f"config.json: missing keys {missing}")
        rope = data.get("rope", {})
        if not isinstance(rope, dict):
            raise CheckpointError("config.json: rope must be an object")
        rope_known = {f.name for f in dataclasses.fields(RopeConfig)}
        if set(rope) - rope_known:
            raise CheckpointError(f"config.json: unknown rope keys {sorted(set(rope) - rope_known)}")
        data["rope"] = RopeConfig(**rope)
        for name in ("moe_layers", "sliding_windows", "eos_token_ids"):
            if name in data:
                if not isinstance(data[name], list):
                    raise CheckpointError(f"config.json: {name} must be a list")
                data[name] = tuple(data[name])
        return cls(**data)



# The token budget of one step where none is given, by device: on a GPU a prefill chunk of 8192 tokens reads each
# MoE layer's expert weights once for four times the tokens of 2048 (vLLM's and SGLang's default chunk on large
# GPUs is 8192 too); on the CPU a step's latency grows with its tokens, and its products gain little past 2048.
DEFAULT_STEP_TOKENS = {"cuda": 8192, "cpu": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on, and how long sequences may grow."""

    max_batch_size: int = 32  # sequences scheduled in one step
    # token budget of one step, shared by decodes and prefill chunks; None: DEFAULT_STEP_TOKENS of the engine's
    # device (`on_device`)
    max_num_batched_tokens: int | None = None
    max_seq_len: int | None = None  # prompt + output tokens of one sequence; None: the model's maximum
    max_queue: int = 0  # waiting requests before new ones are refused; 0: unbounded

    def __post_init__(self) -> None:
        _check_positive_int("max_batch_size", self.max_batch_size)
        if self.max_num_batched_tokens is not None:
            _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
            if self.max_num_batched_tokens < self.max_batch_size:
                raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                                  f"max_batch_size ({self.max_batch_size}) so that every running sequence can "
                                  "decode")
        if self.max_seq_len is not None:
            _check_positive_int("max_seq_len", self.max_seq_len)
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be a non-negative integer, got {self.max_queue!r}")

    def on_device(self, device: str) -> SchedulerConfig:
        """This config with a step's token budget: the one given, else DEFAULT_STEP_TOKENS of `device` ("cpu" or
        "cuda"; at least max_batch_size)."""
        if self.max_num_batched_tokens is not None:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=max(DEFAULT_STEP_TOKENS[device],
                                                                    self.max_batch_size))


KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp32")  # --kv-cache-dtype; auto: fp16 for fp16 models, else bf16


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, element type, and its size: a block count, a memory budget (give one at
    most), or by default what memory is left (kv_budget.py: a share of the GPU after the weights under
    gpu_memory_utilization, a share of available host RAM on the CPU)."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose tokens (and all before) match
    kv_cache_dtype: str = "auto"  # auto | bf16 | fp16 | fp8 | fp32 (model/paged_kv.py)
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may hold, KV cache included
    # sliding-window layers keep only each sequence's last window, in a pool of their own (kv_cache.py); False: the
    # whole context, as the other layers
    sliding_window_pool: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        for name in ("num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("enable_prefix_caching", "sliding_window_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError("give num_kv_blocks or kv_cache_memory, not both")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        utilization = self.gpu_memory_utilization
        if (not isinstance(utilization, (int, float)) or isinstance(utilization, bool)
                or not 0 < utilization <= 1):
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")


EVICTION_POLICIES = ("lru", "lfu", "pinned")
MATMUL_PRECISIONS = ("high", "medium")  # EngineConfig.matmul_precision
CPU_EXPERT_MODES = ("auto", "off", "all")
GPU_SLOT_LAYOUTS = ("spread", "layers")  # experts/slots.py: layer_slot_counts


@dataclass(frozen=True)
class ExpertStoreConfig:
    """Where routed experts live (colibri_stream/experts/): memory budgets of the tiers, eviction and prefetch.

    Without budgets every expert stays resident. `gpu_memory_limit` (bytes) bounds the GPU memory of the dense
    weights plus the expert slots (the KV cache is separate); `l2_cache_size` (bytes) bounds the host slots in
    front of experts.bin. `usage_file` holds routing statistics: the pinned policy ranks experts by it (default:
    expert_usage.json in the model folder), and when given, this run's routes are added to it. `routing_trace`
    records every step's routing as JSON lines.
    """

    gpu_memory_limit: int | None = None
    l2_cache_size: int | None = None
    eviction_policy: str = "lfu"  # lru | lfu (decayed frequency) | pinned (ranked by usage_file)
    prefetch: bool = False  # predict the next layers' experts with their routers and load them ahead (off: on a
    # warm page cache with 2 cores it raised hit rates but slowed decode; BENCHMARKS.md)
    prefetch_lookahead: int = 1  # MoE layers predicted ahead
    usage_file: str | None = None
    routing_trace: str | None = None
    cpu_experts: str = "auto"  # GPU tier misses: auto (the cost model picks CPU compute, a load, or a cut by rows
    # between them, per expert and step), off (always load to the GPU), all (always compute on the CPU)
    gpu_slot_layout: str = "spread"  # spread (every layer the same GPU slots) | layers (whole layers on the GPU)
    cpu_threads: int | None = None  # threads computing routed experts on the CPU (None: every core; beside GPU slots
    # every core but one, which the thread driving the GPU keeps)

    def __post_init__(self) -> None:
        if self.cpu_experts not in CPU_EXPERT_MODES:
            raise ConfigError(f"cpu_experts must be one of {', '.join(CPU_EXPERT_MODES)}, got {self.cpu_experts!r}")
        for name in ("gpu_memory_limit", "l2_cache_size", "cpu_threads"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.gpu_slot_layout not in GPU_SLOT_LAYOUTS:
            raise ConfigError(f"gpu_slot_layout must be one of {', '.join(GPU_SLOT_LAYOUTS)}, "
                              f"got {self.gpu_slot_layout!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                              f"got {self.eviction_policy!r}")
        _check_positive_int("prefetch_lookahead", self.prefetch_lookahead)
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"prefetch must be a boolean, got {self.prefetch!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from: the model folder, where to run it, the scheduler, the KV cache and the
    expert store."""

    model: str  # path of a native model folder
    device: str = "auto"  # cpu | auto (a GPU when one is usable); checked by the model loader
    verify: bool = False  # check the checkpoint's checksums when loading
    cuda_graphs: bool = True  # decode steps as CUDA graphs where they can be (off: every step launched eagerly)
    # GPU products on tensor cores (cuBLAS projections, prefill's expert GEMMs and attention): medium takes float32
    # activations as one bf16/fp16 part (about 1e-3, as engines with bf16 activations compute; the shipped model's
    # held-out perplexity moves by 2.5e-5 of itself), high as two (about 1e-5 of float32, twice the work); the
    # NumPy backend computes float32 either way (backends/cublas_gemm.py)
    matmul_precision: str = "medium"
    # Decode steps (greedy rows, draws over the whole vocabulary) scheduled and launched one step ahead of reading
    # their tokens (scheduler.schedule_next).
    # None: where decode steps are CUDA graphs (the GPU then never waits for the host between steps). True on the
    # NumPy backend runs the same scheduling with nothing to overlap.
    async_scheduling: bool | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    experts: ExpertStoreConfig = field(default_factory=ExpertStoreConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be a boolean, got {self.cuda_graphs!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ConfigError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                              f"got {self.matmul_precision!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be a boolean or None, got {self.async_scheduling!r}")

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """Build from flat options (`max_batch_size=8, block_size=32, device="cpu"`); unknown ones are errors."""
        groups = {sub: {f.name for f in dataclasses.fields(sub)}
                  for sub in (SchedulerConfig, CacheConfig, ExpertStoreConfig)}
        own = {"device", "verify", "cuda_graphs", "async_scheduling", "matmul_precision"}
        unknown = sorted(set(options) - own - set().union(*groups.values()))
        if unknown:
            raise ConfigError(f"unknown engine options {unknown}")
        subs = {sub: sub(**{k: v for k, v in options.items() if k in names}) for sub, names in groups.items()}
        return cls(model=model, scheduler=subs[SchedulerConfig], cache=subs[CacheConfig],
                   experts=subs[ExpertStoreConfig], **{k: v for k, v in options.items() if k in own})


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
