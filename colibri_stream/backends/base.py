"""The backend interface: every array operation the model performs, and nothing else.

The model (colibri_stream/model/) is written once against this interface; a backend decides where arrays live
(host memory for NumPy, GPU memory for CuPy) and how each operation runs. Shapes use T tokens, B sequences,
H hidden size, Q query heads, K key/value heads, D head dim, E experts, k experts per token, V vocabulary.
Activations are float32 unless a backend documents otherwise; weights are whatever `prepare_weight` returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import EXPERT_DTYPES, ClampedSwiglu
from ..memory import MemoryInfo, host_memory
from ..timing import HOST_CLOCK, Clock

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..experts.store import ExpertStore
    from ..batch import ForwardBatch
    from ..sampling import LogitSource

Array = Any  # a backend's array type (numpy.ndarray, cupy.ndarray)


class Backend(ABC):
    """Array operations of one device; subclasses implement each for their array library.

    What callers may rely on is said by capabilities, never by the backend's name: `device` (where its arrays live,
    "cpu" or "cuda": the expert tiers are built for it), `supports_graphs` (a decode step can be captured as a
    CUDA graph, cuda_graph.py) and `captures` (a given model's can), `logit_source` (how the sampler reads a
    forward's logits), `synchronize`, `clock` (where the step timer reads the model's phases),
    `expert_formats` (the routed-expert formats it computes, config.EXPERT_DTYPES's names), `missing_features`
    (the model options it does not run) and `max_tokens_in_stream_order` (the largest step it queues on the device
    without the host waiting inside it).
    """

    name: str  # for logs and reports
    device: str
    supports_graphs: bool = False
    expert_formats: tuple[str, ...] = EXPERT_DTYPES

    @classmethod
    def missing_features(cls, config: ModelConfig) -> list[str]:
        """What `config` computes that this backend does not run, one phrase each; empty when it runs the model."""
        return []

    @classmethod
    def captures(cls, config: ModelConfig, kv_dtype: str) -> bool:
        """Whether decode steps of a model of `config` over a KV cache of storage dtype `kv_dtype` can be captured
        as CUDA graphs on this backend."""
        return cls.supports_graphs

    def max_tokens_in_stream_order(self, config: ModelConfig) -> int | None:
        """The most tokens a step of a `config` model may hold for its work to be queued on the device without the
        host waiting inside it (a step launched ahead of the one before it being read); None: no bound."""
        return None

    @abstractmethod
    def logit_source(self, logits: Array) -> LogitSource:
        """A forward's logits [N, V] float32, left where they are, as the sampler reads them."""

    def synchronize(self) -> None:
        """Wait until the device finished the work queued so far (a host backend computes as it is called)."""

    def clock(self) -> Clock:
        """The clock the model's phases are timed on: the host's, where operations compute as they are called."""
        return HOST_CLOCK

    # ---- memory -------------------------------------------------------------------------------------------
    @abstractmethod
    def prepare_weight(self, host: np.ndarray) -> Array:
        """A dense weight in storage dtype (float32, bfloat16, float16) made ready for compute."""

    @abstractmethod
    def upload(self, host: np.ndarray) -> Array:
        """Copy a host array (indices, tables) to the device unchanged."""

    @abstractmethod
    def to_host(self, array: Array) -> np.ndarray:
        """Copy a device array back to a host NumPy array."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array:
        """A zero-filled device array of a storage dtype (float32, bfloat16, float16; float8_e4m3 for KV caches) in
        the form the backend's operations take it."""

    def memory_info(self) -> MemoryInfo:
        """Free and total bytes of the memory this backend allocates from (the host's RAM unless overridden)."""
        return host_memory()

    def prepare_experts(self, store: ExpertStore, config: ModelConfig) -> ExpertStore:
        """The expert store `routed_experts` will be given (the GPU backend makes every expert resident)."""
        return store

    def random_weight(self, shape: tuple[int, ...], std: float, seed: int, dtype: str) -> Array:
        """Normal(0, std) values of `shape` in storage `dtype`, drawn from `seed`, in a form `prepare_weight` takes
        (synthetic models)."""
        from ..checkpoint import NUMPY_DTYPES

        values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(std)  # [shape]
        return values.astype(NUMPY_DTYPES[dtype])

    # ---- dense layers -------------------------------------------------------------------------------------
    @abstractmethod
    def embedding(self, table: Array, token_ids: Array) -> Array:
        """table [V, H], token_ids [T] -> [T, H]"""

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x [..., N], weight [N] -> [..., N]: x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    @abstractmethod
    def add_rms_norm(self, x: Array, residual: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        """x, residual [T, H] -> (rms_norm(x + residual), x + residual)."""

    @abstractmethod
    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """x [T, In], weight [Out, In], bias [Out] -> [T, Out]"""

    def linears(self, x: Array, weights: Sequence[Array], biases: Sequence[Array | None]) -> list[Array]:
        """x [T, In], weights [Out_m, In], biases [Out_m] or None -> `linear` of each, [T, Out_m] (a backend may
        compute them in one pass: q, k and v of a layer)."""
        return [self.linear(x, weight, bias) for weight, bias in zip(weights, biases)]

    @abstractmethod
    def silu_mul(self, gate: Array, up: Array) -> Array:
        """gate, up [T, I] -> silu(gate) * up [T, I]"""

    @abstractmethod
    def sigmoid(self, x: Array) -> Array:
        """Elementwise logistic function."""

    # ---- attention ----------------------------------------------------------------------------------------
    @abstractmethod
    def qk_norm_rope_write(self, q: Array, k: Array, v: Array, q_norm: Array | None, k_norm: Array | None,
                           qk_norm: str, eps: float, clip: float | None, cos: Array, sin: Array, positions: Array,
                           key_cache: Array, value_cache: Array, slot_mapping: Array,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> Array:
        """A layer's step from its q/k/v projections to attention: q [T, Q*D], k/v [T, K*D] -> rotated q [T, Q, D].

        In order: RMSNorm of each token's whole q and k when qk_norm is "full" (weights q_norm [Q*D], k_norm
        [K*D]); q, k, v clamped to [-clip, clip] unless clip is None; RMSNorm of each head of q and k when qk_norm
        is "per_head" (weights [D]); `rotary` of q and k (the first R dimensions of each head, cos and sin
        [P, R/2]); `write_kv` of k and v at slot_mapping [T] with
        kv_scales. K and D are read from the caches' shape [num_blocks, block_size, K, D].
        """

    def latent_rope_write(self, q: Array, latent: Array, k_rope: Array, cos: Array, sin: Array, positions: Array,
                          interleaved: bool, cache: Array, slot_mapping: Array, scale: float = 1.0) -> Array:
        """Multi-head Latent Attention's step from its projections to attention -> the query [T, Q, N + r].

        q [T, Q, N + r] (each head's query: N values without rotary, then its rope part), latent [T, R]
        (normalised), k_rope [T, r]: the rope parts of q and k_rope rotated (cos, sin [P, r/2]; `interleaved` as
        `rotary`'s), each token's latent and rotated k_rope stored as one row [R + r] of cache [num_blocks,
        block_size, 1, R + r] at slot_mapping [T] (divided by `scale`), and q with its rope parts rotated returned.
        """
        raise NotImplementedError(f"the {self.name} backend does not run Multi-head Latent Attention")

    def latent_attention(self, query: Array, k_up: Array, v_up: Array, cache: Array, batch: ForwardBatch,
                         device_batch: dict[str, Array], scale: float, kv_scale: float) -> Array:
        """Multi-head Latent Attention of query [T, Q, N + r] (latent_rope_write's) over the cached rows [R + r]
        (read times kv_scale), scores scaled by `scale` -> each head's value [T, Q, Dv]. A head's key is
        [latent . k_up[h] | rope key] and its value latent . v_up[h]^T (k_up [Q, R, N], v_up [Q, Dv, R]).

        Here in the absorbed form, which never forms the keys and values: each head's query without rotary taken
        onto the latent (through k_up), attention over the rows themselves (`absorbed_latent_attention`), and the
        latent output through v_up."""
        nope = k_up.shape[2]
        q_latent = self.per_head_linear(query[..., :nope], k_up)  # [T, Q, R]
        attended = self.absorbed_latent_attention(q_latent, query[..., nope:], cache, batch, device_batch, scale,
                                                  kv_scale)  # [T, Q, R]
        return self.per_head_linear(attended, v_up)

    def absorbed_latent_attention(self, q_latent: Array, q_rope: Array, cache: Array, batch: ForwardBatch,
                                  device_batch: dict[str, Array], scale: float, kv_scale: float) -> Array:
        """Attention of the queries [q_latent [T, Q, R] | q_rope [T, Q, r]] over the cache rows [R + r] as keys and
        their first R values as values (read times kv_scale), scores scaled by `scale` -> [T, Q, R]."""
        raise NotImplementedError(f"the {self.name} backend does not run Multi-head Latent Attention")

    def per_head_linear(self, x: Array, weight: Array) -> Array:
        """x [T, H, In], weight [H, Out, In] -> [T, H, Out]: each head through its own matrix."""
        raise NotImplementedError(f"the {self.name} backend does not run Multi-head Latent Attention")

    @abstractmethod
    def paged_attention(self, query: Array, key_cache: Array, value_cache: Array, batch: ForwardBatch,
                        device_batch: dict[str, Array], scale: float, sliding_window: int | None,
                        kv_scales: tuple[float, float] = (1.0, 1.0), sinks: Array | None = None) -> Array:
        """Causal attention of query [T, Q, D] over each sequence's cached keys/values -> [T, Q, D]; a stored key
        or value is read as float32 times its scale, kv_scales = (k_scale, v_scale). `sinks` [Q] float32: each
        head's learned logit, in its softmax denominator only (a key no value goes with).

        Query token i of a sequence at position p attends to cached positions j with j <= p (and, with a
        sliding window W, j > p - W). GQA: query head h reads key/value head h // (Q / K).
        """

    # ---- mixture of experts -------------------------------------------------------------------------------
    @abstractmethod
    def route(self, x: Array, router: Array, top_k: int, renormalize: bool, scoring: str = "softmax",
              correction_bias: Array | None = None, n_group: int = 1, topk_group: int = 1,
              scaling: float = 1.0, router_bias: Array | None = None,
              group_ranking: str = "top2_sum") -> tuple[Array, Array]:
        """x [T, H], router [E, H] -> (weights [T, k] float32, expert ids [T, k] int64), in float32.

        Scores from the logits x @ router.T (+ router_bias [E] when given): a softmax over all E ("softmax") or
        each logit's sigmoid ("sigmoid").
        Experts are chosen by score plus correction_bias [E] (when given); with n_group > 1 only from each token's
        topk_group best groups of E / n_group consecutive experts, a group ranked by the sum of its two best
        biased scores (group_ranking "top2_sum") or its best one ("max"). The k chosen, largest first (ties to
        the lower id), are weighted by their unbiased scores, optionally renormalised to sum to 1, then times
        `scaling`.
        """

    @abstractmethod
    def routed_experts(self, x: Array, weights: Array, expert_ids: Array, layer: int,
                       store: ExpertStore, swiglu: ClampedSwiglu | None = None) -> Array:
        """x [T, H], weights/expert_ids [T, k] -> [T, H]: sum over each token's experts of weight * expert(x).

        expert(x) = down @ (silu(gate @ x) * (up @ x)), with the expert's tensors from `store.expert(layer, e)`;
        its biases added to the three products where it has them, and `swiglu`'s activation in place of silu.
        """

    # ---- output -------------------------------------------------------------------------------------------
    @abstractmethod
    def gather_rows(self, x: Array, rows: Array) -> Array:
        """x [T, ...], rows [N] -> x[rows] [N, ...]"""
