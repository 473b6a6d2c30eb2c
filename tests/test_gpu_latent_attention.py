"""Multi-head Latent Attention's kernels on the GPU (cupy_latent.py: linear.cu's per_head_rows, latent_attention.cu's
latent_rope_write and latent_attention; cupy_latent_prefill.py's decompressed prefill) against the NumPy backend,
and tiny DeepSeek-V3 models of DeepSeek-V3's latent widths (kv_lora_rank 512, rope 64) whose decode steps are
captured in CUDA graphs and whose prompts prefill in the decompressed form (CUDA GPU).

latent_attention multiplies on tensor cores with the query and the probabilities split into two 16-bit parts, as
flash_decode does: within 1e-5 of the NumPy backend's float32 attention over the same stored rows (at matmul
precision medium one part each: MEDIUM_TOLERANCE).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from test_gpu_kernels import (GPU, KV_CTYPES, KV_DTYPES, KV_ROUNDING, REF, attention_case, check,  # noqa: E402
                              kv_cache_pair, kv_to_float32, launched_kernels, poison, weight)
from test_gpu_model import decode_batch  # noqa: E402
from test_parity import NEW_TOKENS, colibri_greedy, colibri_logits, prompt_ids, relative_error  # noqa: E402
from tiny_models import VOCAB_SIZE, build_hf_model  # noqa: E402

from colibri_stream.backends import cupy_latent, tuning  # noqa: E402
from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.backends.tuning import PER_HEAD_ROWS_MAX_TOKENS, TOKEN_TILES  # noqa: E402
from colibri_stream.cuda_graph import DecodeGraph  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from colibri_stream.config import RopeConfig  # noqa: E402
from colibri_stream.model.rope import cos_sin_table  # noqa: E402

pytestmark = pytest.mark.gpu

RANK, ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim: latent_attention's instantiation
# medium: q and the probabilities rounded to bf16 (about 8 significant bits each), as flash_attention's bf16 operands
MEDIUM_TOLERANCE = 1e-2
LATENT_SCALES = {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0, "float8_e4m3": 0.5}  # one scale: keys and values
NOPE, VALUE = 128, 128  # DeepSeek-V3's qk_nope_head_dim and v_head_dim: latent_prefill_attention's instantiation


def parts(query):
    """A query [T, Q, R + r] as absorbed_latent_attention's two parts (views)."""
    return query[..., :RANK], query[..., RANK:]


@pytest.mark.parametrize("kv_dtype", [d for d in KV_DTYPES if d != "float32"])
@pytest.mark.parametrize("heads", [128, 20])  # DeepSeek-V3's, and a last block of 4 heads
@pytest.mark.parametrize("splits", ["one", "many"])
def test_latent_decode_matches_numpy(kv_dtype, heads, splits, monkeypatch):
    """Decode tokens of contexts from 1 to 2000 keys over a latent cache of each 16-bit and fp8 dtype, in one split
    per token or cut over many (then merged by paged_attention_merge)."""
    if splits == "one":
        monkeypatch.setattr(cupy_latent, "LATENT_MAX_SPLITS", 1)
    rng = np.random.default_rng(heads + len(kv_dtype))
    seqs = [(p + 1, 1) for p in (0, 36, 143, 511, 1999)]
    batch, (cache, gpu_cache), _, query, device_batch = attention_case(rng, seqs, 16, heads, 1, RANK + ROPE,
                                                                       kv_dtype)
    scale, kv_scale = 0.07, LATENT_SCALES[kv_dtype]
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.absorbed_latent_attention(*parts(cupy.asarray(query)), gpu_cache, batch, device_batch, scale, kv_scale)
    kernel = f"latent_attention<{KV_CTYPES[kv_dtype]}, {RANK}, {ROPE}, true, 1>"
    assert launched == ([kernel] if splits == "one" else [kernel, "paged_attention_merge"]), launched
    check(ours, REF.absorbed_latent_attention(*parts(query), cache, batch, {}, scale, kv_scale))


