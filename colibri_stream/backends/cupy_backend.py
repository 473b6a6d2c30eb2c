"""The GPU backend: CuPy arrays and our own CUDA kernels (kernels/*.cu, compiled at run time by kernels.py).

Numerics: activations and every accumulation are float32; the KV cache is in its own dtype (bfloat16 by default,
float16, fp8 e4m3 as uint8 bits, float32), rounded when written and widened when attention loads it. Weight
matrices stay in their storage dtype (bfloat16, float16, float32; routed experts also int8 with per-row float32
scales, int4 and fp8 with group or tile scales) and are widened in registers as they are loaded; vectors (norm
weights, biases) are held as float32.
bfloat16 arrays are CuPy uint16 arrays of the same bits (CuPy has no bfloat16 arithmetic); `storage_type` names
their CUDA type for the kernels.

Dense projections of up to SMALL_BATCH tokens run on our GEMV kernel (linear.cu), which reads each weight once for
all the tokens; larger ones go to cuBLAS on tensor cores: float32 activations are split into a bf16 (or fp16) high
and low part (x = hi + lo to about 16 significant bits) multiplied as one GEMM of twice the rows, so the result
stays within about 1e-5 of float32 while each weight is still read once. At matmul precision "medium" the
products on cuBLAS (dense projections, the per-expert GEMMs of prefill) and prefill attention take one bf16 (or
fp16) part instead, half the tensor cores' work, at about 1e-3 of float32 (cublas_gemm.py).
CuPy refuses cuBLAS calls while a stream captures a CUDA graph, so inside a capture bf16/fp16 projections of
DENSE_MMA_MIN_TOKENS tokens or more run on our tensor-core kernel (linear_mma.cu: the hi/lo split at either
precision, the columns split over enough blocks to fill the GPU), except lm_head-sized ones, which call cuBLAS
through ctypes (captured_cublas.py), and the others on linear_rows.
Routed experts are held per layer as stacked device arrays (cupy_moe.DeviceExpertStore), and the MoE kernels read the
routing from device memory, so a decode step needs no host synchronisation and can be captured in a CUDA graph
(cuda_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import QK_NORMS, ROUTER_SCORINGS, ModelConfig
from ..experts.store import ExpertStore
from ..memory import MemoryInfo
from ..timing import Clock
from .base import Array, Backend
from .cuda_clock import CudaEventClock
from .cublas_gemm import ACTIVATION_PARTS, activation_parts, weight_product
from .cupy_flash_attention import (DECODE_THREADS, FLASH_FILE, FLASH_THREADS, FlashTileCache, decode_expression,
                                   decode_shared_bytes, flash_attention_launch,
                                   takes_flash_attention, takes_flash_decode)
from .cupy_expert_gemm import min_gemm_pairs
from .cupy_latent import (KvRows, absorbed_latent_attention, latent_rope_write, per_head_linear,
                          takes_latent_kernel)
from .cupy_latent_prefill import LatentPrefill, decompressed_attention
from .cupy_launch import (NULL, FAMILIES, ceil_div, check_row_width, launch, smallest_tile, storage_type,
                          to_device_storage)
from .cupy_moe import DeviceExpertStore, routed_experts
from .cupy_quant_moe import FP8_LANE_COLS
from .kernels import get_kernel
from .sequence_attention import paged_attention_rows
from .tuning import (ATTENTION_WARPS, CAPTURED_CUBLAS_ALL_MIN_TOKENS, CAPTURED_CUBLAS_MIN_ROWS,
                     CAPTURED_CUBLAS_MIN_TOKENS, DENSE_MMA_MIN_TOKENS, EMBEDDING_THREADS, FLASH_DECODE_BLOCKS_PER_SM,
                     FLASH_DECODE_MAX_SPLITS, FLASH_DECODE_MIN_KEYS, FLASH_DECODE_SPLIT_KEYS, GQA_BLOCKS_PER_SM,
                     GQA_GROUPS,
                     GQA_MAX_LANE_FLOATS, GQA_MAX_SPLITS, GQA_SPLIT_KEYS, GQA_MIN_TOKENS,
                     GQA_ONE_TOKEN_MAX_KEYS, GQA_WARPS,
                     LINEAR_MMA_BLOCKS_PER_SM, MERGE_MAX_SPLITS, MERGE_THREADS,
                     LINEAR_MMA_MIN_SPAN, LINEAR_MMA_ROWS, LINEAR_MMA_TILES, LINEAR_ROWS_PER_BLOCK, MMA_THREADS,
                     PROLOGUE_WARPS, ROUTER_MAX_EXPERTS, ROUTER_MAX_GROUPS, ROUTER_SPLIT_TOKENS, ROUTER_TILE,
                     ROUTER_WARPS, SMALL_BATCH, TOKEN_TILES)

if TYPE_CHECKING:
    from ..batch import ForwardBatch
    from ..sampling import LogitSource

@dataclass(frozen=True)
class DecodeSplits:
    """The context splits of one decode attention launch: how many the launch has, the keys a split takes, and the
    partials the splits write for paged_attention_merge (NULL for one split)."""

    splits: int
    split_keys: int
    acc: Any  # float32 [T, Q, S, D]
    ml: Any  # float32 [T, Q, S, 2]


MAX_HEAD_DIM = 256  # paged_attention's widest head: 32 lanes of 8 elements
DEVICE_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16,
                 "float8_e4m3": np.uint8}  # storage dtypes on the device


def cuda_available() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False


class CupyBackend(Backend):
    """CuPy arrays on the current CUDA device, computed with the kernels of kernels/*.cu."""

    name = "cupy"
    device = "cuda"
    supports_graphs = True
    # kernels/moe.cu and moe_mma.cu widen the plain formats and int8, moe_int4.cu takes int4 and mxfp4, moe_fp8.cu fp8
    expert_formats = ("bfloat16", "float16", "float32", "int8", "int4", "mxfp4", "fp8")

    @classmethod
    def missing_features(cls, config: ModelConfig) -> list[str]:
        """kernels/router.cu selects among at most ROUTER_MAX_EXPERTS experts (groups: ROUTER_MAX_GROUPS), the
        attention prologue takes heads of at most MAX_HEAD_DIM dimensions (latent attention has kernels of its own,
        cupy_latent.py); the MoE kernels add experts' biases and apply the clamped SwiGLU in every
        expert format."""
        missing = [f"{config.router_scoring} routing"] if config.router_scoring not in ROUTER_SCORINGS else []
        missing += [name for name, used in (
            (f"more than {ROUTER_MAX_EXPERTS} routed experts", config.num_experts > ROUTER_MAX_EXPERTS),
            (f"group-limited routing over more than {ROUTER_MAX_GROUPS} groups (n_group)",
             config.n_group > ROUTER_MAX_GROUPS),
            ("groups of experts ranked by their best score (DeepSeek-V2's group_limited_greedy; router.cu ranks "
             "them by their two best)", config.n_group > 1 and config.group_ranking != "top2_sum"),
            (f"head_dim {config.head_dim} (the attention kernels take at most {MAX_HEAD_DIM})",
             config.head_dim > MAX_HEAD_DIM)) if used]
        # moe_int4.cu reads whole 32-column chunks of int4 and mxfp4, moe_fp8.cu 16 codes a lane
        width = {"int4": 32, "mxfp4": 32, "fp8": FP8_LANE_COLS}.get(config.expert_dtype)
        if width and (config.hidden_size % width or config.moe_intermediate_size % width):
            missing.append(f"{config.expert_dtype} experts of hidden size {config.hidden_size} and intermediate size "
                           f"{config.moe_intermediate_size} (multiples of {width} only)")
        return missing

    @classmethod
    def captures(cls, config: ModelConfig, kv_dtype: str) -> bool:
        """Latent attention's decode steps are captured where latent_attention takes the cache (cupy_latent.py);
        every other model's always."""
        return config.attention != "mla" or takes_latent_kernel(config.kv_lora_rank, config.rotary_dim, kv_dtype)

    def __init__(self, matmul_precision: str = "high"):
        import cupy

        if matmul_precision not in ACTIVATION_PARTS:
            raise ValueError(f"matmul_precision must be one of {', '.join(ACTIVATION_PARTS)}, "
                             f"got {matmul_precision!r}")
        self.cp = cupy
        # parts of the float32 activations in tensor-core products on cuBLAS and flash_attention (cublas_gemm.py)
        self.activation_parts = ACTIVATION_PARTS[matmul_precision]
        self._silu_mul = cupy.ElementwiseKernel("float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u",
                                                "colibri_silu_mul")
        self._sigmoid = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 1.0f / (1.0f + expf(-x))",
                                               "colibri_sigmoid")
        self.multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # [token tiles] route_split's block counters (tiles of one token up): zero between launches (each launch
        # resets what it counted)
        self._route_counters = cupy.zeros(ROUTER_SPLIT_TOKENS, np.uint32)
        self._flash_tiles = FlashTileCache()
        self._latent_prefill = LatentPrefill(cupy)
        self.kv_rows = KvRows(cupy)  # cache rows widened for the array operations' attention
        self._clock: CudaEventClock | None = None  # made on first use

    def max_tokens_in_stream_order(self, config: ModelConfig) -> int | None:
        """Below the steps whose routed experts go to per-expert GEMMs (cupy_expert_gemm.py), which copy each
        layer's group sizes to the host."""
        pairs = min_gemm_pairs(config.moe_intermediate_size, config.hidden_size, config.num_experts)
        return (pairs - 1) // config.top_k

    def logit_source(self, logits: Array) -> LogitSource:
        from .cupy_sampling import DeviceLogits

        return DeviceLogits(logits, self)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def clock(self) -> Clock:
        """CUDA events on the current stream (cuda_clock.py): phases are the GPU's time, not the host's."""
        if self._clock is None:
            self._clock = CudaEventClock(self.cp)
        return self._clock

    # ---- memory -------------------------------------------------------------------------------------------
    def prepare_weight(self, host) -> Array:
        if host.ndim == 1:  # norm weights and biases: float32
            if isinstance(host, np.ndarray):
                host = host.astype(np.float32)
            return self.cp.asarray(host, dtype=np.float32)
        return to_device_storage(host)

    def upload(self, host: np.ndarray) -> Array:
        return self.cp.asarray(host)

    def to_host(self, array: Array) -> np.ndarray:
        return self.cp.asnumpy(array)

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array:
        return self.cp.zeros(shape, dtype=DEVICE_DTYPES[dtype])

    def memory_info(self) -> MemoryInfo:
        """The current GPU's free and total bytes, counting blocks CuPy's memory pool holds unused as free."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return MemoryInfo(free + self.cp.get_default_memory_pool().free_bytes(), total, host=False)

    def random_weight(self, shape: tuple[int, ...], std: float, seed: int, dtype: str) -> Array:
        values = self.cp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)  # [shape]
        values *= np.float32(std)
        return self.from_float32(values, dtype)

    def from_float32(self, values: Array, dtype: str) -> Array:
        """float32 device values rounded to a storage dtype (float32, bfloat16 as uint16 bits, float16, fp8 e4m3 as
        uint8 bits: to nearest even, saturated)."""
        if dtype == "float32":
            return values
        out = self.cp.empty(values.shape, DEVICE_DTYPES[dtype])
        w = storage_type(out)
        launch("linear.cu", f"to_storage<{w}>", (ceil_div(values.size, 256),), 256,
                (self.cp.ascontiguousarray(values), out, np.int64(values.size)), weight_type=w)
        return out

    # ---- dense layers -------------------------------------------------------------------------------------
    def embedding(self, table: Array, token_ids: Array) -> Array:
        t, h = token_ids.shape[0], table.shape[1]
        out = self.cp.empty((t, h), np.float32)  # [T, H]
        w = storage_type(table)
        chunks = ceil_div(h, EMBEDDING_THREADS * (16 // table.dtype.itemsize))  # blocks a row: a 16-byte chunk a thread
        launch("embedding.cu", f"embedding<{w}>", (t, chunks), EMBEDDING_THREADS, (table, token_ids, out, np.int32(h)),
               weight_type=w)
        return out

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        return self._rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm(x, residual, weight, eps)

    def _rms_norm(self, x: Array, residual: Array | None, weight: Array, eps: float) -> tuple[Array, Array | None]:
        x = self.cp.ascontiguousarray(x)
        n = x.shape[-1]
        out = self.cp.empty_like(x)  # [..., N]
        summed = None if residual is None else self.cp.empty_like(x)  # [..., N]
        args = (x, NULL if residual is None else self.cp.ascontiguousarray(residual), weight, out,
                NULL if summed is None else summed, np.int32(n), np.float32(eps))
        threads = min(1024, 32 * ceil_div(n, 4 * 32))  # about four elements per thread
        launch("norm.cu", "rms_norm", (x.size // n,), threads, args)
        return out, summed

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        return self.linears(x, [weight], [bias])[0]

    def linears(self, x, weights, biases):
        """Up to three matrices of one dtype on the same path are one launch (linear_rows or linear_mma)."""
        x = self.cp.ascontiguousarray(x)
        paths = {self._dense_path(x, w) for w in weights}
        if not weights or len(weights) > 3 or len({w.dtype for w in weights}) > 1 or len(paths) > 1:
            return super().linears(x, weights, biases)
        path = paths.pop()
        if path == "gemv":
            return self._linear_rows(x, weights, biases)
        if path == "mma":
            return self._linear_mma(x, weights, biases)
        outs = [self._gemm(x, weight) for weight in weights]  # [T, Out_m] each
        for out, bias in zip(outs, biases):
            if bias is not None:
                out += bias
        return outs

    def _dense_path(self, x: Array, weight: Array) -> str:
        """How x [T, In] is multiplied by `weight`: "mma" (linear_mma) inside a graph capture from
        DENSE_MMA_MIN_TOKENS tokens with bf16/fp16 weights, except lm_head-sized ones from CAPTURED_CUBLAS_MIN_TOKENS
        and every one from CAPTURED_CUBLAS_ALL_MIN_TOKENS (cuBLAS); eager steps of
        that size compile linear_mma, for the capture.
        "gemv" (linear_rows) for few tokens or other captures, "cublas" otherwise."""
        tokens, capturing = x.shape[0], self.cp.cuda.get_current_stream().is_capturing()
        if tokens >= DENSE_MMA_MIN_TOKENS and np.dtype(weight.dtype) in (np.dtype(np.uint16), np.dtype(np.float16)):
            if capturing:
                large = weight.shape[0] >= CAPTURED_CUBLAS_MIN_ROWS or tokens >= CAPTURED_CUBLAS_ALL_MIN_TOKENS
                if tokens >= CAPTURED_CUBLAS_MIN_TOKENS and large:
                    return "cublas"
                return "mma"
            w = storage_type(weight)  # an eager step (a graph's warm-up) compiles it for the capture
            get_kernel("linear_mma.cu", f"linear_mma<{w}, 1>", FAMILIES["linear_mma.cu"](w))
        return "gemv" if tokens <= SMALL_BATCH or capturing else "cublas"

    def column_splits(self, n_in: int, row_blocks: int) -> int:
        """Column spans of linear_mma for `row_blocks` blocks of output rows: enough blocks to fill every
        multiprocessor (LINEAR_MMA_BLOCKS_PER_SM each), each span at least LINEAR_MMA_MIN_SPAN columns."""
        wanted = round(self.multiprocessors * LINEAR_MMA_BLOCKS_PER_SM / row_blocks)
        return max(1, min(wanted, n_in // LINEAR_MMA_MIN_SPAN))

    def _linear_mma(self, x: Array, weights, biases) -> list[Array]:
        """x [T, In] times one to three bf16/fp16 weights [Out_m, In] of one dtype (+ biases) in one launch of
        linear_mma, split over the columns.  # [T, Out_m] each"""
        t, n_in = x.shape
        n_outs = [weight.shape[0] for weight in weights]
        for weight in weights:
            check_row_width(n_in, weight, "linear")
        row_blocks = sum(ceil_div(n, LINEAR_MMA_ROWS) for n in n_outs)
        splits = self.column_splits(n_in, row_blocks)
        span = 32 * ceil_div(n_in, 32 * splits)
        splits = ceil_div(n_in, span)
        # [T * sum(Out_m)]: several splits add into it, so it starts at zero
        flat = (self.cp.zeros if splits > 1 else self.cp.empty)(t * sum(n_outs), np.float32)
        outs, matrices, start = [], [], 0
        for weight, bias, n_out in zip(weights, biases, n_outs):
            outs.append(flat[start:start + t * n_out].reshape(t, n_out))  # [T, Out_m]
            start += t * n_out
            matrices += [weight, NULL if bias is None else bias, outs[-1], np.int32(n_out)]
        matrices += [NULL, NULL, NULL, np.int32(0)] * (3 - len(weights))
        w = storage_type(weights[0])
        n_tiles = smallest_tile(ceil_div(t, 8), LINEAR_MMA_TILES)
        launch("linear_mma.cu", f"linear_mma<{w}, {n_tiles}>", (row_blocks, splits), MMA_THREADS,
                (x, np.int32(t), np.int32(n_in), np.int32(span), *matrices), weight_type=w)
        return outs

    def _linear_rows(self, x: Array, weights, biases) -> list[Array]:
        """x [T, In] times one to three weights [Out_m, In] of one dtype (+ biases) in one launch.  # [T, Out_m] each"""
        t, n_in = x.shape
        outs, matrices, blocks = [], [], 0
        tile = smallest_tile(t, TOKEN_TILES)
        for weight, bias in zip(weights, biases):
            check_row_width(n_in, weight, "linear")
            n_out = weight.shape[0]
            outs.append(self.cp.empty((t, n_out), np.float32))  # [T, Out_m]
            matrices += [weight, NULL if bias is None else bias, outs[-1], np.int32(n_out)]
            blocks += ceil_div(t, tile) * ceil_div(n_out, LINEAR_ROWS_PER_BLOCK)
        matrices += [NULL, NULL, NULL, np.int32(0)] * (3 - len(weights))
        w = storage_type(weights[0])
        launch("linear.cu", f"linear_rows<{w}, {tile}>", (blocks,), 128, (x, np.int32(t), np.int32(n_in), *matrices),
               weight_type=w)
        return outs

    def _gemm(self, x: Array, weight: Array) -> Array:
        """x [T, In] @ weight [Out, In]^T through cuBLAS, float32 accumulation and output: bf16/fp16 weights
        multiply x's N parts (cublas_gemm.py) as one GEMM of N * T rows, whose row blocks are summed.  # [T, Out]"""
        t, n_in = x.shape
        n_out = weight.shape[0]
        if weight.dtype == np.float32:
            return self.cp.matmul(x, weight.T)
        parts = activation_parts(x, weight, self.activation_parts)  # [N * T, In]
        products = self.cp.empty((parts.shape[0], n_out), np.float32)  # [N * T, Out]
        weight_product(products.data.ptr, n_out, weight.data.ptr, n_in, weight.dtype, n_out, n_in, parts.data.ptr,
                       n_in, parts.shape[0], accumulate=False)
        return products if self.activation_parts == 1 else self.cp.add(products[:t], products[t:])

    def silu_mul(self, gate: Array, up: Array) -> Array:
        return self._silu_mul(gate, up)

    def sigmoid(self, x: Array) -> Array:
        return self._sigmoid(x)

    # ---- attention ----------------------------------------------------------------------------------------
    def latent_rope_write(self, q, latent, k_rope, cos, sin, positions, interleaved, cache, slot_mapping, scale=1.0):
        return latent_rope_write(self.cp, q, latent, k_rope, cos, sin, positions, interleaved, cache, slot_mapping,
                                 scale)

    def latent_attention(self, query, k_up, v_up, cache, batch: ForwardBatch | None, device_batch, scale, kv_scale):
        """Prefill chunks in the decompressed form where cupy_latent_prefill.py takes the step (the step's other
        sequences as a batch of their own in the absorbed form), every other step in the absorbed form."""
        plan = self._latent_prefill.plan(query, k_up, v_up, cache, batch, self.activation_parts)
        if plan is None:
            return super().latent_attention(query, k_up, v_up, cache, batch, device_batch, scale, kv_scale)
        out = self.cp.empty((query.shape[0], query.shape[1], v_up.shape[1]), np.float32)  # [T, Q, Dv]
        decompressed_attention(self.cp, plan, query, k_up, v_up, cache, device_batch, scale, kv_scale, out)
        if plan.absorbed is not None:
            part = plan.absorbed
            out[part.rows] = super().latent_attention(query[part.rows], k_up, v_up, cache, part.batch,
                                                      part.device_batch, scale, kv_scale)
        return out

    def absorbed_latent_attention(self, q_latent, q_rope, cache, batch, device_batch, scale, kv_scale):
        return absorbed_latent_attention(self, q_latent, q_rope, cache, batch, device_batch, scale, kv_scale)

    def per_head_linear(self, x, weight):
        return per_head_linear(self.cp, self.kv_rows, x, weight, self.activation_parts)

    def qk_norm_rope_write(self, q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, positions, key_cache,
                           value_cache, slot_mapping, kv_scales=(1.0, 1.0)):
        """One launch of qk_norm_rope_write: a warp per head (q, k and v heads). Without a full-width norm the
        heads spread over blocks of PROLOGUE_WARPS warps; with one, a token's heads share one block, which first
        sums the squares of the token's whole q and k."""
        q, k, v = (self.cp.ascontiguousarray(a) for a in (q, k, v))
        t = q.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        num_heads = q.shape[1] // head_dim
        out = self.cp.empty((t, num_heads, head_dim), np.float32)  # [T, Q, D]
        heads = num_heads + 2 * num_kv_heads
        if qk_norm == "full":
            warps, groups = min(32, heads), 1
        else:
            warps, groups = PROLOGUE_WARPS, ceil_div(heads, PROLOGUE_WARPS)
        args = (q, k, v, NULL if q_norm is None else q_norm, NULL if k_norm is None else k_norm, cos, sin, positions,
                slot_mapping, out, key_cache, value_cache, np.int32(num_heads), np.int32(num_kv_heads),
                np.int32(head_dim // 2), np.int32(cos.shape[1]), np.int32(QK_NORMS.index(qk_norm)), np.float32(eps),
                np.float32(clip or 0),
                np.float32(kv_scales[0]), np.float32(kv_scales[1]))
        kv_type = storage_type(key_cache)
        launch("attention_prologue.cu", f"qk_norm_rope_write<{kv_type}>", (t, groups), 32 * warps, args,
               weight_type=kv_type)
        return out

    def paged_attention(self, query, key_cache, value_cache, batch: ForwardBatch, device_batch, scale,
                        sliding_window, kv_scales=(1.0, 1.0), sinks=None):
        """One query token per sequence (T == B) over a bf16, fp16 or fp8 cache: flash_decode (flash_attention.cu,
        tensor cores; cupy_flash_attention.takes_flash_decode), the context split over blocks as below.
        Other decode launches with at least GQA_MIN_TOKENS tokens, or one token whose tables hold more
        than GQA_ONE_TOKEN_MAX_KEYS keys (T == B, decided from shapes only: inside a captured graph `batch` holds
        shapes, and decode.py's profile passes None): paged_attention_gqa, a
        block per (token, KV head, split) computing the KV head's whole query group, so each key and value row is
        read once for the group; the launch has enough splits to fill the GPU at the tables' full width, each
        token uses as many of them as give GQA_SPLIT_KEYS keys a split, and paged_attention_merge combines them.
        Prefill steps with a chunk of FLASH_MIN_TOKENS or more: flash_attention.cu on tensor cores
        (cupy_flash_attention.py; caches of float, bf16 or fp16 without scales).
        Otherwise (short chunks, or head layouts or caches the other kernels do not take): paged_attention, a block
        per (token, query head). k_scale is folded into the score scale; the kernels multiply their outputs by
        v_scale."""
        # heads wider than the kernels take (sink logits' rows): array operations (cupy_latent.py's KvRows)
        if query.shape[2] > MAX_HEAD_DIM:
            return paged_attention_rows(self.cp, self.kv_rows.widen, query, key_cache, value_cache, batch, scale,
                                        sliding_window, kv_scales, sinks)
        query = self.cp.ascontiguousarray(query)
        sink_logits = self._sink_logits(sinks, query.shape[1])
        if kv_scales == (1.0, 1.0) and takes_flash_attention(query, key_cache, value_cache, batch):
            kv_type = storage_type(key_cache)
            flash = flash_attention_launch(self.cp, self._flash_tiles, query, key_cache, value_cache, batch,
                                           device_batch, kv_type, scale, sliding_window, self.activation_parts == 2,
                                           sink_logits)
            launch(FLASH_FILE, flash.expression, flash.grid, FLASH_THREADS, flash.args, shared_mem=flash.shared_mem,
                   weight_type=kv_type)
            return flash.out
        t, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        tables = device_batch["block_tables"]  # [B, max_blocks] int64
        per_lane = next((d for d in (1, 2, 4, 8) if 32 * d >= head_dim), None)
        if per_lane is None:
            raise ValueError(f"head_dim {head_dim} is above the attention kernel's {MAX_HEAD_DIM}")
        out = self.cp.empty_like(query)  # [T, Q, D]
        common = (query, key_cache, value_cache, tables, device_batch["query_start"], device_batch["positions"], out)
        sizes = (np.int32(tables.shape[0]), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                 np.int32(block_size), np.int32(tables.shape[1]), np.float32(scale * kv_scales[0]),
                 np.int32(sliding_window or 0), np.float32(kv_scales[1]))
        group = num_heads // num_kv_heads
        padded = next((g for g in GQA_GROUPS if g >= group), None)
        kv_type = storage_type(key_cache)
        vector = min(per_lane, 4)  # elements per load of a key or value row
        load_bytes = vector * key_cache.itemsize
        capacity = tables.shape[1] * block_size  # the longest context the tables hold
        enough_tokens = t >= GQA_MIN_TOKENS or capacity > GQA_ONE_TOKEN_MAX_KEYS
        window = np.int32(sliding_window or 0)
        if takes_flash_decode(query, key_cache, value_cache, tables, FLASH_DECODE_MIN_KEYS):
            split = self.decode_splits(query, num_kv_heads, capacity, FLASH_DECODE_MAX_SPLITS,
                                        FLASH_DECODE_BLOCKS_PER_SM, FLASH_DECODE_SPLIT_KEYS)
            launch(FLASH_FILE, decode_expression(kv_type, head_dim), (t, num_kv_heads, split.splits),
                   DECODE_THREADS,
                   (query, key_cache, value_cache, tables, device_batch["query_start"], device_batch["positions"],
                    out, split.acc, split.ml, np.int32(tables.shape[0]), np.int32(num_heads), np.int32(num_kv_heads),
                    np.int32(block_size), np.int32(tables.shape[1]), np.float32(scale * kv_scales[0]), window,
                    np.float32(kv_scales[1]), sink_logits, np.int32(split.split_keys)),
                   shared_mem=decode_shared_bytes(head_dim), weight_type=kv_type)
            self.merge_splits(split, out, device_batch, window, kv_type, sink_logits)
            return out
        if (t == tables.shape[0] and enough_tokens and num_heads % num_kv_heads == 0 and padded is not None
                and padded * per_lane <= GQA_MAX_LANE_FLOATS and head_dim % vector == 0
                and key_cache.data.ptr % load_bytes == 0 and value_cache.data.ptr % load_bytes == 0):
            split = self.decode_splits(query, num_kv_heads, capacity, GQA_MAX_SPLITS, GQA_BLOCKS_PER_SM,
                                        GQA_SPLIT_KEYS)
            launch("attention.cu", f"paged_attention_gqa<{kv_type}, {per_lane}, {padded}>",
                   (t, num_kv_heads, split.splits), 32 * GQA_WARPS,
                   (*common, split.acc, split.ml, *sizes, sink_logits, np.int32(split.split_keys)),
                   shared_mem=GQA_WARPS * padded * head_dim * 4, weight_type=kv_type)
            self.merge_splits(split, out, device_batch, window, kv_type, sink_logits)
            return out
        launch("attention.cu", f"paged_attention<{kv_type}, {per_lane}>", (t, num_heads), 32 * ATTENTION_WARPS,
               (*common, *sizes, sink_logits), shared_mem=ATTENTION_WARPS * head_dim * 4, weight_type=kv_type)
        return out

    @staticmethod
    def _sink_logits(sinks: Array | None, num_heads: int):
        """The kernels' `sinks` argument: a layer's sink logits, float32 [Q] as `prepare_weight` holds every vector
        weight (the kernels read the array itself, so a captured graph reads the model's own memory), or NULL."""
        if sinks is None:
            return NULL
        if sinks.shape != (num_heads,) or sinks.dtype != np.float32 or not sinks.flags.c_contiguous:
            raise ValueError(f"sink logits must be contiguous float32 [{num_heads}], got {sinks.dtype} "
                             f"{list(sinks.shape)}")
        return sinks

    def decode_splits(self, query, num_kv_heads: int, capacity: int, max_splits: int, blocks_per_sm: int,
                      split_keys: int, value_dim: int | None = None) -> DecodeSplits:
        """The splits of a decode launch (paged_attention_gqa, flash_decode, cupy_latent.py's latent_attention)
        from shapes only: enough blocks per (token, KV head) to make about blocks_per_sm a multiprocessor, at most
        max_splits (and the merge's MERGE_MAX_SPLITS), at most one per split_keys keys of the tables' full width;
        each token uses as many as its own context fills. The partials hold value_dim values a head (default: the
        query's head_dim)."""
        t, num_heads, head_dim = query.shape
        value_dim = value_dim or head_dim
        splits = max(1, min(max_splits, MERGE_MAX_SPLITS,
                            blocks_per_sm * self.multiprocessors // max(t * num_kv_heads, 1),
                            ceil_div(capacity, split_keys)))
        if splits == 1:
            return DecodeSplits(1, split_keys, NULL, NULL)
        return DecodeSplits(splits, split_keys,
                            self.cp.empty((t, num_heads, splits, value_dim), np.float32),  # [T, Q, S, D]
                            self.cp.empty((t, num_heads, splits, 2), np.float32))  # [T, Q, S, (m, l)]

    def merge_splits(self, split: DecodeSplits, out, device_batch, window, kv_type: str, sink_logits) -> None:
        """paged_attention_merge over a split decode launch's partials (nothing for one split)."""
        if split.splits == 1:
            return
        t, num_heads, head_dim = out.shape
        launch("attention.cu", "paged_attention_merge", (t, num_heads), MERGE_THREADS,
               (split.acc, split.ml, out, device_batch["positions"], np.int32(head_dim), np.int32(split.splits),
                window, np.int32(split.split_keys), sink_logits), weight_type=kv_type)

    # ---- mixture of experts -------------------------------------------------------------------------------
    def route(self, x, router, top_k, renormalize, scoring="softmax", correction_bias=None, n_group=1,
              topk_group=1, scaling=1.0, router_bias=None, group_ranking="top2_sum"):
        """Up to ROUTER_SPLIT_TOKENS tokens: route_split, a block per (expert, token tile) and the selection in
        each tile's last block (a batch-1 step reads the router on many SMs instead of one); more tokens:
        route_topk, a block per token, each reading the whole router (mostly from L2). Either selects as
        router.cu's launch contract says (at most ROUTER_MAX_EXPERTS experts and ROUTER_MAX_GROUPS groups,
        `missing_features`)."""
        if n_group > 1 and group_ranking != "top2_sum":
            raise ValueError(f"router.cu ranks groups of experts by their two best scores, not by {group_ranking}")
        x = self.cp.ascontiguousarray(x)
        t, h = x.shape
        num_experts = router.shape[0]
        check_row_width(h, router, "router")
        weights = self.cp.empty((t, top_k), np.float32)  # [T, k]
        expert_ids = self.cp.empty((t, top_k), np.int32)  # [T, k]
        w = storage_type(router)
        selection = (weights, expert_ids, np.int32(h), np.int32(num_experts), np.int32(top_k),
                     np.int32(bool(renormalize)), np.int32(ROUTER_SCORINGS.index(scoring)),
                     NULL if router_bias is None else router_bias, NULL if correction_bias is None else correction_bias,
                     np.int32(n_group), np.int32(topk_group), np.float32(scaling))
        if t <= ROUTER_SPLIT_TOKENS:
            tile = smallest_tile(min(t, ROUTER_TILE), TOKEN_TILES)
            logits = self.cp.empty((t, num_experts), np.float32)  # [T, E]
            launch("router.cu", f"route_split<{w}, {tile}>", (num_experts, ceil_div(t, tile)), 32 * ROUTER_WARPS,
                    (x, router, *selection, logits, self._route_counters, np.int32(t)),
                    shared_mem=4 * ROUTER_WARPS * num_experts, weight_type=w)
        else:
            launch("router.cu", f"route_topk<{w}>", (t,), 1024, (x, router, *selection),
                    shared_mem=4 * num_experts, weight_type=w)
        return weights, expert_ids

    def prepare_experts(self, store: ExpertStore, config: ModelConfig) -> ExpertStore:
        """A store already on the device (GPU slots, or resident) as it is; any other's experts stacked on the
        device (DeviceExpertStore), inside whatever wraps it (a routing recorder)."""
        return store.on_device(lambda inner: DeviceExpertStore.upload(inner, config.moe_layers, config.num_experts))

    def routed_experts(self, x, weights, expert_ids, layer, store: ExpertStore, swiglu=None):
        """The MoE kernels (cupy_moe.py), biases and the clamped SwiGLU included."""
        return routed_experts(self, x, weights, expert_ids, layer, store, swiglu)

    # ---- output -------------------------------------------------------------------------------------------
    def gather_rows(self, x: Array, rows: Array) -> Array:
        return x[rows]

    def greedy(self, logits: Array, out: Array | None = None) -> Array:
        """The argmax of each row of logits [B, V] (lowest id among ties), on the device, into `out` [B] int64
        when given.  # [B] int64"""
        logits = self.cp.ascontiguousarray(logits)
        ids = self.cp.empty(logits.shape[0], np.int64) if out is None else out
        if ids.shape != (logits.shape[0],) or ids.dtype != np.int64 or not ids.flags.c_contiguous:
            raise ValueError(f"greedy writes [{logits.shape[0]}] contiguous int64 ids, got {ids.shape} {ids.dtype}")
        launch("sampling.cu", "argmax_rows", (logits.shape[0],), 1024, (logits, ids, np.int32(logits.shape[1])))
        return ids

    def feed_tokens(self, token_ids: Array, feed_rows: Array, feedback: Array) -> None:
        """Replace token_ids[b] [B] int64 by feedback[feed_rows[b]] wherever feed_rows[b] [B] >= 0, in place: a
        step's inputs that an earlier step sampled on the device (feed_rows[b] < len(feedback))."""
        b = token_ids.shape[0]
        launch("sampling.cu", "feed_tokens", (ceil_div(b, 256),), 256, (token_ids, feed_rows, feedback, np.int32(b)))
