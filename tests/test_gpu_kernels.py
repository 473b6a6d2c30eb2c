"""Every CuPy backend operation against the NumPy reference, on fresh random inputs of several shapes (CUDA GPU).

Outputs are poisoned: before each operation the memory pool is refilled with NaN, so an element a kernel fails
to write comes back as NaN and fails the check. Error is ||ours - ref|| / ||ref||. Both backends compute in
float32 from the same stored weights (bf16 and int8 widen exactly), so the bound is 1e-5 (summation order
only), except above SMALL_BATCH tokens, where cuBLAS multiplies the activations split into a bf16/fp16 high and
low part (about 16 significant bits): 1e-4, and for bf16/fp16 routed experts of MMA_MIN_TOKENS tokens or more,
which run on tensor cores (moe_mma.cu) with the same split, two products deep: MMA_TOLERANCE.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.backends import (cublas_gemm, cupy_backend, cupy_expert_gemm, cupy_flash_attention,  # noqa: E402
                                     cupy_latent, cupy_latent_prefill, cupy_moe, cupy_moe_gemm, cupy_quant_moe)
from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.backends.cupy_launch import launch, smallest_tile, storage_type, to_device_storage  # noqa: E402
from colibri_stream.backends.cupy_moe import DeviceExpertStore, activation_args, on_tensor_cores  # noqa: E402
from colibri_stream.backends.tuning import (  # noqa: E402
    CAPTURED_CUBLAS_ALL_MIN_TOKENS,
    CAPTURED_CUBLAS_MIN_ROWS,
    CAPTURED_CUBLAS_MIN_TOKENS,
    DENSE_MMA_MIN_TOKENS,
    EXPERT_GEMM_MIN_WORK,
    GROUPED_GEMM_MIN_PAIRS,
    LINEAR_MMA_ROWS,
    LINEAR_MMA_TILES,
    MMA_DOWN_ROWS,
    MMA_GATE_UP_ROWS,
    MMA_MIN_TOKENS,
    MMA_THREADS,
    MMA_TILES,
    MOE_ROWS_PER_WARP,
    ROUTER_SPLIT_TOKENS,
    SMALL_BATCH,
    TOKEN_TILES,
)
from colibri_stream.backends.numpy_backend import NumpyBackend  # noqa: E402
from colibri_stream.config import ClampedSwiglu, RopeConfig  # noqa: E402
from colibri_stream.expert_codecs import MATRICES, Fp8Codec, Int4Codec  # noqa: E402
from colibri_stream.experts.device import DeviceExperts, LayerExperts  # noqa: E402
from colibri_stream.experts.store import ExpertStore  # noqa: E402
from colibri_stream.batch import ForwardBatch  # noqa: E402
from colibri_stream.model.rope import cos_sin_table  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = CupyBackend()
REF = NumpyBackend()
STORAGE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Routed experts on tensor cores: the activations split into high and low bf16/fp16 parts give about 2.5e-6
# (bf16) with exact accumulation (a NumPy simulation at H = 4096); the rest is the tensor cores' float32
# accumulation over two chained products. Dropping the low part gives 1.7e-3 (bf16) and 2.1e-4 (fp16).
MMA_TOLERANCE = 2e-4


KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3")  # the KV cache's element types
KV_CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "float8_e4m3": "__nv_fp8_e4m3"}
KV_STORAGE = {**STORAGE, "float8_e4m3": ml_dtypes.float8_e4m3fn}
# (k_scale, v_scale) per KV dtype: fp8 with scales other than 1 (powers of two: dividing and multiplying are exact on
# both backends, so the rounded values agree)
KV_SCALES = {"float32": (1.0, 1.0), "bfloat16": (1.0, 1.0), "float16": (1.0, 1.0), "float8_e4m3": (0.25, 2.0)}
# keys computed a few float32 ulps apart on the two backends may round to neighbouring values: one rounding step
KV_ROUNDING = {"float32": 1e-5, "bfloat16": 2**-8, "float16": 2**-8, "float8_e4m3": 2**-4}


def kv_cache_pair(values: np.ndarray, dtype: str) -> tuple[np.ndarray, object]:
    """float32 values [num_blocks, block_size, K, D] rounded to a KV dtype: (the NumPy backend's cache, a device
    copy of the same bits)."""
    host = values.astype(KV_STORAGE[dtype])
    return host, to_device_storage(host)


def kv_to_float32(cache) -> np.ndarray:
    """A device KV cache's stored values (bfloat16 as uint16 bits, fp8 as uint8) read back as float32."""
    host = cupy.asnumpy(cache)
    bits = {np.dtype(np.uint16): ml_dtypes.bfloat16, np.dtype(np.uint8): ml_dtypes.float8_e4m3fn}
    return (host.view(bits[host.dtype]) if host.dtype in bits else host).astype(np.float32)