@pytest.mark.parametrize("kv_dtype", [d for d in KV_DTYPES if d != "float32"])
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_latent_prefill_chunks_take_the_kernel(kv_dtype, precision, m_tiles, monkeypatch):
    """Steps of several query tokens per sequence (prefill chunks beside decode tokens): each token over its own
    causal range in the same kernel; at matmul precision medium q and the probabilities in one bf16 part each. Two
    m-tiles a block where the tokens fill the GPU (here: the rule lowered), its 24 heads and 8 past them."""
    if m_tiles == 2:
        monkeypatch.setattr(cupy_latent, "LATENT_BLOCKS_PER_SM", 0)
    rng = np.random.default_rng(len(kv_dtype))
    seqs = [(1, 1), (37, 37), (100, 1), (64, 5), (300, 45)]
    batch, (cache, gpu_cache), _, query, device_batch = attention_case(rng, seqs, 16, 24, 1, RANK + ROPE, kv_dtype)
    backend = GPU if precision == "high" else CupyBackend("medium")
    launched = launched_kernels(monkeypatch)
    poison()
    ours = backend.absorbed_latent_attention(*parts(cupy.asarray(query)), gpu_cache, batch, device_batch, 0.07, 1.0)
    split = "true" if precision == "high" else "false"
    assert launched == [f"latent_attention<{KV_CTYPES[kv_dtype]}, {RANK}, {ROPE}, {split}, {m_tiles}>"], launched
    check(ours, REF.absorbed_latent_attention(*parts(query), cache, batch, {}, 0.07, 1.0),
          1e-5 if precision == "high" else MEDIUM_TOLERANCE)


def test_latent_attention_over_a_float32_cache_goes_by_sequence(monkeypatch):
    """A float32 cache (the reference's option) takes the array operations' path: no kernel of ours, the NumPy
    result."""
    rng = np.random.default_rng(7)
    seqs = [(1, 1), (37, 37), (100, 1), (64, 5)]
    batch, (cache, gpu_cache), _, query, device_batch = attention_case(rng, seqs, 16, 8, 1, RANK + ROPE, "float32")
    launched = launched_kernels(monkeypatch)
    ours = GPU.absorbed_latent_attention(*parts(cupy.asarray(query)), gpu_cache, batch, device_batch, 0.07, 1.0)
    assert launched == [], launched
    check(ours, REF.absorbed_latent_attention(*parts(query), cache, batch, {}, 0.07, 1.0))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nope", [NOPE, 48])
def test_latent_rope_write_matches_numpy(kv_dtype, interleaved, nope, monkeypatch):
    """The query [q_nope | rotated q_rope] and the cache rows [latent | rotated k_rope] / scale at their slots
    (a negative slot writes nothing), over 11 heads (a last block of one), both rope pairings, and query widths
    apart from the latent's."""
    rng = np.random.default_rng(len(kv_dtype) + interleaved)
    t, heads, block_size, num_blocks = 6, 11, 4, 5
    q = rng.standard_normal((t, heads, nope + ROPE)).astype(np.float32)
    latent = rng.standard_normal((t, RANK)).astype(np.float32)
    k_rope = rng.standard_normal((t, ROPE)).astype(np.float32)
    cos, sin = cos_sin_table(RopeConfig(theta=1e4), ROPE, 64)
    positions = np.array([0, 5, 9, 17, 30, 63], np.int64)
    slots = np.array([3, 7, -1, 12, 0, 19], np.int64)
    scale = LATENT_SCALES[kv_dtype]
    start = rng.standard_normal((num_blocks, block_size, 1, RANK + ROPE)).astype(np.float32)
    cache, gpu_cache = kv_cache_pair(start, kv_dtype)
    launched = launched_kernels(monkeypatch)
    ours = GPU.latent_rope_write(*(cupy.asarray(a) for a in (q, latent, k_rope, cos, sin, positions)), interleaved,
                                 gpu_cache, cupy.asarray(slots), scale)
    assert launched == [f"latent_rope_write<{KV_CTYPES[kv_dtype]}>"], launched
    reference = REF.latent_rope_write(q, latent, k_rope, cos, sin, positions, interleaved, cache, slots, scale)
    check(ours, reference, 1e-6)
    assert np.array_equal(cupy.asnumpy(ours)[..., :nope], q[..., :nope])
    stored, expected = kv_to_float32(gpu_cache), cache.astype(np.float32)
    # atol: a rotated value near zero keeps a float32 rounding of its two products' (a contracted multiply-add on
    # the GPU)
    assert np.allclose(stored, expected, rtol=KV_ROUNDING[kv_dtype], atol=1e-6), kv_dtype
    assert np.array_equal(stored.reshape(-1, RANK + ROPE)[2], start.astype(cache.dtype).astype(np.float32)
                          .reshape(-1, RANK + ROPE)[2])  # slot 2 was nobody's: untouched


