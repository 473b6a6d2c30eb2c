"""The one model definition for every supported architecture: a decoder of attention and (MoE or dense) MLP layers.

Architectures differ only through ModelConfig fields (grouped-query or latent attention, qk-norm kind, biases,
clipping, attention sinks, shared experts, sliding windows, dense layers, partial rotary; the router's scoring,
logit bias, correction bias, groups, renormalisation and scaling), never through branches on the architecture
name. Every array operation goes through the backend, so the same code runs on NumPy and CuPy. A layer reads the
KV cache's pool that holds it: the sliding-window layers' own (with their tables) where the cache has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.base import Array, Backend
from ..checkpoint import DenseFile
from ..config import ModelConfig
from ..experts.expert_parallel import ExpertParallelRank, shard_config
from ..experts.store import ExpertStore
from ..timing import StepTimer
from ..batch import ForwardBatch
from .paged_kv import PagedKVCache, SlidingLayers, resolve_kv_dtype
from .rope import cos_sin_table

BATCH_FIELDS = ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                "logits_indices")
SLIDING_FIELDS = ("sliding_block_tables", "sliding_slot_mapping")  # a batch's, where the cache has a sliding pool


@dataclass
class MLPWeights:
    """A SiLU-gated MLP: down(silu(gate x) * up x)."""

    gate_proj: Array  # [I, H]
    up_proj: Array  # [I, H]
    down_proj: Array  # [H, I]


@dataclass
class LatentAttentionWeights:
    """Multi-head Latent Attention's own weights (the query's low-rank path when it has one, the latent's
    projection and norm, and kv_b_proj split per head into the key and value up-projections that attention absorbs
    into its query and output sides). R latent width, r rope width, N = D - r, Dv value width."""

    kv_a_proj: Array  # [R + r, H]: the latent, then the rope key
    kv_a_norm: Array  # [R]
    k_up: Array  # [Q, R, N]: a head's query without rotary -> its query over the latent
    v_up: Array  # [Q, Dv, R]: a head's attention output over the latent -> its value
    q_a_proj: Array | None = None  # [q_lora_rank, H]
    q_a_norm: Array | None = None  # [q_lora_rank]
    q_b_proj: Array | None = None  # [Q*D, q_lora_rank]


@dataclass
class LayerWeights:
    """Dense weights of one decoder layer; optional parts are None when the config has none."""

    input_norm: Array  # [H]
    o_proj: Array  # [H, Q*D] (mla: [H, Q*Dv])
    post_attention_norm: Array  # [H]
    q_proj: Array | None = None  # [Q*D, H] (mla: without a low-rank query)
    k_proj: Array | None = None  # [K*D, H] (gqa)
    v_proj: Array | None = None  # [K*D, H] (gqa)
    latent: LatentAttentionWeights | None = None  # mla
    q_bias: Array | None = None  # [Q*D]
    k_bias: Array | None = None  # [K*D]
    v_bias: Array | None = None  # [K*D]
    o_bias: Array | None = None  # [H]
    sinks: Array | None = None  # [Q]: each head's logit in its attention softmax denominator
    q_norm: Array | None = None  # [D] per head, or [Q*D] over the whole projection
    k_norm: Array | None = None  # [D] or [K*D]
    router: Array | None = None  # [E, H] (MoE layers)
    router_bias: Array | None = None  # [E]: added to the router's logits
    score_correction_bias: Array | None = None  # [E]: added to the router's scores to choose experts
    shared_expert: MLPWeights | None = None
    shared_expert_gate: Array | None = None  # [1, H]
    dense_mlp: MLPWeights | None = None  # non-MoE layers


class MoETransformer:
    """A loaded model: dense weights on the backend, routed experts behind an ExpertStore.

    `forward(batch, kv_cache)` computes one step of a flat batch and returns the float32 logits of the rows in
    `batch.logits_indices` as a host array [N, V]. Positions go up to `max_positions` (the model's
    max_position_embeddings, or fewer where the engine's sequences are shorter: the rotary tables hold that many).
    With `expert_parallel` the model is one rank of an expert-parallel group and `store` holds the rank's shard of
    the routed experts only (numbered from 0: `ExpertParallelRank`).
    """

    def __init__(self, config: ModelConfig, dense: DenseFile, store: ExpertStore, backend: Backend,
                 max_positions: int | None = None, expert_parallel: ExpertParallelRank | None = None):
        self.config = config
        self.backend = backend
        self.store = backend.prepare_experts(
            store, config if expert_parallel is None else shard_config(config, expert_parallel.experts))

        def load(name: str) -> Array:
            return backend.prepare_weight(dense.get(name))

        def load_optional(name: str) -> Array | None:
            return load(name) if name in dense.names else None

        def load_mlp(prefix: str) -> MLPWeights:
            return MLPWeights(load(prefix + "gate_proj"), load(prefix + "up_proj"), load(prefix + "down_proj"))

        self.embed_tokens = load("embed_tokens")  # [V, H]
        self.layers: list[LayerWeights] = []
        for layer in range(config.num_layers):
            p = f"layers.{layer}."
            moe = config.is_moe_layer(layer)
            self.layers.append(LayerWeights(
                input_norm=load(p + "input_norm"),
                q_proj=load_optional(p + "q_proj"),
                k_proj=load_optional(p + "k_proj"),
                v_proj=load_optional(p + "v_proj"),
                latent=self._latent_weights(dense, p) if config.attention == "mla" else None,
                o_proj=load(p + "o_proj"),
                post_attention_norm=load(p + "post_attention_norm"),
                q_bias=load_optional(p + "q_bias"),
                k_bias=load_optional(p + "k_bias"),
                v_bias=load_optional(p + "v_bias"),
                o_bias=load_optional(p + "o_bias"),
                sinks=load(p + "sinks") if config.attention_sinks else None,
                q_norm=load_optional(p + "q_norm"),
                k_norm=load_optional(p + "k_norm"),
                router=load(p + "router") if moe else None,
                router_bias=load(p + "router_bias") if moe and config.router_bias else None,
                score_correction_bias=load(p + "score_correction_bias") if moe and config.score_correction_bias
                else None,
                shared_expert=(load_mlp(p + "shared_expert.") if moe and config.shared_expert_intermediate_size
                               else None),
                shared_expert_gate=load_optional(p + "shared_expert_gate"),
                dense_mlp=None if moe else load_mlp(p + "mlp."),
            ))
        self.norm = load("norm")  # [H]
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else load("lm_head")  # [V, H]
        self.max_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
        cos, sin = cos_sin_table(config.rope, config.rotary_dim or config.head_dim, self.max_positions)
        self.rope_cos, self.rope_sin = backend.upload(cos), backend.upload(sin)  # [P, R/2] each (R rotated dims)
        self.attention_scale = config.softmax_scale or config.head_dim**-0.5
        self.swiglu = config.clamped_swiglu()  # the routed experts' activation when not silu(gate) * up
        # one rank of an expert-parallel group (experts/expert_parallel.py), or None: every expert is this model's
        self.expert_parallel = expert_parallel
        self.timer = StepTimer(backend.clock())  # the engine's step timer; the forward's phases report to it
        self.store.timer = self.timer  # expert reads report to it too

    def _latent_weights(self, dense: DenseFile, p: str) -> LatentAttentionWeights:
        cfg, prepare = self.config, self.backend.prepare_weight
        nope = cfg.head_dim - cfg.rotary_dim
        kv_b = dense.get(p + "kv_b_proj").reshape(cfg.num_heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
        optional = {name: prepare(dense.get(p + name)) for name in ("q_a_proj", "q_a_norm", "q_b_proj")
                    if p + name in dense.names}
        return LatentAttentionWeights(kv_a_proj=prepare(dense.get(p + "kv_a_proj")),
                                      kv_a_norm=prepare(dense.get(p + "kv_a_norm")),
                                      k_up=prepare(kv_b[:, :nope].transpose(0, 2, 1)),
                                      v_up=prepare(kv_b[:, nope:]), **optional)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                          sliding: SlidingLayers | None = None, num_sliding_blocks: int = 0) -> PagedKVCache:
        """A KV cache for this model; `kv_cache_dtype` is an option of `resolve_kv_dtype` (auto, bf16, fp16, fp32).
        With `sliding`, its layers' blocks are a pool of `num_sliding_blocks` of their own (batches then carry
        their tables); without, every layer keeps a sequence's whole context."""
        return PagedKVCache.allocate(self.config, num_blocks, block_size, self.backend,
                                     resolve_kv_dtype(kv_cache_dtype, self.config), sliding, num_sliding_blocks)

    # ---- forward ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the expert store's threads (joined) and close its files; the model is not used after."""
        self.store.close()

    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> np.ndarray:
        """One step over a flat batch -> logits [N, V] float32 (host) for batch.logits_indices."""
        if batch.num_tokens and int(batch.positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(batch.positions.max())} is beyond the model's "
                             f"{self.max_positions} positions")
        return self.backend.to_host(self.forward_device(batch, self.upload_batch(batch), kv_cache))

    def upload_batch(self, batch: ForwardBatch) -> dict[str, Array]:
        """The batch's index arrays on the backend's device, by ForwardBatch field name (the sliding-window layers'
        where it has them)."""
        return {name: self.backend.upload(getattr(batch, name)) for name in (*BATCH_FIELDS, *SLIDING_FIELDS)
                if getattr(batch, name) is not None}

    def forward_device(self, batch: ForwardBatch, device_batch: dict[str, Array], kv_cache: PagedKVCache) -> Array:
        """One step -> logits [N, V] float32 left on the backend's device.

        `device_batch` holds the batch's arrays on the device (from `upload_batch`, or the fixed input buffers of a
        captured CUDA graph); the GPU backend reads only their shapes from `batch`.
        """
        b, cfg, t = self.backend, self.config, self.timer
        hidden = b.embedding(self.embed_tokens, device_batch["token_ids"])  # [T, H]
        residual = None
        full = (batch, device_batch)
        sliding = _sliding_inputs(batch, device_batch) if kv_cache.sliding_layers else full
        for index, layer in enumerate(self.layers):
            if residual is None:
                residual, x = hidden, b.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = b.add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            layer_batch, layer_device_batch = sliding if index in kv_cache.sliding_layers else full
            with t.device_phase("attention"):
                hidden = self._attention(index, layer, x, layer_batch, layer_device_batch, kv_cache)  # [T, H]
            x, residual = b.add_rms_norm(hidden, residual, layer.post_attention_norm, cfg.rms_norm_eps)
            hidden = self._mlp(index, layer, x)  # [T, H]
        x, _ = b.add_rms_norm(hidden, residual, self.norm, cfg.rms_norm_eps)
        x = b.gather_rows(x, device_batch["logits_indices"])  # [N, H]
        return b.linear(x, self.lm_head)  # [N, V]

    def _attention(self, index: int, layer: LayerWeights, x: Array, batch: ForwardBatch,
                   device_batch: dict[str, Array], kv_cache: PagedKVCache) -> Array:
        if layer.latent is not None:
            return self._latent_attention(index, layer, x, batch, device_batch, kv_cache)
        b, cfg = self.backend, self.config
        t, d = batch.num_tokens, cfg.head_dim
        q, k, v = b.linears(x, (layer.q_proj, layer.k_proj, layer.v_proj),
                            (layer.q_bias, layer.k_bias, layer.v_bias))  # [T, Q*D], [T, K*D], [T, K*D]
        key_cache, value_cache = kv_cache.keys[index], kv_cache.values[index]
        kv_scales = (kv_cache.k_scales[index], kv_cache.v_scales[index])
        q = b.qk_norm_rope_write(q, k, v, layer.q_norm, layer.k_norm, cfg.qk_norm, cfg.rms_norm_eps, cfg.clip_qkv,
                                 self.rope_cos, self.rope_sin, device_batch["positions"], key_cache, value_cache,
                                 device_batch["slot_mapping"], kv_scales)  # [T, Q, D]; k, v stored in the caches
        attended = b.paged_attention(q, key_cache, value_cache, batch, device_batch, self.attention_scale,
                                     cfg.sliding_windows[index], kv_scales, layer.sinks)  # [T, Q, D]
        return b.linear(attended.reshape(t, cfg.num_heads * d), layer.o_proj, layer.o_bias)

    def _latent_attention(self, index: int, layer: LayerWeights, x: Array, batch: ForwardBatch,
                          device_batch: dict[str, Array], kv_cache: PagedKVCache) -> Array:
        """Multi-head Latent Attention: each head's query [no-rope | rotated rope part] over the cached rows
        [latent | rotated rope key] through the key and value up-projections (k_up, v_up), in whichever form the
        backend computes (Backend.latent_attention)."""
        b, cfg, lat = self.backend, self.config, layer.latent
        t, heads, rank = batch.num_tokens, cfg.num_heads, cfg.kv_lora_rank
        if lat.q_a_proj is None:
            q = b.linear(x, layer.q_proj)  # [T, Q*D]
        else:
            q = b.linear(b.rms_norm(b.linear(x, lat.q_a_proj), lat.q_a_norm, cfg.latent_norm_eps), lat.q_b_proj)
        compressed = b.linear(x, lat.kv_a_proj)  # [T, R + r]
        latent = b.rms_norm(compressed[:, :rank], lat.kv_a_norm, cfg.latent_norm_eps)  # [T, R]
        cache, scale = kv_cache.keys[index], kv_cache.k_scales[index]
        query = b.latent_rope_write(q.reshape(t, heads, cfg.head_dim), latent, compressed[:, rank:], self.rope_cos,
                                    self.rope_sin, device_batch["positions"], cfg.rope_interleave, cache,
                                    device_batch["slot_mapping"], scale)  # [T, Q, D]
        values = b.latent_attention(query, lat.k_up, lat.v_up, cache, batch, device_batch, self.attention_scale,
                                    scale)  # [T, Q, Dv]
        return b.linear(values.reshape(t, heads * cfg.v_head_dim), layer.o_proj)

    def _mlp(self, index: int, layer: LayerWeights, x: Array) -> Array:
        b, cfg, t = self.backend, self.config, self.timer
        if layer.dense_mlp is not None:
            with t.device_phase("mlp"):
                return self._gated_mlp(layer.dense_mlp, x)
        with t.device_phase("routing"):
            weights, expert_ids = b.route(x, layer.router, cfg.top_k, cfg.norm_topk_prob, cfg.router_scoring,
                                          layer.score_correction_bias, cfg.n_group, cfg.topk_group,
                                          cfg.routed_scaling_factor, layer.router_bias,
                                          cfg.group_ranking)  # [T, k] each
        with t.device_phase("experts"):
            self.store.begin_layer(index, x, expert_ids, weights)  # a tiered store loads, prefetches, places
            if self.expert_parallel is None:
                out = b.routed_experts(x, weights, expert_ids, index, self.store, self.swiglu)  # [T, H]
            else:  # this rank's tokens to the ranks holding their experts, and back
                out = self.expert_parallel.routed_experts(b, x, weights, expert_ids, index, self.store, self.swiglu)
            if layer.shared_expert is not None:
                shared = self._gated_mlp(layer.shared_expert, x)  # [T, H]
                if layer.shared_expert_gate is not None:
                    shared = b.sigmoid(b.linear(x, layer.shared_expert_gate)) * shared
                out = out + shared
        return out

    def _gated_mlp(self, mlp: MLPWeights, x: Array) -> Array:
        b = self.backend
        return b.linear(b.silu_mul(b.linear(x, mlp.gate_proj), b.linear(x, mlp.up_proj)), mlp.down_proj)


def _sliding_inputs(batch: ForwardBatch, device_batch: dict[str, Array]) -> tuple[ForwardBatch, dict[str, Array]]:
    """The step's inputs as a sliding-window layer of a cache with a pool for them reads them: their block tables
    and slots in place of the full layers'."""
    return batch.for_sliding_layers(), {**device_batch, "block_tables": device_batch["sliding_block_tables"],
                                        "slot_mapping": device_batch["sliding_slot_mapping"]}