def poison() -> None:
    """Refill the memory pool with NaN: the next allocations are carved from it."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    filler = cupy.full(64 << 20, np.nan, dtype=np.float32)  # 256 MiB
    del filler


def check(ours, reference: np.ndarray, tolerance: float = 1e-5) -> None:
    ours = cupy.asnumpy(ours)
    assert ours.shape == reference.shape
    assert np.isfinite(ours).all(), "an output element was not written (NaN from the poisoned pool)"
    error = np.linalg.norm((ours - reference).ravel()) / max(np.linalg.norm(reference.ravel()), 1e-30)
    assert error <= tolerance, f"relative error {error:.2e}"


def weight(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(STORAGE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("hidden", [96, 36, 4104])
def test_embedding(dtype, tokens, hidden):
    """Rows of whole 16-byte chunks, rows that are not (element by element), rows over several blocks."""
    rng = np.random.default_rng(tokens)
    table = weight(rng, (100, hidden), dtype)
    ids = rng.integers(0, 100, tokens)
    poison()
    ours = GPU.embedding(GPU.prepare_weight(table), cupy.asarray(ids))
    check(ours, REF.embedding(REF.prepare_weight(table), ids), 0)


@pytest.mark.parametrize("shape", [(1, 64), (5, 2048), (3, 4096), (4, 8, 24), (2, 32, 128)])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm(shape, fused):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    residual = rng.standard_normal(shape).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(shape[-1])).astype(np.float32)
    poison()
    if fused:
        out, summed = GPU.add_rms_norm(cupy.asarray(x), cupy.asarray(residual), GPU.prepare_weight(w), 1e-6)
        ref_out, ref_summed = REF.add_rms_norm(x, residual, w, 1e-6)
        check(summed, ref_summed, 0)
    else:
        out, ref_out = GPU.rms_norm(cupy.asarray(x), GPU.prepare_weight(w), 1e-6), REF.rms_norm(x, w, 1e-6)
    check(out, ref_out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, SMALL_BATCH, SMALL_BATCH + 1, 16, 64, 100])
@pytest.mark.parametrize("dims", [(64, 40), (256, 1000), (2048, 3), (96, 8)])
def test_linear(dtype, tokens, dims):
    n_in, n_out = dims
    rng = np.random.default_rng(tokens * 7 + n_in)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    w = weight(rng, (n_out, n_in), dtype)
    bias = (0.1 * rng.standard_normal(n_out)).astype(np.float32) if tokens % 2 else None
    poison()
    ours = GPU.linear(cupy.asarray(x), GPU.prepare_weight(w), None if bias is None else GPU.prepare_weight(bias))
    tolerance = 1e-5 if tokens <= SMALL_BATCH or dtype == "float32" else 1e-4
    check(ours, REF.linear(x, REF.prepare_weight(w), bias), tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, SMALL_BATCH, SMALL_BATCH + 1, 16])
@pytest.mark.parametrize("outs", [(96, 40, 40), (2048, 256, 256), (64,), (8, 1000)])
def test_linears(dtype, tokens, outs, monkeypatch):
    """Several projections of one x (q, k, v) in one launch of linear_rows at GEMV sizes, as `linear` each."""
    rng = np.random.default_rng(tokens * 11 + sum(outs))
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    weights = [weight(rng, (n, 256), dtype) for n in outs]
    biases = [(0.1 * rng.standard_normal(n)).astype(np.float32) if m != 1 else None for m, n in enumerate(outs)]
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.linears(cupy.asarray(x), [GPU.prepare_weight(w) for w in weights],
                       [None if b is None else GPU.prepare_weight(b) for b in biases])
    assert len(launched) == 1 if tokens <= SMALL_BATCH else not any(n.startswith("linear_rows") for n in launched)
    reference = REF.linears(x, [REF.prepare_weight(w) for w in weights], biases)
    assert len(ours) == len(reference)
    for out, ref in zip(ours, reference):
        check(out, ref, 1e-5 if tokens <= SMALL_BATCH or dtype == "float32" else 1e-4)


def captured(stream: cupy.cuda.Stream, fn):
    """fn() run once eagerly (it compiles what the capture uses), then captured on `stream` as a CUDA graph with
    its own memory pool: (graph, what the captured call returned)."""
    with stream:
        fn()
        stream.synchronize()
        with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):
            stream.begin_capture()
            try:
                result = fn()
            finally:
                graph = stream.end_capture()
    return graph, result


def check_replays(graph, stream, x, out, rng, reference, tolerance: float) -> None:
    """Replay a captured projection twice on new inputs written into its input buffer x [T, In], its output
    poisoned before each replay, against reference(inputs)."""
    for _ in range(2):
        host = rng.standard_normal(x.shape).astype(np.float32)
        x.set(host, stream=stream)
        out.fill(np.nan)
        graph.launch(stream=stream)
        stream.synchronize()
        check(out, reference(host), tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, DENSE_MMA_MIN_TOKENS, 16, 64, 100])
@pytest.mark.parametrize("dims", [(256, 1000), (2048, 40), (64, 8), (1000, 256), (4096, 136)])
def test_linear_captured_in_a_cuda_graph(dtype, tokens, dims, monkeypatch):
    """Projections inside a graph capture (where CuPy refuses cuBLAS): bf16/fp16 ones of DENSE_MMA_MIN_TOKENS
    tokens or more on linear_mma (split over the columns when the rows alone do not fill the GPU), from
    CAPTURED_CUBLAS_ALL_MIN_TOKENS on cuBLAS, the rest on linear_rows; replayed twice on new inputs against NumPy,
    outputs poisoned (a split output that the replay does not zero again would add up)."""
    n_in, n_out = dims
    rng = np.random.default_rng(tokens * 5 + n_out)
    w = weight(rng, (n_out, n_in), dtype)
    bias = (0.1 * rng.standard_normal(n_out)).astype(np.float32)
    device_w, device_bias = GPU.prepare_weight(w), GPU.prepare_weight(bias)
    x = cupy.zeros((tokens, n_in), np.float32)  # [T, In] fixed input buffer
    stream = cupy.cuda.Stream(non_blocking=True)
    launched = launched_kernels(monkeypatch)
    graph, out = captured(stream, lambda: (launched.clear(), GPU.linear(x, device_w, device_bias))[1])
    w_type = storage_type(device_w)
    tensor_cores = tokens >= DENSE_MMA_MIN_TOKENS and dtype != "float32"
    if tensor_cores and tokens >= CAPTURED_CUBLAS_ALL_MIN_TOKENS:
        assert launched == [f"to_storage_split<{w_type}>"]  # then cuBLAS, then CuPy's add
    elif tensor_cores:
        assert launched == [f"linear_mma<{w_type}, {smallest_tile(-(-tokens // 8), LINEAR_MMA_TILES)}>"]
    else:
        assert launched == [f"linear_rows<{w_type}, {smallest_tile(tokens, TOKEN_TILES)}>"]
    check_replays(graph, stream, x, out, rng, lambda host: REF.linear(host, REF.prepare_weight(w), bias),
                  1e-4 if tensor_cores else 1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [CAPTURED_CUBLAS_MIN_TOKENS - 1, CAPTURED_CUBLAS_MIN_TOKENS, 64])
def test_lm_head_sized_projections_captured_on_cublas(dtype, tokens, monkeypatch):
    """A captured projection of CAPTURED_CUBLAS_MIN_ROWS rows or more runs on cuBLAS from
    CAPTURED_CUBLAS_MIN_TOKENS tokens (through ctypes: CuPy refuses inside a capture), below on linear_mma; every
    replay on new inputs matches NumPy."""
    rng = np.random.default_rng(tokens)
    n_in, n_out = 256, CAPTURED_CUBLAS_MIN_ROWS + 100
    w = weight(rng, (n_out, n_in), dtype)
    device_w = GPU.prepare_weight(w)
    x = cupy.zeros((tokens, n_in), np.float32)  # [T, In]
    stream = cupy.cuda.Stream(non_blocking=True)
    launched = launched_kernels(monkeypatch)
    graph, out = captured(stream, lambda: (launched.clear(), GPU.linear(x, device_w))[1])
    w_type = storage_type(device_w)
    on_cublas = tokens >= CAPTURED_CUBLAS_MIN_TOKENS
    assert launched == ([f"to_storage_split<{w_type}>"] if on_cublas
                        else [f"linear_mma<{w_type}, {smallest_tile(-(-tokens // 8), LINEAR_MMA_TILES)}>"])
    check_replays(graph, stream, x, out, rng, lambda host: REF.linear(host, REF.prepare_weight(w), None), 1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [DENSE_MMA_MIN_TOKENS, 16, CAPTURED_CUBLAS_ALL_MIN_TOKENS - 1])
@pytest.mark.parametrize("outs", [(4096, 512, 512), (2048, 256), (136,)])
def test_linears_capturedon_tensor_cores(dtype, tokens, outs, monkeypatch):
    """q, k and v of a captured step of several tokens: one launch of linear_mma for all of them, split over the
    columns, each output as `linear` computes it, on every replay."""
    rng = np.random.default_rng(tokens + sum(outs))
    n_in = 2048
    weights = [weight(rng, (n, n_in), dtype) for n in outs]
    biases = [(0.1 * rng.standard_normal(n)).astype(np.float32) if m != 1 else None for m, n in enumerate(outs)]
    device_weights = [GPU.prepare_weight(w) for w in weights]
    device_biases = [None if b is None else GPU.prepare_weight(b) for b in biases]
    x = cupy.zeros((tokens, n_in), np.float32)  # [T, In]
    launched = launched_kernels(monkeypatch)
    graph, results = captured(cupy.cuda.Stream(non_blocking=True),
                              lambda: (launched.clear(), GPU.linears(x, device_weights, device_biases))[1])
    assert len(launched) == 1 and launched[0].startswith("linear_mma"), launched
    assert GPU.column_splits(n_in, sum(-(-n // LINEAR_MMA_ROWS) for n in outs)) > 1
    for _ in range(2):
        host = rng.standard_normal((tokens, n_in)).astype(np.float32)
        x.set(host)
        for out in results:
            out.fill(np.nan)
        graph.launch()
        cupy.cuda.Device().synchronize()
        for out, ref in zip(results, REF.linears(host, [REF.prepare_weight(w) for w in weights], biases)):
            check(out, ref, 1e-4)


def test_elementwise():
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, 5, 48)).astype(np.float32) * 4
    poison()
    check(GPU.silu_mul(cupy.asarray(gate), cupy.asarray(up)), REF.silu_mul(gate, up))
    check(GPU.sigmoid(cupy.asarray(gate)), REF.sigmoid(gate))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_from_float32_rounds_to_nearest_even(dtype):
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 100
    poison()
    ours = cupy.asnumpy(GPU.from_float32(cupy.asarray(values), dtype))
    expected = values.astype(STORAGE[dtype]).view(np.uint16 if dtype == "bfloat16" else np.float16)
    assert np.array_equal(ours.view(np.uint16), expected.view(np.uint16))


def attention_batch(rng, seqs: list[tuple[int, int]], block_size: int, num_blocks: int) -> ForwardBatch:
    """Sequences of (context length, tokens computed this step), their blocks scattered over the cache."""
    per_seq = [-(-context // block_size) for context, _ in seqs]
    blocks = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), max(per_seq)), np.int64)
    offset = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = blocks[offset:offset + n]
        offset += n
    lens = np.array([q for _, q in seqs])
    query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(c - q, c) for c, q in seqs]).astype(np.int64)
    owner = np.repeat(np.arange(len(seqs)), lens)
    return ForwardBatch(
        token_ids=np.zeros(len(positions), np.int64), positions=positions, query_start=query_start,
        context_lens=np.array([c for c, _ in seqs], np.int64), block_tables=tables,
        slot_mapping=tables[owner, positions // block_size] * block_size + positions % block_size,
        logits_indices=query_start[1:] - 1)


def attention_case(rng, seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, head_dim: int,
                   kv_dtype: str) -> tuple:
    """(batch, (host keys, device keys), (host values, device values), query [T, Q, D] on the host, the device
    batch) of random caches of `kv_dtype` over `attention_batch`'s sequences."""
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    batch = attention_batch(rng, seqs, block_size, num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    values = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    query = rng.standard_normal((batch.num_tokens, heads, head_dim)).astype(np.float32)
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    return batch, keys, values, query, device_batch


@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention(head_dim, window, block_size, kv_dtype, monkeypatch):
    """Sequences of several tokens (T != B): paged_attention, a block per (token, query head), over a cache of
    each KV dtype (the same rounded values on both backends, fp8 with scales: float32 tolerance). The 37-token
    chunk would take the flash kernel (tests/test_gpu_flash_attention.py): its threshold is raised past it."""
    monkeypatch.setattr(cupy_flash_attention, "FLASH_MIN_TOKENS", 1 << 30)
    rng = np.random.default_rng(head_dim + block_size)
    seqs = [(1, 1), (37, 37), (100, 1), (64, 5), (200, 1)]
    batch, (key_cache, gpu_keys), (value_cache, gpu_values), query, device_batch = attention_case(
        rng, seqs, block_size, 8, 2, head_dim, kv_dtype)
    scale = head_dim**-0.5
    launched = launched_kernels(monkeypatch)
    poison()
    scales = KV_SCALES[kv_dtype]
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, scale, window, scales)
    assert launched == [f"paged_attention<{KV_CTYPES[kv_dtype]}, { {24: 1, 64: 2, 128: 4}[head_dim]}>"]
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, scale, window, scales))