def up_projections(rng, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 k_up [Q, R, N] and v_up [Q, Dv, R] of DeepSeek-V3's widths."""
    return weight(rng, (heads, RANK, NOPE), "bfloat16"), weight(rng, (heads, VALUE, RANK), "bfloat16")


@pytest.mark.parametrize("kv_dtype", [d for d in KV_DTYPES if d != "float32"] + ["float32"])
@pytest.mark.parametrize("budget", ["all", "first"])
def test_decompressed_prefill_matches_numpy(kv_dtype, budget, monkeypatch):
    """A prefill step at matmul precision medium: the sequences computing LATENT_PREFILL_MIN_TOKENS tokens or more
    (a whole prompt, chunks after a cached prefix, one past a block boundary of 64 query rows) take the decompressed
    form, the others (decode tokens, a short chunk) the absorbed one in a launch of their own; with the byte budget
    lowered to the first long sequence's context, the later long ones keep the absorbed form too. Every token's
    values within bf16 operands' tolerance of the NumPy backend's absorbed form over the same stored rows."""
    rng = np.random.default_rng(len(kv_dtype) + len(budget))
    heads = 12
    seqs = [(1, 1), (150, 150), (100, 1), (364, 70), (64, 5), (900, 131)]
    batch, (cache, gpu_cache), _, query, device_batch = attention_case(rng, seqs, 16, heads, 1, RANK + ROPE,
                                                                       kv_dtype)
    query = query[..., :NOPE + ROPE].copy()  # [T, Q, N + r]
    k_up, v_up = up_projections(rng, heads)
    if budget == "first":
        row_bytes = 2 * (heads * (NOPE + VALUE) + RANK + ROPE)
        monkeypatch.setattr(tuning, "LATENT_PREFILL_MAX_BYTES", 150 * row_bytes)
    backend = CupyBackend("medium")
    scale, kv_scale = 0.07, LATENT_SCALES[kv_dtype]
    launched = launched_kernels(monkeypatch)
    poison()
    ours = backend.latent_attention(cupy.asarray(query), backend.prepare_weight(k_up), backend.prepare_weight(v_up),
                                    gpu_cache, batch, device_batch, scale, kv_scale)
    kv_type = KV_CTYPES[kv_dtype]
    assert launched[:2] == [f"latent_gather<{kv_type}, __nv_bfloat16>",
                            f"latent_prefill_attention<{NOPE}, {ROPE}, {VALUE}>"], launched
    assert (f"latent_attention<{kv_type}, {RANK}, {ROPE}, false, 1>" in launched) == (kv_dtype != "float32"), launched
    reference = REF.latent_attention(query, k_up.astype(np.float32), v_up.astype(np.float32), cache, batch, {},
                                     scale, kv_scale)
    check(ours, reference, MEDIUM_TOLERANCE)


def test_decompressed_prefill_keeps_precision_high(monkeypatch):
    """At matmul precision high a prefill step keeps the absorbed form (split products, float32-close)."""
    rng = np.random.default_rng(3)
    batch, (cache, gpu_cache), _, query, device_batch = attention_case(rng, [(200, 200)], 16, 4, 1, RANK + ROPE,
                                                                       "bfloat16")
    query = query[..., :NOPE + ROPE].copy()
    k_up, v_up = up_projections(rng, 4)
    launched = launched_kernels(monkeypatch)
    ours = GPU.latent_attention(cupy.asarray(query), GPU.prepare_weight(k_up), GPU.prepare_weight(v_up), gpu_cache,
                                batch, device_batch, 0.07, 1.0)
    assert not any(name.startswith("latent_prefill") for name in launched), launched
    check(ours, REF.latent_attention(query, k_up.astype(np.float32), v_up.astype(np.float32), cache, batch, {}, 0.07,
                                     1.0), 1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 33, PER_HEAD_ROWS_MAX_TOKENS, PER_HEAD_ROWS_MAX_TOKENS + 36])
