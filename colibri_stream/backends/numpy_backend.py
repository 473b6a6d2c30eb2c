"""The reference backend: NumPy on the CPU, float32 compute from bf16/fp16/int8 storage.

The KV cache is held in its own dtype (float32, bfloat16 and fp8 e4m3 through ml_dtypes, float16): rows are
rounded when written and widened to float32 when attention reads them.

Clarity over speed: this is what the GPU backend is checked against and what CI runs. Routed experts go through
the CPU expert executor (compiled kernel over the storage dtype when numba is installed, else the same float32
NumPy formulas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from ..checkpoint import NUMPY_DTYPES
from ..config import ModelConfig
from ..experts.cpu_executor import CpuExpertExecutor, silu_mul
from ..experts.store import ExpertStore, Float32ExpertStore, MappedExpertStore
from ..sampling import HostLogits
from .base import Backend
from .rotary import rotate
from .sequence_attention import paged_attention_rows

if TYPE_CHECKING:
    from ..batch import ForwardBatch


FLOAT32_EXPERTS_BYTES = 256 << 20  # resident experts up to this size as float32 are widened once, not every step


FP8_E4M3_MAX = 448.0  # e4m3's largest finite value: an fp8 cache saturates there, as CUDA's satfinite conversion
KV_NUMPY_DTYPES = {**NUMPY_DTYPES, "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn)}  # the KV cache's dtypes


def _widened(rows: np.ndarray, scale: float) -> np.ndarray:
    """Gathered KV rows (a copy, in the cache's dtype) as float32 times their scale (the same array when already
    float32 and the scale is 1)."""
    rows = rows.astype(np.float32, copy=False)
    return rows if scale == 1.0 else rows * np.float32(scale)


def _for_cache(rows: np.ndarray, cache: np.ndarray, scale: float) -> np.ndarray:
    """float32 rows divided by their scale, saturated where the cache is fp8: what is rounded into `cache`."""
    if scale != 1.0:
        rows = rows / np.float32(scale)
    if cache.dtype == KV_NUMPY_DTYPES["float8_e4m3"]:
        rows = np.clip(rows, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return rows


def _best_groups_only(choice: np.ndarray, n_group: int, topk_group: int, ranking: str) -> np.ndarray:
    """choice [T, E] with every expert outside each token's topk_group best groups set to -inf; a group of E /
    n_group consecutive experts ranks by the sum of its two largest scores ("top2_sum") or its largest ("max"),
    ties towards the lower group."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)  # [T, G, E/G]
    counted = 2 if ranking == "top2_sum" else 1  # a group's best scores that rank it
    group_scores = np.sort(grouped, axis=-1)[..., -counted:].sum(axis=-1)  # [T, G]
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]  # [T, g]
    kept = np.zeros((t, n_group), dtype=bool)  # [T, G]
    np.put_along_axis(kept, best, True, axis=-1)
    return np.where(np.repeat(kept, e // n_group, axis=-1), choice, np.float32(-np.inf))


def _write_rows(cache: np.ndarray, rows: np.ndarray, slot_mapping: np.ndarray, scale: float) -> None:
    """rows [T, K, D] into cache [num_blocks, block_size, K, D] at the slots [T] (a negative slot stores nothing),
    rounded to the cache's dtype after division by `scale`."""
    block_size = cache.shape[1]
    stored = slot_mapping >= 0  # [T]
    slots = slot_mapping[stored]  # [T']
    cache[slots // block_size, slots % block_size] = _for_cache(rows[stored], cache, scale)


class NumpyBackend(Backend):
    """Float32 NumPy on the host."""

    name = "numpy"
    device = "cpu"

    def __init__(self, expert_executor: CpuExpertExecutor | None = None):
        self.experts = expert_executor or CpuExpertExecutor()

    def logit_source(self, logits: np.ndarray) -> HostLogits:
        return HostLogits(logits)

    # ---- memory -------------------------------------------------------------------------------------------
    def prepare_weight(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def upload(self, host: np.ndarray) -> np.ndarray:
        return host

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        return np.zeros(shape, dtype=KV_NUMPY_DTYPES[dtype])

    def prepare_experts(self, store: ExpertStore, config: ModelConfig) -> ExpertStore:
        """Experts of a resident model small enough for FLOAT32_EXPERTS_BYTES are kept widened to float32 (a small
        model's experts would otherwise be converted again at every step); larger ones stay in their storage dtype
        for the executor's kernel, which reads them at memory bandwidth."""
        widened = (4 * 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts
                   * len(config.moe_layers))
        if type(store) is MappedExpertStore and widened <= FLOAT32_EXPERTS_BYTES:
            return Float32ExpertStore(store)
        return store

    # ---- dense layers -------------------------------------------------------------------------------------
    def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        return x / np.sqrt(variance + np.float32(eps)) * weight

    def add_rms_norm(self, x, residual, weight, eps):
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        out = x @ weight.T
        return out if bias is None else out + bias

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return silu_mul(gate, up)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-x))

    def clip(self, x: np.ndarray, limit: float) -> np.ndarray:
        """Clamp every element to [-limit, limit]."""
        return np.clip(x, -limit, limit)

    # ---- attention ----------------------------------------------------------------------------------------
    def rotary(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
               interleaved: bool = False) -> np.ndarray:
        """x [T, heads, D] with its first R dimensions rotated (rotary.rotate)."""
        return rotate(np, x, cos, sin, positions, interleaved)

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping, kv_scales=(1.0, 1.0)) -> None:
        """Store key/value [T, K, D] into the paged caches [num_blocks, block_size, K, D] at the slots [T]; a
        negative slot stores nothing (padding rows of a captured batch). Each value is rounded to the caches'
        dtype (to nearest even, as the GPU's writer) after division by its scale, kv_scales = (k_scale, v_scale);
        an fp8 cache saturates at +-448 (e4m3's largest finite value)."""
        _write_rows(key_cache, key, slot_mapping, kv_scales[0])
        _write_rows(value_cache, value, slot_mapping, kv_scales[1])

    def latent_rope_write(self, q, latent, k_rope, cos, sin, positions, interleaved, cache, slot_mapping, scale=1.0):
        nope = q.shape[2] - k_rope.shape[1]
        q_rope = self.rotary(q[..., nope:], cos, sin, positions, interleaved)  # [T, Q, r]
        k_rope = self.rotary(k_rope[:, None, :], cos, sin, positions, interleaved)  # [T, 1, r]
        _write_rows(cache, np.concatenate([latent[:, None, :], k_rope], axis=-1), slot_mapping, scale)
        return np.concatenate([q[..., :nope], q_rope], axis=-1)  # [T, Q, N + r]

    def absorbed_latent_attention(self, q_latent, q_rope, cache, batch, device_batch, scale, kv_scale):
        query = np.concatenate([q_latent, q_rope], axis=-1)  # [T, Q, R + r]
        return self.paged_attention(query, cache, cache, batch, device_batch, scale, None,
                                    (kv_scale, kv_scale))[..., :q_latent.shape[2]]

    def per_head_linear(self, x, weight):
        # [H, T, In] @ [H, In, Out]: one BLAS product per head
        return np.matmul(x.transpose(1, 0, 2), weight.transpose(0, 2, 1)).transpose(1, 0, 2)  # [T, H, Out]

    def qk_norm_rope_write(self, q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, positions, key_cache,
                           value_cache, slot_mapping, kv_scales=(1.0, 1.0)):
        t = q.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        if qk_norm == "full":
            q = self.rms_norm(q, q_norm, eps)  # [T, Q*D]
            k = self.rms_norm(k, k_norm, eps)  # [T, K*D]
        if clip is not None:
            q, k, v = (self.clip(a, clip) for a in (q, k, v))
        q = q.reshape(t, q.shape[1] // head_dim, head_dim)  # [T, Q, D]
        k = k.reshape(t, num_kv_heads, head_dim)  # [T, K, D]
        v = v.reshape(t, num_kv_heads, head_dim)  # [T, K, D]
        if qk_norm == "per_head":
            q = self.rms_norm(q, q_norm, eps)
            k = self.rms_norm(k, k_norm, eps)
        q = self.rotary(q, cos, sin, positions)
        k = self.rotary(k, cos, sin, positions)
        self.write_kv(key_cache, value_cache, k, v, slot_mapping, kv_scales)
        return q

    def paged_attention(self, query, key_cache, value_cache, batch: ForwardBatch, device_batch, scale,
                        sliding_window, kv_scales=(1.0, 1.0), sinks=None):
        return paged_attention_rows(np, _widened, query, key_cache, value_cache, batch, scale, sliding_window,
                                    kv_scales, sinks)

    # ---- mixture of experts -------------------------------------------------------------------------------
    def route(self, x, router, top_k, renormalize, scoring="softmax", correction_bias=None, n_group=1,
              topk_group=1, scaling=1.0, router_bias=None, group_ranking="top2_sum"):
        logits = x @ router.T  # [T, E]
        if router_bias is not None:
            logits = logits + router_bias
        if scoring == "softmax":
            logits = logits - logits.max(axis=-1, keepdims=True)
            scores = np.exp(logits)
            scores /= scores.sum(axis=-1, keepdims=True)
        else:
            scores = self.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias  # [T, E]
        if n_group > 1:
            choice = _best_groups_only(choice, n_group, topk_group, group_ranking)
        # Largest first; a stable sort on the negated scores breaks ties towards the lower id, as top-k does.
        expert_ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]  # [T, k]
        weights = np.take_along_axis(scores, expert_ids, axis=-1)  # [T, k]: unbiased scores
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if scaling != 1.0:
            weights = weights * np.float32(scaling)
        return weights.astype(np.float32), expert_ids.astype(np.int64)

    def routed_experts(self, x, weights, expert_ids, layer, store: ExpertStore, swiglu=None):
        out = np.zeros_like(x)  # [T, H]
        for expert in np.unique(expert_ids):
            tokens, slots = np.nonzero(expert_ids == expert)  # which tokens chose it, at which of their k slots
            y = self.experts.run(x[tokens], store.expert(layer, int(expert)), swiglu=swiglu)  # [n, H]
            out[tokens] += y * weights[tokens, slots][:, None]  # a token picks an expert once: no repeated rows
        return out

    # ---- output -------------------------------------------------------------------------------------------
    def gather_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]