@pytest.mark.parametrize("heads,kv_heads,head_dim,sinks", [(8, 1, 576, False), (4, 1, 280, True)])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attention_by_sequence_takes_latent_rows(heads, kv_heads, head_dim, sinks, window, kv_dtype, monkeypatch):
    """Rows wider than the kernels' heads (latent attention's kv_lora_rank + rope width: 576 for DeepSeek-V3), with
    or without sink logits, take cupy_latent.py's path of CuPy operations, no kernel of ours: the NumPy attention's
    result, decode tokens and chunks alike, over every KV dtype."""
    rng = np.random.default_rng(head_dim + heads)
    block_size = 16
    seqs = [(1, 1), (37, 37), (100, 1), (64, 5)]
    batch, (key_cache, gpu_keys), (value_cache, gpu_values), query, device_batch = attention_case(
        rng, seqs, block_size, heads, kv_heads, head_dim, kv_dtype)
    head_sinks = rng.standard_normal(heads).astype(np.float32) * 2 if sinks else None
    launched = launched_kernels(monkeypatch)
    scales, scale = KV_SCALES[kv_dtype], head_dim**-0.5
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, scale, window, scales,
                               None if head_sinks is None else cupy.asarray(head_sinks))
    assert launched == []
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, scale, window, scales, head_sinks))


SINK_KERNELS = {  # path: (the kernels it launches, decode tokens or chunks)
    "paged_attention": (["paged_attention<__nv_bfloat16, 2>"], False),
    "gqa": (["paged_attention_gqa<__nv_bfloat16, 2, 4>"], True),
    "gqa_split": (["paged_attention_gqa<__nv_bfloat16, 2, 4>", "paged_attention_merge"], True),
    "flash_decode": (["flash_decode<__nv_bfloat16, 64, 2>", "paged_attention_merge"], True),
    "flash_attention": (["flash_attention<__nv_bfloat16, 64, true>"], False),
}


@pytest.mark.parametrize("path", list(SINK_KERNELS))
@pytest.mark.parametrize("window", [None, 16])
def test_sink_logits_in_every_attention_kernel(path, window, monkeypatch):
    """gpt-oss's sink logits (one more term of each head's softmax, whose value is zero) in each attention kernel
    and in the merge of split decode partials, against the NumPy attention; one head's sink far above its scores
    (its output near zero) and one far below."""
    monkeypatch.setattr(cupy_flash_attention, "FLASH_MIN_TOKENS", 16 if path == "flash_attention" else 1 << 30)
    monkeypatch.setattr(cupy_backend, "FLASH_DECODE_MIN_KEYS", 1 if path == "flash_decode" else 1 << 40)
    if path == "gqa":
        monkeypatch.setattr(cupy_backend, "GQA_MAX_SPLITS", 1)
    kernels, decode = SINK_KERNELS[path]
    rng = np.random.default_rng(len(path) + (window or 0))
    seqs = [(p + 1, 1) for p in (0, 36, 143, 511)] if decode else [(1, 1), (37, 37), (100, 1), (64, 40)]
    batch, (key_cache, gpu_keys), (value_cache, gpu_values), query, device_batch = attention_case(
        rng, seqs, 16, 8, 2, 64, "bfloat16")
    sinks = (rng.standard_normal(8) * 2).astype(np.float32)
    sinks[3], sinks[5] = 30.0, -30.0
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, 0.125, window,
                               (1.0, 1.0), cupy.asarray(sinks))
    assert [name for name in launched if not name.startswith("to_storage")] == kernels, launched
    reference = REF.paged_attention(query, key_cache, value_cache, batch, {}, 0.125, window, (1.0, 1.0), sinks)
    check(ours, reference, 1e-5 if path.startswith(("paged", "gqa")) else MMA_TOLERANCE)
    without = REF.paged_attention(query, key_cache, value_cache, batch, {}, 0.125, window, (1.0, 1.0), None)
    assert np.linalg.norm(reference - without) > 0.1 * np.linalg.norm(reference)  # the sinks count


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(32, 4), (32, 8), (8, 8), (16, 1), (12, 4)])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention_decode(head_dim, heads, kv_heads, window, split, kv_dtype, monkeypatch):
    """One token per sequence (T == B): paged_attention_gqa, a block per (token, KV head) for the whole query group
    (12 / 4: a group of 3 padded to 4), the context split over blocks and merged by paged_attention_merge (split;
    splits of the short contexts are empty) or in one block each. The backend decides from shapes only, so the
    batch passed is None (as in decode.py's profile). bf16, fp16 and fp8 caches would take flash_decode
    (tests/test_gpu_flash_attention.py): its threshold is raised past the tables here."""
    monkeypatch.setattr(cupy_backend, "FLASH_DECODE_MIN_KEYS", 1 << 40)
    rng = np.random.default_rng(head_dim + heads + kv_heads)
    block_size = 16
    seqs = [(p + 1, 1) for p in (0, 36, 143, 200, 511)]
    batch, (key_cache, gpu_keys), (value_cache, gpu_values), query, device_batch = attention_case(
        rng, seqs, block_size, heads, kv_heads, head_dim, kv_dtype)
    scale = head_dim**-0.5
    if not split:
        monkeypatch.setattr(cupy_backend, "GQA_MAX_SPLITS", 1)
    launched = launched_kernels(monkeypatch)
    poison()
    scales = KV_SCALES[kv_dtype]
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, None, device_batch, scale, window, scales)
    per_lane = {64: 2, 96: 4, 128: 4}[head_dim]
    group = {1: 1, 2: 2, 3: 4, 4: 4, 8: 8, 16: 16}[heads // kv_heads]
    assert launched == ([f"paged_attention_gqa<{KV_CTYPES[kv_dtype]}, {per_lane}, {group}>"]
                        + (["paged_attention_merge"] if split else []))
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, scale, window, scales))