@pytest.mark.parametrize("strided", [False, True])
def test_per_head_linear_matches_numpy(dtype, tokens, strided, monkeypatch):
    """Each head through its own matrix: per_head_rows up to PER_HEAD_ROWS_MAX_TOKENS tokens, reading a strided
    view (each head's first 128 of 192 values, as the query's part without rotary) in place; above, cuBLAS's
    batched GEMM over the activations' two parts (16-bit weights) or a float32 batched product."""
    rng = np.random.default_rng(tokens + len(dtype))
    heads, n_in, n_out = 8, 128, 96
    full = rng.standard_normal((tokens, heads, n_in + 64 * strided)).astype(np.float32)
    x = full[..., :n_in]  # [T, H, In]
    w = weight(rng, (heads, n_out, n_in), dtype)  # [H, Out, In]
    launched = launched_kernels(monkeypatch)
    poison()
    gpu_x = cupy.asarray(full)[..., :n_in]
    ours = GPU.per_head_linear(gpu_x, GPU.prepare_weight(w))
    if tokens <= PER_HEAD_ROWS_MAX_TOKENS:
        tile = next((tt for tt in TOKEN_TILES if tt >= tokens), TOKEN_TILES[-1])
        assert launched == [f"per_head_rows<{KV_CTYPES[dtype]}, {tile}>"], launched
    else:
        assert not [name for name in launched if name.startswith("per_head_rows")], launched
    batched_gemm = tokens > PER_HEAD_ROWS_MAX_TOKENS and dtype != "float32"
    check(ours, REF.per_head_linear(x, w.astype(np.float32)), 1e-4 if batched_gemm else 1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_per_head_linear_at_medium_precision_takes_one_part(dtype):
    """Above PER_HEAD_ROWS_MAX_TOKENS at matmul precision medium: x rounded to the weights' type once, within that
    rounding of the float32 product and not equal to high's."""
    rng = np.random.default_rng(len(dtype))
    x = rng.standard_normal((PER_HEAD_ROWS_MAX_TOKENS + 100, 16, 128)).astype(np.float32)  # [T, H, In]
    w = weight(rng, (16, 512, 128), dtype)  # [H, Out, In]
    reference = REF.per_head_linear(x, w.astype(np.float32))
    medium = CupyBackend("medium")
    ours = cupy.asnumpy(medium.per_head_linear(cupy.asarray(x), medium.prepare_weight(w)))
    check(ours, reference, MEDIUM_TOLERANCE)
    assert np.linalg.norm(ours - reference) > 1e-4 * np.linalg.norm(reference)


@pytest.fixture(scope="module")
def latent_model(tmp_path_factory):
    """A tiny DeepSeek-V3 model of DeepSeek-V3's latent widths, exported in bf16."""
    folder = tmp_path_factory.mktemp("latent")
    build_hf_model("deepseek_v3", folder / "hf", kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=32,
                   v_head_dim=24)
    export_model(folder / "hf", folder / "model", dtype="bf16", progress=False)
    return folder / "model"


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_latent_model_matches_numpy(latent_model, kv_dtype):
    """The whole model on both backends: logits within one cache rounding step, and the same greedy tokens with
    a bf16 cache."""
    cpu, gpu = load_model(latent_model, device="cpu"), load_model(latent_model, device="cuda")
    ids = prompt_ids()
    error = relative_error(colibri_logits(gpu, ids, kv_dtype), colibri_logits(cpu, ids, kv_dtype))
    assert error < (2**-8 if kv_dtype == "bf16" else 2**-4), error
    if kv_dtype == "bf16":
        assert colibri_greedy(gpu, ids, NEW_TOKENS, kv_dtype) == colibri_greedy(cpu, ids, NEW_TOKENS, kv_dtype)


def test_decompressed_prefill_model_matches_numpy(tmp_path, monkeypatch):
    """A tiny model of DeepSeek-V3's head widths at matmul precision medium: its prompt (past
    LATENT_PREFILL_MIN_TOKENS) prefills in the decompressed form, its logits as close to the NumPy backend's as the
    absorbed form's at the same precision (medium rounds every product's activations to bf16, so greedy tokens of
    a random model may part from float32's at a near tie: not compared)."""
    build_hf_model("deepseek_v3", tmp_path / "hf", kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
                   v_head_dim=VALUE)
    export_model(tmp_path / "hf", tmp_path / "model", dtype="bf16", progress=False)
    cpu = load_model(tmp_path / "model", device="cpu")
    gpu = load_model(tmp_path / "model", device="cuda", matmul_precision="medium")
    ids = np.random.default_rng(5).integers(3, VOCAB_SIZE, 3 * tuning.LATENT_PREFILL_MIN_TOKENS)
    reference = colibri_logits(cpu, ids, "bf16")
    launched = launched_kernels(monkeypatch)
    decompressed = relative_error(colibri_logits(gpu, ids, "bf16"), reference)
    assert f"latent_prefill_attention<{NOPE}, {ROPE}, {VALUE}>" in launched
    monkeypatch.setattr(tuning, "LATENT_PREFILL_MIN_TOKENS", 1 << 30)
    absorbed = relative_error(colibri_logits(gpu, ids, "bf16"), reference)
    assert decompressed < min(2 * absorbed, 5e-2), (decompressed, absorbed)


@pytest.mark.parametrize("batch_size", [1, 5])
def test_latent_attention_graph_matches_eager(latent_model, batch_size):
    """Decode steps of latent attention captured in a CUDA graph give the eager step's tokens and logits."""
    model = load_model(latent_model, device="cuda")
    block_size, max_blocks = 8, 6
    kv = model.allocate_kv_cache(batch_size * max_blocks, block_size, "bf16")
    assert model.backend.captures(model.config, kv.dtype)
    tables = np.random.default_rng(0).permutation(batch_size * max_blocks).reshape(batch_size, max_blocks)
    graph = DecodeGraph(model, kv, batch_size, max_blocks)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, VOCAB_SIZE, batch_size)
    starts = rng.integers(0, 10, batch_size)
    for step in range(12):
        batch = decode_batch(tokens, starts + step, tables[:, : 4 + step % 2], block_size)
        eager = model.forward(batch, kv)  # [B, V]
        ids = graph.greedy(batch)  # rewrites the same KV slots with the same values
        assert np.array_equal(ids, eager.argmax(axis=1)), step
        # the eager step of 5 tokens projects through cuBLAS: keys a few ulps apart may round to neighbouring bf16
        assert relative_error(cupy.asnumpy(graph.logits), eager) < 2**-8, step
