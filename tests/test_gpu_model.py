"""The whole model on the CuPy backend against the NumPy backend, on tiny exported models of every architecture, and
a captured decode step (CUDA graph) against the eager step (CUDA GPU).

Tolerances: both backends compute in float32 from the same stored weights (projections of more than SMALL_BATCH
tokens go through cuBLAS with the activations split into bf16 high and low parts, about 16 significant bits), so
fp32, bf16 and int8 exports give logits within 1e-4 (relative to the largest logit) and the same 32 greedy tokens,
with a float32 KV cache. With a bf16 cache (the default) keys computed a few float32 ulps apart can round to
neighbouring bf16 values: logits within KV_BF16_TOLERANCE (one bf16 rounding step, 2^-8) of each other. At matmul
precision "medium" those projections (and prefill attention, and large experts' GEMMs) take one bf16 part of each
activation, about 8 significant bits: the logits' error norm within MEDIUM_TOLERANCE of theirs (the largest single
error reaches about 0.1 of the largest logit on the tiny qk-norm models, as NumPy with bf16-rounded inputs to its
projections gives too; the tiny latent-attention model's error norm is about 0.09 both ways, so the bound is also
1.5 times what that rounding costs NumPy).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.cuda_graph import DecodeGraph  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.llm import LLM  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402
from colibri_stream.batch import ForwardBatch  # noqa: E402
from colibri_stream.request import SamplingParams  # noqa: E402
from colibri_stream.synthetic import synthetic_model  # noqa: E402
from test_parity import NEW_TOKENS, colibri_greedy, colibri_logits, prompt_ids, relative_error  # noqa: E402
from tiny_models import GPU_ARCHITECTURES, VOCAB_SIZE, build_hf_model  # noqa: E402

pytestmark = pytest.mark.gpu

KV_TOLERANCES = {"fp32": 1e-4, "bf16": 2**-8}  # logits, relative to the largest, by KV cache dtype
MEDIUM_TOLERANCE = 5e-2  # ||logits - reference|| / ||reference|| at matmul precision medium


@pytest.fixture(scope="module", params=GPU_ARCHITECTURES)
def tiny_hf(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    build_hf_model(request.param, folder)
    return request.param, folder


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_cupy_matches_numpy(tiny_hf, dtype, kv_dtype, tmp_path):
    """Greedy tokens are compared with a float32 cache only (bf16 rounding may decide a near-tie either way)."""
    arch, hf_dir = tiny_hf
    export_model(hf_dir, tmp_path / "model", dtype="fp32" if dtype == "int8" else dtype,
                 quantize="int8" if dtype == "int8" else None, progress=False)
    cpu, gpu = load_model(tmp_path / "model", device="cpu"), load_model(tmp_path / "model", device="cuda")
    assert gpu.backend.name == "cupy"
    ids = prompt_ids()
    error = relative_error(colibri_logits(gpu, ids, kv_dtype), colibri_logits(cpu, ids, kv_dtype))
    assert error < KV_TOLERANCES[kv_dtype], arch
    if kv_dtype == "fp32":
        assert colibri_greedy(gpu, ids, NEW_TOKENS) == colibri_greedy(cpu, ids, NEW_TOKENS), arch


@pytest.mark.parametrize("kv_dtype,precision", [("fp32", "high"), ("bf16", "high"), ("bf16", "medium")])
def test_long_prompt(tiny_hf, kv_dtype, precision, tmp_path):
    arch, hf_dir = tiny_hf
    export_model(hf_dir, tmp_path / "model", dtype="bf16", progress=False)
    cpu = load_model(tmp_path / "model", device="cpu")
    gpu = load_model(tmp_path / "model", device="cuda", matmul_precision=precision)
    ids = np.random.default_rng(4).integers(3, VOCAB_SIZE, 100)
    ours, reference = colibri_logits(gpu, ids, kv_dtype), colibri_logits(cpu, ids, kv_dtype)
    if precision == "high":
        assert relative_error(ours, reference) < KV_TOLERANCES[kv_dtype], arch
    else:  # no further from NumPy than NumPy with its projections' inputs rounded to bf16 is
        rounded = load_model(tmp_path / "model", device="cpu")
        rounded.backend.linear = bf16_input_linear(rounded.backend.linear)
        rounding = norm_error(colibri_logits(rounded, ids, kv_dtype), reference)
        assert norm_error(ours, reference) < max(MEDIUM_TOLERANCE, 1.5 * rounding), (arch, rounding)


def bf16_input_linear(linear):
    """A NumPy backend's `linear` whose input is rounded to bf16 first: the one bf16 part of the activations that
    matmul precision medium multiplies."""
    def rounded(x, weight, bias=None):
        return linear(x.astype(ml_dtypes.bfloat16).astype(np.float32), weight, bias)
    return rounded


def norm_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def test_medium_precision_takes_one_part_on_every_tensor_core_path():
    """A 512-token prefill of a Mixtral-shaped layer runs its projections on cuBLAS, its experts as per-expert GEMMs
    and its attention on flash_attention: at medium precision its logits stay within MEDIUM_TOLERANCE of high's
    (error norm), and are not the same numbers (every one of those paths rounds its activations once instead of
    splitting them)."""
    ids = np.random.default_rng(5).integers(3, 32000, 512)
    logits = {}
    for precision in ("high", "medium"):
        model = synthetic_model("mixtral-8x7b", num_layers=1, device="cuda", matmul_precision=precision)
        logits[precision] = colibri_logits(model, ids, "bf16")
        del model
    assert 1e-5 < norm_error(logits["medium"], logits["high"]) < MEDIUM_TOLERANCE


def decode_batch(tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray, block_size: int) -> ForwardBatch:
    """One decode token per sequence."""
    b = len(tokens)
    rows = np.arange(b)
    return ForwardBatch(
        token_ids=tokens.astype(np.int64), positions=positions.astype(np.int64),
        query_start=np.arange(b + 1, dtype=np.int64), context_lens=(positions + 1).astype(np.int64),
        block_tables=tables, slot_mapping=tables[rows, positions // block_size] * block_size + positions % block_size,
        logits_indices=np.arange(b, dtype=np.int64))


@pytest.mark.parametrize("batch_size", [1, 3, 8])  # 8: the eager step's projections go through cuBLAS
def test_decode_graph_matches_eager(tiny_hf, batch_size, tmp_path):
    arch, hf_dir = tiny_hf
    export_model(hf_dir, tmp_path / "model", dtype="bf16", progress=False)
    model = load_model(tmp_path / "model", device="cuda")
    block_size, max_blocks = 8, 6
    kv = model.allocate_kv_cache(batch_size * max_blocks, block_size, "fp32")  # the 1e-4 below is float32's
    if not model.backend.captures(model.config, kv.dtype):  # latent attention of other widths runs eagerly
        with pytest.raises(ValueError, match="does not capture CUDA graphs of this model"):
            DecodeGraph(model, kv, batch_size, max_blocks)
        return
    tables = np.random.default_rng(0).permutation(batch_size * max_blocks).reshape(batch_size, max_blocks)
    graph = DecodeGraph(model, kv, batch_size, max_blocks)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, VOCAB_SIZE, batch_size)
    starts = rng.integers(0, 10, batch_size)
    for step in range(12):  # the first steps of a sequence attend only to what earlier steps wrote
        batch = decode_batch(tokens, starts + step, tables[:, : 4 + step % 2], block_size)
        eager = model.forward(batch, kv)  # [B, V]
        ids = graph.greedy(batch)  # rewrites the same KV slots with the same values
        assert np.array_equal(ids, eager.argmax(axis=1)), (arch, step)
        assert relative_error(cupy.asnumpy(graph.logits), eager) < 1e-4, (arch, step)
        tokens = ids


def test_decode_graphs_launch_programmatically_where_the_gpu_can():
    model = synthetic_model("olmoe-1b-7b", num_layers=1, device="cuda")
    graph = DecodeGraph(model, model.allocate_kv_cache(4, 16), 1, 4)
    assert graph.programmatic == (int(cupy.cuda.Device().compute_capability) >= 90)
    assert not DecodeGraph(model, model.allocate_kv_cache(4, 16), 1, 4, programmatic=False).programmatic


def test_a_refused_programmatic_capture_falls_back_to_plain_launches(monkeypatch):
    import colibri_stream.backends.cupy_launch as cupy_launch

    def refuse(*args, **kwargs):
        raise RuntimeError("cuLaunchKernelEx failed with CUresult 400")

    model = synthetic_model("olmoe-1b-7b", num_layers=1, device="cuda")
    kv = model.allocate_kv_cache(4, 16)
    monkeypatch.setattr(cupy_launch, "launch_programmatic", refuse)
    graph = DecodeGraph(model, kv, 1, 4)
    assert not graph.programmatic
    batch = decode_batch(np.array([5]), np.array([3]), np.arange(4).reshape(1, 4), 16)
    eager = model.forward(batch, kv)
    assert np.array_equal(graph.greedy(batch), eager.argmax(axis=1))


@pytest.mark.parametrize("programmatic", [True, False])
@pytest.mark.parametrize("batch_size", [2, 16])  # 16: the projections and experts run on tensor cores
def test_synthetic_shape_graph_matches_eager(programmatic, batch_size):
    model = synthetic_model("olmoe-1b-7b", num_layers=2, device="cuda")
    kv = model.allocate_kv_cache(4 * batch_size, 16, "fp32")  # the 1e-4 below is float32's
    tables = np.arange(4 * batch_size).reshape(batch_size, 4)
    graph = DecodeGraph(model, kv, batch_size, 4, programmatic=programmatic)
    tokens = np.arange(11, 11 + batch_size)
    for step in range(3):
        batch = decode_batch(tokens, step + 20 * (np.arange(batch_size) % 3), tables, 16)
        eager = model.forward(batch, kv)
        assert np.isfinite(eager).all()
        ids = graph.greedy(batch)
        assert np.array_equal(ids, eager.argmax(axis=1))
        assert relative_error(cupy.asnumpy(graph.logits), eager) < 1e-4
        tokens = ids


def test_engine_generates_the_same_text_on_the_gpu(tiny_model_dir):
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = ["Hello world", "The quick brown fox"]
    cpu = LLM(str(tiny_model_dir), device="cpu").generate(prompts, params)
    gpu = LLM(str(tiny_model_dir), device="auto", matmul_precision="high").generate(prompts, params)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