@pytest.mark.parametrize("window", [None, 40])
def test_decode_tokens_use_the_splits_their_context_fills(window, monkeypatch):
    """A launch of many splits over sequences of 1 to 700 keys (with a window: at most 40): each token cuts its
    keys into ceil(keys / GQA_SPLIT_KEYS) splits of the launch's, one split writes out directly and the merge
    combines only the splits a token used (the GQA kernel: flash_decode's threshold raised past the tables)."""
    monkeypatch.setattr(cupy_backend, "FLASH_DECODE_MIN_KEYS", 1 << 40)
    monkeypatch.setattr(cupy_backend, "GQA_SPLIT_KEYS", 8)
    monkeypatch.setattr(cupy_backend, "GQA_MAX_SPLITS", 64)
    monkeypatch.setattr(cupy_backend, "GQA_BLOCKS_PER_SM", 64)
    rng = np.random.default_rng(11)
    seqs = [(c, 1) for c in (1, 5, 8, 9, 41, 300, 700)]
    blocks = sum(-(-c // 16) for c, _ in seqs) + 2
    batch = attention_batch(rng, seqs, 16, blocks)
    shape = (blocks, 16, 2, 64)
    key_cache, gpu_keys = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), "bfloat16")
    value_cache, gpu_values = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), "bfloat16")
    query = rng.standard_normal((batch.num_tokens, 8, 64)).astype(np.float32)
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, None, device_batch, 0.125, window)
    assert launched == ["paged_attention_gqa<__nv_bfloat16, 2, 4>", "paged_attention_merge"]
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, 0.125, window))


def test_a_single_decode_token_takes_the_query_head_kernel(monkeypatch):
    """Below GQA_MIN_TOKENS tokens paged_attention (a block per query head) is faster than the GQA kernel, where the
    tables hold a short context."""
    rng = np.random.default_rng(3)
    batch = attention_batch(rng, [(144, 1)], 16, 12)
    key_cache, value_cache = rng.standard_normal((2, 12, 16, 4, 128)).astype(np.float32)
    query = rng.standard_normal((1, 32, 128)).astype(np.float32)
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.paged_attention(cupy.asarray(query), cupy.asarray(key_cache), cupy.asarray(value_cache), None,
                               device_batch, 0.1, None)
    assert launched == ["paged_attention<float, 4>"]
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, 0.1, None))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_single_decode_token_of_a_long_context_is_split_over_the_gpu(monkeypatch, kv_dtype):
    """One token whose tables hold more than GQA_ONE_TOKEN_MAX_KEYS keys takes the GQA kernel with its splits and
    the merge (a block per query head would walk the whole context alone); flash_decode's threshold is raised past
    the tables for the bf16 cache."""
    from colibri_stream.backends.tuning import GQA_ONE_TOKEN_MAX_KEYS

    monkeypatch.setattr(cupy_backend, "FLASH_DECODE_MIN_KEYS", 1 << 40)
    rng = np.random.default_rng(4)
    context = GQA_ONE_TOKEN_MAX_KEYS + 300
    blocks = -(-context // 16) + 3
    batch = attention_batch(rng, [(context, 1)], 16, blocks)
    shape = (blocks, 16, 4, 128)
    key_cache, gpu_keys = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    value_cache, gpu_values = kv_cache_pair(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    query = rng.standard_normal((1, 32, 128)).astype(np.float32)
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, None, device_batch, 0.1, None)
    assert launched == [f"paged_attention_gqa<{KV_CTYPES[kv_dtype]}, 4, 8>", "paged_attention_merge"]
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, 0.1, None))


def check_route(x: np.ndarray, router: np.ndarray, top_k: int, renormalize: bool, monkeypatch, **routing) -> None:
    """GPU.route against REF.route (same ids, weights within 1e-5), on the kernel the token count selects, with
    the routing options of Backend.route (`routing`: scoring, correction_bias and router_bias as host arrays,
    n_group, topk_group, scaling); the split kernel's block counters are left zero."""
    launched = launched_kernels(monkeypatch)
    poison()
    on_gpu = {name: GPU.prepare_weight(value) if name.endswith("bias") else value for name, value in routing.items()}
    weights, ids = GPU.route(cupy.asarray(x), GPU.prepare_weight(router), top_k, renormalize, **on_gpu)
    ref_weights, ref_ids = REF.route(x, REF.prepare_weight(router), top_k, renormalize, **routing)
    split = x.shape[0] <= ROUTER_SPLIT_TOKENS
    assert launched[0].startswith("route_split<" if split else "route_topk<")
    assert np.array_equal(cupy.asnumpy(ids), ref_ids)
    check(weights, ref_weights)
    assert not cupy.asnumpy(GPU._route_counters).any(), "route_split left a block counter set"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, 9, 21, ROUTER_SPLIT_TOKENS, ROUTER_SPLIT_TOKENS + 1])
@pytest.mark.parametrize("experts,top_k,hidden", [(8, 2, 4096), (60, 4, 256), (128, 8, 2048), (256, 8, 256),
                                                 (320, 6, 256)])  # past 256: the shared-memory selection
@pytest.mark.parametrize("renormalize", [False, True])
def test_route(dtype, tokens, experts, top_k, hidden, renormalize, monkeypatch):
    rng = np.random.default_rng(experts + top_k + tokens)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    check_route(x, weight(rng, (experts, hidden), dtype), top_k, renormalize, monkeypatch)


ROUTINGS = {  # Backend.route's options, the experts they take, and top-k
    "glm45": (dict(scoring="sigmoid", correction_bias=True, scaling=2.5), 160, 8),
    "deepseek_v3": (dict(scoring="sigmoid", correction_bias=True, n_group=8, topk_group=4, scaling=2.5), 256, 8),
    "minimax_m2": (dict(scoring="sigmoid", correction_bias=True), 256, 8),
    "kimi_k2": (dict(scoring="sigmoid", correction_bias=True, scaling=2.827), 384, 8),
    "groups_of_one": (dict(scoring="sigmoid", n_group=16, topk_group=5), 16, 4),
    "gpt_oss": (dict(router_bias=True), 32, 4),
    "softmax_groups": (dict(correction_bias=True, n_group=4, topk_group=2), 64, 6),
    "sigmoid_plain": (dict(scoring="sigmoid"), 8, 2),
}


@pytest.mark.parametrize("tokens", [1, 3, 9, ROUTER_SPLIT_TOKENS, ROUTER_SPLIT_TOKENS + 7])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_route_with_scoring_biases_groups_and_scaling(case, tokens, renormalize, monkeypatch):
    """Sigmoid scores, a correction bias that only chooses (spread like the scores, so it changes the choice),
    group-limited top-k, a router bias and scaling, as DeepSeek-V3, GLM-4.5, MiniMax-M2, Kimi K2 and gpt-oss
    route: both kernels against the NumPy reference."""
    options, experts, top_k = ROUTINGS[case]
    rng = np.random.default_rng(experts * 7 + tokens)
    routing = {name: rng.normal(0.0, 0.3, experts).astype(np.float32) if value is True else value
               for name, value in options.items()}
    x = rng.standard_normal((tokens, 512)).astype(np.float32)
    router = weight(rng, (experts, 512), "bfloat16")
    check_route(x, router, top_k, renormalize, monkeypatch, **routing)
    if "correction_bias" in routing and tokens > 1:  # the bias changes some choice: a kernel ignoring it would fail
        unbiased = {name: value for name, value in routing.items() if name != "correction_bias"}
        routed = (REF.route(x, REF.prepare_weight(router), top_k, renormalize, **chosen)[1]
                  for chosen in (routing, unbiased))
        assert not np.array_equal(*routed)


