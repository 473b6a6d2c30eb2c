"""flash_attention.cu (prefill attention on tensor cores) against the NumPy backend's attention (CUDA GPU).

Random queries, keys and values over a paged cache whose blocks are scattered; several sequences in one launch,
each a chunk over a cached prefix. The reference attends over the values the cache stores (its dtype's rounding of
the random float32 values). Bounds on ||ours - ref|| / ||ref||: with the split into high and low bf16 parts
(matmul precision high, the backend's default) the kernel is float32 attention to about 16 significant bits per operand:
SPLIT_TOLERANCE. With bf16 operands alone the reference takes q, k and v rounded to bf16 too, and the
probabilities' rounding (8 significant bits, errors of random sign averaged over the keys) gives a few 1e-3:
BF16_TOLERANCE. A misplaced fragment, mask or tile gives errors of order 1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.backends import cupy_flash_attention  # noqa: E402
from colibri_stream.backends.cupy_launch import NULL, launch, storage_type  # noqa: E402
from colibri_stream.backends.cupy_flash_attention import (  # noqa: E402
    FLASH_FILE,
    FLASH_MIN_TOKENS,
    FLASH_THREADS,
    FlashTileCache,
    decode_expression,
    flash_attention_launch,
)
from colibri_stream.batch import single_sequence_batch  # noqa: E402
from colibri_stream.synthetic import synthetic_model  # noqa: E402
from test_gpu_kernels import (GPU, KV_CTYPES, KV_SCALES, REF, attention_batch, check, kv_cache_pair,  # noqa: E402
                              launched_kernels, poison)
from test_parity import relative_error  # noqa: E402

pytestmark = pytest.mark.gpu

SPLIT_TOLERANCE = 1e-4
BF16_TOLERANCE = 1e-2
BLOCK_SIZE = 16
# (context, tokens computed this step) per sequence: contexts 1..600, each chunk over a cached prefix where the
# context is longer than the chunk.
CONTEXTS = (1, 2, 17, 63, 64, 65, 130, 333, 600)


def bf16_rounded(array: np.ndarray) -> np.ndarray:
    return array.astype(ml_dtypes.bfloat16).astype(np.float32)


def random_case(rng, seqs, heads: int, kv_heads: int, head_dim: int, kv_dtype: str, block_size: int = BLOCK_SIZE):
    """A batch of sequences (context, tokens computed), random queries, and random key and value caches of
    `kv_dtype` as (host, device) pairs holding the same values."""
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    batch = attention_batch(rng, seqs, block_size, num_blocks)
    caches = rng.standard_normal((2, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    query = rng.standard_normal((batch.num_tokens, heads, head_dim)).astype(np.float32)
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    return batch, device_batch, kv_cache_pair(caches[0], kv_dtype), kv_cache_pair(caches[1], kv_dtype), query


def run_flash(query, key_cache, value_cache, batch, device_batch, scale, window, split=True):
    """One launch of flash_attention.cu, whatever the dispatch rule would pick."""
    kv_type = storage_type(key_cache)
    flash = flash_attention_launch(cupy, FlashTileCache(), query, key_cache, value_cache, batch, device_batch,
                                   kv_type, scale, window, split, NULL)
    launch(FLASH_FILE, flash.expression, flash.grid, FLASH_THREADS, flash.args, shared_mem=flash.shared_mem,
           weight_type=kv_type)
    return flash.out


def check_flash(ours, query, key_cache, value_cache, batch, scale, window, split: bool) -> None:
    """ours against the NumPy attention over the host caches (with q, k, v rounded to bf16 without the split)."""
    keys, values = key_cache.astype(np.float32), value_cache.astype(np.float32)
    if split:
        check(ours, REF.paged_attention(query, keys, values, batch, {}, scale, window), SPLIT_TOLERANCE)
    else:
        check(ours, REF.paged_attention(bf16_rounded(query), bf16_rounded(keys), bf16_rounded(values), batch, {},
                                        scale, window), BF16_TOLERANCE)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("chunk", [1, 17, 128])
def test_flash_attention_matches_the_reference(chunk, group, head_dim, window, kv_dtype, split):
    rng = np.random.default_rng(chunk * 1000 + group * 100 + head_dim + (window or 0))
    seqs = [(context, min(chunk, context)) for context in CONTEXTS]
    kv_heads = 2
    batch, device_batch, (key_cache, gpu_keys), (value_cache, gpu_values), query = random_case(
        rng, seqs, group * kv_heads, kv_heads, head_dim, kv_dtype)
    scale = head_dim**-0.5
    poison()
    ours = run_flash(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, scale, window, split)
    check_flash(ours, query, key_cache, value_cache, batch, scale, window, split)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 1, 300])
def test_one_long_chunk_over_a_long_prefix(window, kv_dtype, block_size):
    """A 700-token chunk after 1300 cached tokens (Qwen3's 32 / 4 heads, d128): many key tiles per block, and with a
    window most of them skipped or partly masked (a window of 1: each token sees itself only); blocks of 8 tokens
    as well as 16."""
    rng = np.random.default_rng(7)
    batch, device_batch, (key_cache, gpu_keys), (value_cache, gpu_values), query = random_case(
        rng, [(2000, 700), (40, 40)], 32, 4, 128, kv_dtype, block_size)
    poison()
    ours = run_flash(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, 128**-0.5, window)
    check_flash(ours, query, key_cache, value_cache, batch, 128**-0.5, window, True)


def test_prefill_steps_take_the_flash_kernel_and_others_do_not(monkeypatch):
    """The backend's dispatch: a prefill step with a chunk of FLASH_MIN_TOKENS tokens takes flash_attention; one
    whose chunks are all shorter, and a head dim the kernel is not built for, take paged_attention."""
    rng = np.random.default_rng(5)
    cases = [([(200, FLASH_MIN_TOKENS), (90, 1)], 128, "flash_attention<__nv_bfloat16, 128, true>"),
             ([(200, FLASH_MIN_TOKENS - 1), (90, 2)], 128, "paged_attention<__nv_bfloat16, 4>"),
             ([(200, 100)], 48, "paged_attention<__nv_bfloat16, 2>")]
    for seqs, head_dim, expected in cases:
        batch, device_batch, (key_cache, gpu_keys), (value_cache, gpu_values), query = random_case(
            rng, seqs, 8, 2, head_dim, "bfloat16")
        launched = launched_kernels(monkeypatch)
        poison()
        ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, batch, device_batch, 0.125, None)
        assert launched == [expected]
        check_flash(ours, query, key_cache, value_cache, batch, 0.125, None, True)
        monkeypatch.undo()


def test_chunked_prefill_of_a_model_matches_paged_attention(monkeypatch):
    """A synthetic OLMoE layer (16 heads, d128) prefilling 300 tokens in chunks of 200 and 100 (the second over the
    first's cache): logits with flash_attention as with paged_attention (FLASH_MIN_TOKENS raised past any chunk)."""
    model = synthetic_model("olmoe-1b-7b", num_layers=1, device="cuda")
    ids = np.random.default_rng(3).integers(3, 1000, 300)

    def prefill() -> np.ndarray:
        kv = model.allocate_kv_cache(-(-300 // BLOCK_SIZE), BLOCK_SIZE)
        table = np.arange(-(-300 // BLOCK_SIZE))[::-1]  # blocks in reverse order: the table is honoured
        logits = []
        for start, end in ((0, 200), (200, 300)):
            batch = single_sequence_batch(ids[start:end], start, table, BLOCK_SIZE)
            batch.logits_indices = np.arange(end - start)
            logits.append(model.forward(batch, kv))
        return np.concatenate(logits)  # [300, V]

    launched = launched_kernels(monkeypatch)
    flash = prefill()
    assert sum(name.startswith("flash_attention<") for name in launched) == 2
    monkeypatch.setattr(cupy_flash_attention, "FLASH_MIN_TOKENS", 1 << 30)
    launched.clear()
    plain = prefill()
    assert not any(name.startswith("flash_attention<") for name in launched)
    assert np.isfinite(flash).all()
    assert relative_error(flash, plain) < 1e-4
    assert (flash.argmax(axis=1) == plain.argmax(axis=1)).mean() >= 0.99  # random logits: a near tie may flip


DECODE_CONTEXTS = (1, 5, 16, 17, 40, 143, 600, 2100)  # one decode token per sequence at position context - 1


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(32, 4), (32, 8), (8, 8), (16, 1), (12, 4)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "float8_e4m3"])
@pytest.mark.parametrize("splits", ["default", "many", "deep", "one"])
def test_flash_decode_matches_the_reference(head_dim, heads, kv_heads, window, kv_dtype, splits, monkeypatch):
    """Decode launches (T == B, decided from shapes: batch None) of bf16, fp16 and fp8 caches (fp8 with key and
    value scales other than 1) take flash_decode, with the context split over blocks and merged ("many": a split
    every 8 keys, up to 64; "deep": a split every 4 keys, up to 512, more than a merge block's threads, and rings
    of 4 tiles a warp, past 48 KiB of shared memory; "one": no split, the kernel writes out) or as the defaults
    split it; against float32 attention over the cache's values."""
    from colibri_stream.backends import cupy_backend, tuning

    if splits in ("many", "deep"):
        many = splits == "many"
        for name, value in (("FLASH_DECODE_SPLIT_KEYS", 8 if many else 4),
                            ("FLASH_DECODE_MAX_SPLITS", 64 if many else 512), ("FLASH_DECODE_BLOCKS_PER_SM", 64)):
            monkeypatch.setattr(cupy_backend, name, value)
        if not many:
            monkeypatch.setattr(tuning, "FLASH_DECODE_STAGES", 4)
    elif splits == "one":
        monkeypatch.setattr(cupy_backend, "FLASH_DECODE_MAX_SPLITS", 1)
    rng = np.random.default_rng(head_dim * heads + kv_heads)
    seqs = [(c, 1) for c in DECODE_CONTEXTS]
    batch, device_batch, (keys, gpu_keys), (values, gpu_values), query = random_case(
        rng, seqs, heads, kv_heads, head_dim, kv_dtype)
    scale = head_dim**-0.5
    launched = launched_kernels(monkeypatch)
    poison()
    scales = KV_SCALES[kv_dtype]
    ours = GPU.paged_attention(cupy.asarray(query), gpu_keys, gpu_values, None, device_batch, scale, window, scales)
    assert launched == [decode_expression(KV_CTYPES[kv_dtype], head_dim)] + (
        [] if splits == "one" else ["paged_attention_merge"])
    check(ours, REF.paged_attention(query, keys.astype(np.float32), values.astype(np.float32), batch, {}, scale, window,
                                    scales), SPLIT_TOLERANCE)


def test_a_captured_flash_decode_serves_every_context_length():
    """One captured decode launch (tables of 4096 keys, as a decode graph pads them) replayed at contexts of 3000,
    1 and 700 keys: each replay matches the reference of its own context (the splits a token uses follow its
    position, not the launch's shape)."""
    rng = np.random.default_rng(5)
    heads, kv_heads, head_dim, width = 32, 4, 128, 4096 // BLOCK_SIZE
    num_blocks = width + 2
    caches = rng.standard_normal((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)).astype(np.float32)
    (keys, gpu_keys), (values, gpu_values) = (kv_cache_pair(cache, "bfloat16") for cache in caches)
    table = rng.permutation(num_blocks)[:width]
    positions = cupy.zeros(1, np.int64)
    device_batch = {"block_tables": cupy.asarray(table[None, :].astype(np.int64)),  # [1, width]
                    "query_start": cupy.asarray(np.array([0, 1], np.int64)), "positions": positions}
    query = rng.standard_normal((1, heads, head_dim)).astype(np.float32)
    gpu_query = cupy.asarray(query)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        GPU.paged_attention(gpu_query, gpu_keys, gpu_values, None, device_batch, 0.1, None)  # compiled first
        stream.synchronize()
        stream.begin_capture()
        out = GPU.paged_attention(gpu_query, gpu_keys, gpu_values, None, device_batch, 0.1, None)
        graph = stream.end_capture()
        for context in (3000, 1, 700):
            positions.fill(context - 1)
            graph.launch(stream)
            stream.synchronize()
            batch = single_sequence_batch(np.zeros(1, np.int64), context - 1,
                                          table[: -(-context // BLOCK_SIZE)], BLOCK_SIZE)
            check(out, REF.paged_attention(query, keys.astype(np.float32), values.astype(np.float32), batch, {},
                                           0.1, None), SPLIT_TOLERANCE)