@pytest.mark.parametrize("router_tile", [1, 4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 21, ROUTER_SPLIT_TOKENS])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2)])
def test_route_with_other_token_tiles(router_tile, tokens, experts, top_k, monkeypatch):
    """route_split with other numbers of tokens per block than the default (1: as many tiles and block counters
    as tokens; 8: a selecting warp takes two tokens)."""
    monkeypatch.setattr(cupy_backend, "ROUTER_TILE", router_tile)
    rng = np.random.default_rng(router_tile * 100 + tokens + experts)
    x = rng.standard_normal((tokens, 2048)).astype(np.float32)
    check_route(x, weight(rng, (experts, 2048), "bfloat16"), top_k, True, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 9, ROUTER_SPLIT_TOKENS + 36])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (320, 6)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_ties_go_to_the_lower_expert(dtype, tokens, experts, top_k, renormalize, monkeypatch):
    """Logits computed exactly (small integers over 64, sums of at most 16 significant bits, in any order) and
    every expert row repeated once: equal probabilities everywhere, ranked by expert id on both backends."""
    rng = np.random.default_rng(tokens + experts)
    x = rng.integers(-3, 4, (tokens, 256)).astype(np.float32)
    rows = rng.integers(-2, 3, (experts // 2, 256)).astype(np.float32) / 64
    router = rows[rng.permutation(np.arange(experts) % (experts // 2))].astype(STORAGE[dtype])  # each row twice
    check_route(x, router, top_k, renormalize, monkeypatch)


@pytest.mark.parametrize("tokens", [1, 16])
def test_route_replayed_in_a_cuda_graph(tokens):
    """route_split captured once and replayed on new inputs: its counters reset themselves between replays."""
    rng = np.random.default_rng(tokens)
    router = weight(rng, (128, 2048), "bfloat16")
    device_router = GPU.prepare_weight(router)
    x = cupy.asarray(rng.standard_normal((tokens, 2048)).astype(np.float32))  # [T, H] fixed input buffer
    stream, pool = cupy.cuda.Stream(non_blocking=True), cupy.cuda.MemoryPool()  # as DecodeGraph: its own pool
    with stream:
        GPU.route(x, device_router, 8, True)  # compiles outside the capture
        stream.synchronize()
        with cupy.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                weights, ids = GPU.route(x, device_router, 8, True)
            finally:
                graph = stream.end_capture()
        for _ in range(3):
            host = rng.standard_normal((tokens, 2048)).astype(np.float32)
            x.set(host, stream=stream)
            graph.launch(stream=stream)
            stream.synchronize()
            ref_weights, ref_ids = REF.route(host, REF.prepare_weight(router), 8, True)
            assert np.array_equal(cupy.asnumpy(ids), ref_ids)
            check(weights, ref_weights)


@pytest.mark.parametrize("qk_norm", ["none", "per_head", "full"])
@pytest.mark.parametrize("clip", [None, 0.8])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 24), (32, 4, 128), (16, 16, 64), (12, 1, 256)])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("rotated", [1.0, 0.5, 0.25])  # the share of each head's dimensions rotated (rotary_dim)
def test_qk_norm_rope_write(qk_norm, clip, heads, kv_heads, head_dim, tokens, kv_dtype, rotated):
    """The fused prologue against the NumPy composition: rotated q, k and v in their cache slots (padding slot -1
    stores nothing), every other cache row untouched; a partial rotary (GLM-4.5, MiniMax-M2) rotates the first
    rotary_dim dimensions of each head and leaves the rest normed only. Keys in a 16-bit or fp8 cache: within one
    rounding step (KV_ROUNDING) of NumPy's, whose float32 keys differ from the kernel's in their last bits; values,
    only clamped and divided by a power of two, the same bits."""
    rng = np.random.default_rng(heads * head_dim + tokens)
    rotary_dim = 2 * max(1, int(head_dim * rotated) // 2)
    cos, sin = cos_sin_table(RopeConfig(theta=1e6), rotary_dim, 4096)
    q = rng.standard_normal((tokens, heads * head_dim)).astype(np.float32)
    k, v = rng.standard_normal((2, tokens, kv_heads * head_dim)).astype(np.float32)
    q_norm = k_norm = None
    if qk_norm != "none":
        widths = (heads * head_dim, kv_heads * head_dim) if qk_norm == "full" else (head_dim, head_dim)
        q_norm, k_norm = ((1 + 0.2 * rng.standard_normal(n)).astype(np.float32) for n in widths)
    block_size, num_blocks = 8, 4
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, gpu_keys = kv_cache_pair(rng.standard_normal(cache_shape).astype(np.float32), kv_dtype)
    value_cache, gpu_values = kv_cache_pair(rng.standard_normal(cache_shape).astype(np.float32), kv_dtype)
    positions = rng.integers(0, 4096, tokens)
    slots = rng.permutation(num_blocks * block_size)[:tokens]
    slots[tokens // 2] = -1  # a padding row
    poison()
    ours = GPU.qk_norm_rope_write(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                  None if q_norm is None else GPU.prepare_weight(q_norm),
                                  None if k_norm is None else GPU.prepare_weight(k_norm), qk_norm, 1e-6, clip,
                                  cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(positions), gpu_keys,
                                  gpu_values, cupy.asarray(slots), KV_SCALES[kv_dtype])
    reference = REF.qk_norm_rope_write(q, k, v, q_norm, k_norm, qk_norm, 1e-6, clip, cos, sin, positions,
                                       key_cache, value_cache, slots, KV_SCALES[kv_dtype])
    check(ours, reference)
    stored = slots[slots >= 0]
    ours_keys = kv_to_float32(gpu_keys).reshape(-1, kv_heads, head_dim)  # [slots, K, D]
    ours_values = kv_to_float32(gpu_values).reshape(-1, kv_heads, head_dim)
    ref_keys = key_cache.astype(np.float32).reshape(-1, kv_heads, head_dim)
    ref_values = value_cache.astype(np.float32).reshape(-1, kv_heads, head_dim)
    check(ours_keys[stored], ref_keys[stored], KV_ROUNDING[kv_dtype])
    check(ours_values[stored], ref_values[stored], 0)
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), stored)
    assert np.array_equal(ours_keys[untouched], ref_keys[untouched])
    assert np.array_equal(ours_values[untouched], ref_values[untouched])


class DictExpertStore(ExpertStore):
    """Experts held in a dict: (layer, expert) -> tensors in the storage layout."""

    def __init__(self, tensors: dict[tuple[int, int], dict[str, np.ndarray]]):
        self.tensors = tensors

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return self.tensors[(layer, expert)]


def random_experts(rng, num_experts: int, hidden: int, inter: int, dtype: str) -> DictExpertStore:
    tensors = {}
    for e in range(num_experts):
        if dtype == "int8":
            t = {n: rng.integers(-127, 128, shape).astype(np.int8)
                 for n, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))}
            t.update(gate_scale=(rng.random(inter) / 127 / np.sqrt(hidden)).astype(np.float32),
                     up_scale=(rng.random(inter) / 127 / np.sqrt(hidden)).astype(np.float32),
                     down_scale=(rng.random(hidden) / 127 / np.sqrt(inter)).astype(np.float32))
        else:
            t = {"gate": weight(rng, (inter, hidden), dtype), "up": weight(rng, (inter, hidden), dtype),
                 "down": weight(rng, (hidden, inter), dtype)}
        tensors[(5, e)] = t
    return DictExpertStore(tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 64])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 64, 48), (64, 8, 256, 128)])
@pytest.mark.parametrize("rows", MOE_ROWS_PER_WARP)
def test_routed_experts(dtype, tokens, experts, top_k, hidden, inter, rows, monkeypatch):
    """moe.cu (and moe_mma.cu from MMA_MIN_TOKENS bf16/fp16 tokens) against NumPy, with each number of weight rows
    per warp."""
    monkeypatch.setattr(cupy_moe, "moe_rows_per_warp", lambda row_bytes, budget: rows)
    rng = np.random.default_rng(tokens * 31 + experts)
    store = random_experts(rng, experts, hidden, inter, dtype)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])  # [T, k]
    weights = rng.random((tokens, top_k)).astype(np.float32)  # [T, k]
    device_store = DeviceExpertStore.upload(store, [5], experts)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids.astype(np.int32)), 5,
                              device_store)
    tensor_cores = tokens >= MMA_MIN_TOKENS and dtype in ("bfloat16", "float16")
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE if tensor_cores else 1e-5)
    stored = device_store.expert(5, 3)
    for name, array in store.expert(5, 3).items():
        assert np.array_equal(stored[name].view(np.uint8), array.view(np.uint8)), name


# ---- routed experts on tensor cores (moe_mma.cu) -------------------------------------------------------------
def fast_weight(rng, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """As `weight`, drawn in float32 (the 4096-wide experts hold 176M values)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(1 / np.sqrt(shape[-1]))
    return values.astype(STORAGE[dtype])


@functools.lru_cache(maxsize=8)
def experts_on_device(num_experts: int, hidden: int, inter: int, dtype: str):
    """(host store, device store) of random experts, built once per shape (the large one takes seconds)."""
    rng = np.random.default_rng(num_experts * 1000 + hidden + inter)
    store = DictExpertStore({(5, e): {"gate": fast_weight(rng, (inter, hidden), dtype),
                                      "up": fast_weight(rng, (inter, hidden), dtype),
                                      "down": fast_weight(rng, (hidden, inter), dtype)} for e in range(num_experts)})
    return store, DeviceExpertStore.upload(store, [5], num_experts)


def random_routing(rng, tokens: int, num_experts: int, top_k: int, hidden: int):
    """x [T, H], route weights [T, k], distinct expert ids [T, k] (int32)."""
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    return x, rng.random((tokens, top_k)).astype(np.float32), ids


def launched_kernels(monkeypatch) -> list[str]:
    """The kernel expressions the backend launches from now on (recorded, then launched as usual)."""
    names: list[str] = []

    def record(file, expression, *args, **kwargs):
        names.append(expression)
        return launch(file, expression, *args, **kwargs)

    for module in (cupy_backend, cupy_latent, cupy_latent_prefill, cupy_moe, cupy_moe_gemm, cupy_quant_moe,
                   cublas_gemm):
        monkeypatch.setattr(module, "launch", record)
    return names


def routed_step(monkeypatch, dtype: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int):
    """One step of random routing over experts_on_device's experts into a poisoned pool, its launches recorded:
    (the host store, (x, weights, ids), the kernels launched, the output)."""
    store, device_store = experts_on_device(experts, hidden, inter, dtype)
    x, weights, ids = random_routing(np.random.default_rng(tokens + hidden), tokens, experts, top_k, hidden)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    return store, (x, weights, ids), launched, ours


SWIGLU = ClampedSwiglu(limit=0.5, alpha=1.702)  # a limit the random products cross: both clamps act


def biased(store: DictExpertStore, rng, hidden: int, inter: int) -> DictExpertStore:
    """The store's experts with gate, up and down biases drawn as gpt-oss's (float32, never zero)."""
    return DictExpertStore({key: {**tensors, "gate_bias": rng.normal(0, 0.3, inter).astype(np.float32),
                                  "up_bias": rng.normal(0, 0.3, inter).astype(np.float32),
                                  "down_bias": rng.normal(0, 0.3, hidden).astype(np.float32)}
                            for key, tensors in store.tensors.items()})


@pytest.mark.parametrize("swiglu", [None, SWIGLU], ids=["silu", "clamped"])
@pytest.mark.parametrize("dtype,tokens,path", [
    ("float32", 1, "moe_down<"), ("bfloat16", 2, "moe_down<"), ("int8", 5, "moe_down<"),
    ("bfloat16", 64, "moe_down_mma<"), ("bfloat16", 256, "moe_gemm_down<"), ("float16", 512, "expert_gemms"),
    ("int4", 1, "moe_down_int4<"), ("int4", 33, "moe_down_int4<"), ("fp8", 8, "moe_down_fp8<")])
def test_biased_experts_and_the_clamped_swiglu_in_every_moe_kernel(dtype, tokens, path, swiglu, monkeypatch):
    """gpt-oss's experts (biases, the clamped SwiGLU) on each MoE path against the NumPy reference: moe.cu,
    moe_mma.cu, the grouped GEMM, the per-expert GEMMs, moe_int4.cu and moe_fp8.cu (their down product split over
    column spans, whose first alone adds the bias)."""
    experts, top_k, hidden, inter = 8, 2, 256, 128
    rng = np.random.default_rng(tokens * 7 + len(dtype))
    if dtype in ("int4", "fp8"):
        codec = Int4Codec(64, True) if dtype == "int4" else Fp8Codec("block")
        plain = DictExpertStore({(5, e): {k: v for name, shape in zip(MATRICES, ((inter, hidden), (inter, hidden),
                                                                               (hidden, inter)))
                                          for k, v in codec.quantize_matrix(
                                              name, rng.standard_normal(shape, dtype=np.float32)
                                              / np.float32(np.sqrt(shape[1]))).items()}
                                 for e in range(experts)})
    else:
        plain = random_experts(rng, experts, hidden, inter, dtype)
    store = biased(plain, rng, hidden, inter)
    if path == "expert_gemms":
        monkeypatch.setattr(cupy_expert_gemm, "EXPERT_GEMM_MIN_WORK", 1)
    device_store = DeviceExpertStore.upload(store, [5], experts)
    assert device_store.layers[5].down_bias is not None
    x, weights, ids = random_routing(rng, tokens, experts, top_k, hidden)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store, swiglu)
    if path == "expert_gemms":
        assert not any(name.startswith("moe_down") for name in launched), launched
    else:
        assert any(name.startswith(path) for name in launched), launched
    reference = REF.routed_experts(x, weights, ids, 5, store, swiglu)
    tolerance = 1e-5 if dtype == "float32" or (dtype == "int8" and tokens < MMA_MIN_TOKENS) else MMA_TOLERANCE
    check(ours, reference, tolerance)
    unbiased = REF.routed_experts(x, weights, ids, 5, plain, swiglu)
    assert np.linalg.norm(reference - unbiased) > 10 * tolerance * np.linalg.norm(reference)  # the biases count


def test_tensor_core_dispatch_rule():
    bf16, fp16 = np.zeros((2, 8), np.uint16), np.zeros((2, 8), np.float16)
    assert MMA_MIN_TOKENS == 8
    assert on_tensor_cores(bf16, 8) and on_tensor_cores(fp16, 64)
    assert not on_tensor_cores(bf16, 7)
    assert not on_tensor_cores(np.zeros((2, 8), np.float32), 64)
    assert not on_tensor_cores(np.zeros((2, 16), np.int8), 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [8, 16, 33, 64])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [
    (8, 2, 128, 256),
    (64, 8, 256, 128),
    (16, 4, 136, 200),  # rows not a multiple of 16, columns not of 32: partial tiles and a partial last chunk
    (8, 2, 4096, 1792),  # Mixtral's hidden size, an eighth of its intermediate size
])
def test_routedon_tensor_cores(dtype, tokens, experts, top_k, hidden, inter, monkeypatch):
    store, (x, weights, ids), launched, ours = routed_step(monkeypatch, dtype, tokens, experts, top_k, hidden, inter)
    w = "__nv_bfloat16" if dtype == "bfloat16" else "__half"
    n_tiles = smallest_tile(-(-tokens // 8), MMA_TILES)
    assert f"moe_gate_up_mma<{w}, {n_tiles}>" in launched and f"moe_down_mma<{w}, {n_tiles}>" in launched
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [8, 40])
def test_tensor_cores_match_cuda_cores(dtype, tokens, monkeypatch):
    _, device_store = experts_on_device(8, 256, 384, dtype)
    x, weights, ids = random_routing(np.random.default_rng(tokens), tokens, 8, 2, 256)
    args = (cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    launched = launched_kernels(monkeypatch)
    poison()
    mma = cupy.asnumpy(GPU.routed_experts(*args))
    assert any(name.startswith("moe_down_mma<") for name in launched)
    assert GPU.column_splits(384, -(-256 // MMA_DOWN_ROWS) * 8) > 1  # down's partial products add up
    launched.clear()
    monkeypatch.setattr(cupy_moe, "MMA_MIN_TOKENS", 1 << 30)  # every step on moe.cu
    poison()
    cuda_cores = GPU.routed_experts(*args)
    assert not any("_mma<" in name for name in launched) and any(name.startswith("moe_down<") for name in launched)
    check(cuda_cores, mma, MMA_TOLERANCE)


def slot_arena(tensors: list[dict[str, np.ndarray]], hidden: int, inter: int, dtype: str):
    """The experts' tensors in one raw uint8 arena of fixed-size blocks (experts.bin's layout: gate, up, down, each
    256-byte aligned, blocks of a multiple of 4096 bytes), and strided gate/up/down views of it per slot."""
    def align(n: int, to: int) -> int:
        return -(-n // to) * to

    matrix = inter * hidden * 2
    offsets = (0, align(matrix, 256), 2 * align(matrix, 256))  # gate, up, down
    block = align(offsets[2] + matrix, 4096)
    host = np.zeros((len(tensors), block), np.uint8)
    for slot, expert in enumerate(tensors):
        for name, offset in zip(("gate", "up", "down"), offsets):
            host[slot, offset:offset + matrix] = expert[name].view(np.uint8).reshape(-1)
    arena = cupy.asarray(host)  # [S, block] uint8
    device_dtype = np.uint16 if dtype == "bfloat16" else np.float16

    def view(offset: int, rows: int, cols: int):
        return cupy.ndarray((len(tensors), rows, cols), device_dtype, memptr=arena.data + offset,
                            strides=(block, 2 * cols, 2))

    return arena, view(offsets[0], inter, hidden), view(offsets[1], inter, hidden), view(offsets[2], hidden, inter)


class SlotPasses(DeviceExperts):
    """A store computing its experts in GPU slots, in the given launches (LayerExperts with slot tables)."""

    resident = False

    def __init__(self, passes: list[LayerExperts], num_experts: int):
        self._passes, self.num_experts = passes, num_experts

    def passes(self, layer: int):
        return self._passes

    def finish_layer(self, layer: int):
        return None  # nothing computed on the CPU

    def expert(self, layer: int, expert: int):
        raise AssertionError("the GPU backend reads slotted experts through passes")


def slotted_experts(rng, num_experts: int, hidden: int, inter: int, dtype: str):
    """Host tensors of every expert, an arena holding experts 0 .. num_experts - 4 in shuffled slots, and two slot
    tables splitting them between two launches; the last three experts are in no slot (never computed)."""
    tensors = [{"gate": weight(rng, (inter, hidden), dtype), "up": weight(rng, (inter, hidden), dtype),
                "down": weight(rng, (hidden, inter), dtype)} for _ in range(num_experts)]
    held = num_experts - 3
    slot_of_expert = rng.permutation(held)  # expert e < held lives in slot slot_of_expert[e]
    by_slot = [None] * held
    for e in range(held):
        by_slot[slot_of_expert[e]] = tensors[e]
    arena, gate, up, down = slot_arena(by_slot, hidden, inter, dtype)
    tables = []
    for first in (True, False):
        table = np.full(num_experts, -1, np.int32)
        for e in range(held):
            if (e % 2 == 0) == first:
                table[e] = slot_of_expert[e]
        tables.append(table)
    passes = [LayerExperts(gate, up, down, None, None, None, cupy.asarray(table)) for table in tables]
    return tensors, arena, passes, tables


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", ["cuda_cores", "tensor_cores", "grouped_gemm", "expert_gemms"])
@pytest.mark.parametrize("hidden,inter", [(256, 192), (136, 200)])  # up's rows right after gate's, or 256-aligned
def test_routed_experts_in_slot_arena(dtype, path, hidden, inter, monkeypatch):
    rng = np.random.default_rng(11)
    num_experts, top_k, tokens = 16, 4, 24
    tensors, _arena, passes, tables = slotted_experts(rng, num_experts, hidden, inter, dtype)
    x, weights, ids = random_routing(rng, tokens, num_experts, top_k, hidden)
    computed = (tables[0] >= 0) | (tables[1] >= 0)  # [E]
    assert not computed[ids].all() and computed[ids].any()
    if path == "cuda_cores":
        monkeypatch.setattr(cupy_moe, "MMA_MIN_TOKENS", 1 << 30)
    if path == "expert_gemms":
        monkeypatch.setattr(cupy_expert_gemm, "EXPERT_GEMM_MIN_WORK", 1)
    if path == "grouped_gemm":
        monkeypatch.setattr(cupy_moe_gemm, "GROUPED_GEMM_MIN_PAIRS", 1)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5,
                              SlotPasses(passes, num_experts))
    assert any("_mma<" in name for name in launched) == (path == "tensor_cores")
    assert any(name.startswith("moe_gemm_down<") for name in launched) == (path == "grouped_gemm")
    assert any(name.startswith(("moe_down", "moe_gemm_down")) for name in launched) == (path != "expert_gemms")
    # experts in no slot add nothing: the reference sees their route weights as zero
    store = DictExpertStore({(5, e): t for e, t in enumerate(tensors)})
    reference = REF.routed_experts(x, np.where(computed[ids], weights, 0).astype(np.float32), ids, 5, store)
    check(ours, reference, 1e-5 if path == "cuda_cores" else MMA_TOLERANCE)


def test_expert_gemm_dispatch_rule():
    """Per-expert GEMMs once one expert's gate product at the average group size is EXPERT_GEMM_MIN_WORK: a
    Mixtral-shaped layer from about 70 pairs per expert, a Qwen3-MoE-shaped one (128 small experts) not at
    2048-token chunks; never for int8 or float32 experts, nor inside a capture."""
    def experts(e, i, h, dtype=np.uint16, scales=False):
        gate = cupy.zeros((e, 1, 1), dtype)  # only the dtype is read; the shape is set below
        gate = cupy.lib.stride_tricks.as_strided(gate, (e, i, h), (0, 0, 0))
        scale = cupy.zeros((e, i), np.float32) if scales else None
        return LayerExperts(gate, gate, gate, scale, scale, None)

    mixtral, qwen3 = experts(8, 14336, 4096), experts(128, 768, 2048)
    assert EXPERT_GEMM_MIN_WORK == 1 << 32
    assert cupy_expert_gemm.takes_expert_gemms(mixtral, 2048 * 2, 8)
    assert cupy_expert_gemm.takes_expert_gemms(mixtral, 80 * 8, 8)
    assert not cupy_expert_gemm.takes_expert_gemms(mixtral, 64 * 8, 8)
    assert not cupy_expert_gemm.takes_expert_gemms(qwen3, 2048 * 8, 128)
    assert cupy_expert_gemm.takes_expert_gemms(qwen3, 2800 * 128, 128)
    assert not cupy_expert_gemm.takes_expert_gemms(experts(8, 14336, 4096, np.float32), 4096, 8)
    assert not cupy_expert_gemm.takes_expert_gemms(experts(8, 14336, 4096, np.int8, scales=True), 4096, 8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            assert not cupy_expert_gemm.takes_expert_gemms(mixtral, 4096, 8)
        finally:
            stream.end_capture()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,threshold", [
    (512, 8, 2, 128, 256, 1),  # the rule lowered: small shapes, 128 pairs per expert
    (700, 4, 2, 136, 200, 1),  # partial tiles in every dimension
    (4096, 8, 2, 4096, 1792, EXPERT_GEMM_MIN_WORK),  # Mixtral's hidden size, an eighth of its intermediate size
])
def test_prefill_sized_groups_run_as_expert_gemms(dtype, tokens, experts, top_k, hidden, inter, threshold,
                                                  monkeypatch):
    """An eager step whose groups are large enough multiplies each expert's group on cuBLAS: no MoE kernel but the
    routing's, the two splits into halves and the sum; the NumPy reference's result, and moe_mma.cu's."""
    monkeypatch.setattr(cupy_expert_gemm, "EXPERT_GEMM_MIN_WORK", threshold)
    store, (x, weights, ids), launched, ours = routed_step(monkeypatch, dtype, tokens, experts, top_k, hidden, inter)
    w = "__nv_bfloat16" if dtype == "bfloat16" else "__half"
    assert launched == ["moe_align", f"to_storage_split<{w}>", f"to_storage_split<{w}>", "moe_sum"], launched
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE)
    launched.clear()
    monkeypatch.setattr(cupy_expert_gemm, "EXPERT_GEMM_MIN_WORK", 1 << 62)  # the same step on moe_mma.cu
    monkeypatch.setattr(cupy_moe_gemm, "GROUPED_GEMM_MIN_PAIRS", 1 << 30)
    mma = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5,
                             experts_on_device(experts, hidden, inter, dtype)[1])
    assert any(name.startswith("moe_down_mma<") for name in launched)
    check(ours, cupy.asnumpy(mma), MMA_TOLERANCE)


def test_grouped_gemm_dispatch_rule():
    """The grouped GEMM once a step's groups average GROUPED_GEMM_MIN_PAIRS pairs: a DeepSeek-V3-shaped layer
    (256 experts, top 8) at a 2048-token chunk, not at 512 tokens; bf16 / fp16 experts without scales only."""
    def experts(e, dtype=np.uint16, scales=False):
        gate = cupy.lib.stride_tricks.as_strided(cupy.zeros((1, 1, 1), dtype), (e, 2048, 7168), (0, 0, 0))
        scale = cupy.zeros((e, 2048), np.float32) if scales else None
        return LayerExperts(gate, gate, gate, scale, scale, None)

    assert GROUPED_GEMM_MIN_PAIRS == 32
    assert cupy_moe_gemm.takes_grouped_gemm(experts(256), 2048 * 8, 256)
    assert not cupy_moe_gemm.takes_grouped_gemm(experts(256), 512 * 8, 256)
    assert cupy_moe_gemm.takes_grouped_gemm(experts(256, np.float16), 2048 * 8, 256)
    assert not cupy_moe_gemm.takes_grouped_gemm(experts(256, np.float32), 2048 * 8, 256)
    assert not cupy_moe_gemm.takes_grouped_gemm(experts(256, np.int8, scales=True), 2048 * 8, 256)
    assert not cupy_moe_gemm.takes_grouped_gemm(experts(2048), 2048 * 64, 2048)  # past moe_gemm_tiles' scan


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (512, 8, 2, 128, 256),  # whole tiles: 128 pairs per expert
    (300, 16, 4, 136, 200),  # partial tiles in every dimension, a partial last chunk of columns
    (200, 64, 8, 256, 128),  # groups of about 25 pairs (the rule lowered): one partial tile each
    (1024, 32, 8, 1024, 512),  # 256 pairs per expert, several tiles a group
])
def test_grouped_gemm_matches_numpy(dtype, precision, tokens, experts, top_k, hidden, inter, monkeypatch):
    """moe_gemm.cu against the NumPy reference, every step's experts in the two grouped launches: at matmul
    precision high (two parts of the activations) within the tensor-core tolerance, at medium (one part) within
    bf16's rounding of the activations, and the two not the same numbers."""
    monkeypatch.setattr(cupy_moe_gemm, "GROUPED_GEMM_MIN_PAIRS", 1)
    store, device_store = experts_on_device(experts, hidden, inter, dtype)
    x, weights, ids = random_routing(np.random.default_rng(tokens + hidden), tokens, experts, top_k, hidden)
    backend = GPU if precision == "high" else CupyBackend("medium")
    launched = launched_kernels(monkeypatch)
    poison()
    ours = backend.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    w, parts = storage_type(device_store.layers[5].gate), 2 if precision == "high" else 1
    assert f"moe_gemm_gate_up<{w}, {parts}>" in launched and f"moe_gemm_down<{w}, {parts}>" in launched, launched
    reference = REF.routed_experts(x, weights, ids, 5, store)
    check(ours, reference, MMA_TOLERANCE if precision == "high" else 1e-2)
    if precision == "medium":  # the activations were rounded
        assert np.linalg.norm(cupy.asnumpy(ours) - reference) > MMA_TOLERANCE / 10 * np.linalg.norm(reference)


def expert_mlp(x: np.ndarray, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """down(silu(gate x) * up x) in float32 for x [H]."""
    gate, up, down = (tensors[n].astype(np.float32) for n in ("gate", "up", "down"))
    g = gate @ x
    return down @ (g / (1 + np.exp(-g)) * (up @ x))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mma_kernels_leave_pairs_of_skipped_experts_untouched(dtype):
    """The two kernels launched directly on one slot table: y rows of pairs whose expert has slot -1 keep their
    NaN, every other row is route weight times the expert's MLP of its token."""
    rng = np.random.default_rng(12)
    num_experts, top_k, hidden, inter, tokens = 16, 4, 136, 200, 21
    tensors, _arena, passes, tables = slotted_experts(rng, num_experts, hidden, inter, dtype)
    x, weights, ids = random_routing(rng, tokens, num_experts, top_k, hidden)
    experts, table = passes[0], tables[0]
    pairs = tokens * top_k
    w = "__nv_bfloat16" if dtype == "bfloat16" else "__half"
    poison()
    group_expert, group_start = cupy.empty(num_experts, np.int32), cupy.empty(num_experts + 1, np.int32)
    sorted_pairs, num_groups = cupy.empty(pairs, np.int32), cupy.empty(1, np.int32)
    launch("moe.cu", "moe_align", (1,), 1024, (cupy.asarray(ids.reshape(pairs)), np.int32(pairs),
                                                 np.int32(num_experts), group_expert, group_start, sorted_pairs,
                                                 num_groups), shared_mem=8 * num_experts)
    routing = (group_expert, group_start, sorted_pairs, num_groups)
    act = cupy.full((pairs, inter), np.nan, np.float32)
    y = cupy.full((pairs, hidden), np.nan, np.float32)
    gate_up_args, down_args = experts.kernel_args(activation_args(None))
    groups = min(num_experts, pairs)
    n_tiles = smallest_tile(-(-tokens // 8), MMA_TILES)
    launch("moe_mma.cu", f"moe_gate_up_mma<{w}, {n_tiles}>", (-(-inter // MMA_GATE_UP_ROWS), groups), MMA_THREADS,
            (cupy.asarray(x), *gate_up_args, *routing, act, np.int32(hidden), np.int32(inter), np.int32(top_k)),
            weight_type=w)
    launch("moe_mma.cu", f"moe_down_mma<{w}, {n_tiles}>", (-(-hidden // MMA_DOWN_ROWS), groups), MMA_THREADS,
            (act, *down_args, cupy.asarray(weights.reshape(pairs)), *routing, y, np.int32(hidden), np.int32(inter),
             np.int32(inter)), weight_type=w)
    y = cupy.asnumpy(y)  # [P, H]
    skipped = table[ids.reshape(pairs)] < 0  # [P]
    assert skipped.any() and not skipped.all()
    assert np.isnan(y[skipped]).all(), "a row of a skipped expert's pair was written"
    reference = np.stack([weights.reshape(pairs)[p] * expert_mlp(x[p // top_k], tensors[ids.reshape(pairs)[p]])
                          for p in np.flatnonzero(~skipped)])
    check(y[~skipped], reference, MMA_TOLERANCE)


def test_greedy_takes_the_first_of_equal_maxima():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 5000)).astype(np.float32)
    logits[1, [7, 4000]] = 50.0  # a tie: the lower id wins, as np.argmax
    logits[2, 4999] = 60.0
    poison()
    assert np.array_equal(cupy.asnumpy(GPU.greedy(cupy.asarray(logits))), logits.argmax(axis=1))
