"""int4 and fp8 routed experts on the GPU (kernels/moe_int4.cu, moe_fp8.cu) against the NumPy reference (CUDA GPU).

Both backends compute from the same stored codes and scales: NumPy dequantizes them to float32 (expert_codecs.py,
the reference) and multiplies in float32. The int4 kernels multiply the codes with the activations' two int8 parts
per chunk of columns (16 bits of each chunk's largest value) in integers, the fp8 kernels convert codes to bf16
exactly and multiply the activations' bf16 high and low parts; either way the results agree within the
tensor-core tolerance of moe_mma.cu. A step of a few tokens takes int4 and mxfp4 on CUDA cores instead
(moe_int4_gemv.cu: the same integer sums by dp4a). Covered: int4 groups of 32, 64 and 128, symmetric and with zero
points, the warps of a block on rows of their own and sharing rows (small grids), fp8 with tile and channel scales;
1 to 64 tokens (one to four n-tiles, one to many pairs per expert); rows that are not whole tiles, groups and scale
tiles cut by the matrix edge, the down product split over column spans; resident stacks and GPU slots of exported tiny
models, whose greedy tokens follow the NumPy backend's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from test_gpu_kernels import (GPU, MMA_TOLERANCE, REF, DictExpertStore, check, launched_kernels,  # noqa: E402
                              poison, random_routing)
from test_gpu_tiers import gpu_budget  # noqa: E402
from test_parity import NEW_TOKENS, colibri_greedy, colibri_logits, prompt_ids, relative_error  # noqa: E402
from tiny_models import build_hf_model  # noqa: E402

from colibri_stream.backends.cupy_moe import DeviceExpertStore  # noqa: E402
from colibri_stream.backends.cupy_quant_moe import QuantMatrix  # noqa: E402
from colibri_stream.backends.tuning import INT4_GEMV_MAX_TOKENS  # noqa: E402
from colibri_stream.config import ExpertStoreConfig  # noqa: E402
from colibri_stream.expert_codecs import MATRICES, Fp8Codec, Int4Codec, Mxfp4Codec  # noqa: E402
from colibri_stream.experts.gpu_tier import GpuTieredStore  # noqa: E402
from colibri_stream.loader import load_model  # noqa: E402

pytestmark = pytest.mark.gpu

CODECS = {"int4-g32-zero": Int4Codec(32, True), "int4-g64": Int4Codec(64, False), "int4-g128": Int4Codec(128, False),
          "int4-g128-zero": Int4Codec(128, True), "fp8-block": Fp8Codec("block"), "fp8-channel": Fp8Codec("channel"),
          "mxfp4": Mxfp4Codec()}
SHAPES = [
    (8, 2, 256, 128),
    (16, 4, 160, 224),  # rows not whole 128-row tiles, the last int4 group and fp8 tile cut by the matrix edge
    (8, 2, 96, 160),  # gate and up rows shorter than a group of 128: one group of 96, read in 32-column chunks
    (8, 2, 4096, 512),  # Mixtral's hidden size: 32 chunks of gate and up
    (32, 8, 2048, 768),  # Qwen3-30B-A3B's expert shape, a quarter of its experts
]


@functools.lru_cache(maxsize=8)
def quantized_experts(codec_name: str, num_experts: int, hidden: int, inter: int):
    """(host store, resident device store) of random experts quantized by the codec, built once per shape."""
    codec = CODECS[codec_name]
    rng = np.random.default_rng(num_experts * 1000 + hidden + inter)
    tensors = {}
    for e in range(num_experts):
        expert = {}
        for name, shape in zip(MATRICES, ((inter, hidden), (inter, hidden), (hidden, inter))):
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[1]))
            values += np.float32(0.02) * rng.standard_normal(shape[0], dtype=np.float32)[:, None]  # zero points != 8
            expert.update(codec.quantize_matrix(name, values))
        tensors[(5, e)] = expert
    store = DictExpertStore(tensors)
    return store, DeviceExpertStore.upload(store, [5], num_experts)


@pytest.mark.parametrize("codec_name", list(CODECS))
@pytest.mark.parametrize("tokens", [1, 3, 5, 8, 33, 64])
@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
def test_quantized_experts_match_numpy(codec_name, tokens, experts, top_k, hidden, inter, monkeypatch):
    store, device_store = quantized_experts(codec_name, experts, hidden, inter)
    x, weights, ids = random_routing(np.random.default_rng(tokens + hidden), tokens, experts, top_k, hidden)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    layout = QuantMatrix.of(device_store.layers[5].gate, device_store.layers[5].gate_scale, hidden, "gate")
    if layout.format in ("int4", "mxfp4") and tokens <= INT4_GEMV_MAX_TOKENS:  # moe_int4_gemv.cu
        codes = "Mxfp4Codes" if layout.format == "mxfp4" else "Int4Codes"
        assert any(name.startswith(f"moe_gate_up_int4_gemv<{codes}, ") for name in launched), launched
        assert any(name.startswith(f"moe_down_int4_gemv<{codes}, ") for name in launched), launched
    elif layout.format in ("int4", "mxfp4"):
        policy = ", Mxfp4Codes>" if layout.format == "mxfp4" else ">"
        assert layout.format == codec_name[:len(layout.format)]
        assert any(name.startswith(f"moe_gate_up_int4<{layout.lane_bytes}, ") and name.endswith(policy)
                   for name in launched), launched
        assert any(name.startswith("moe_down_int4<") and name.endswith(policy) for name in launched), launched
    else:
        assert any(name.startswith("moe_gate_up_fp8<") for name in launched), launched
        assert any(name.startswith("moe_down_fp8<") for name in launched), launched
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE)


@pytest.mark.parametrize("codec_name", ["int4-g128", "int4-g32-zero"])
@pytest.mark.parametrize("sharing", [1, 4])
def test_int4_gate_up_rows_owned_or_shared_by_warps(codec_name, sharing, monkeypatch):
    """The block's warps on 64 rows of their own or on 16 rows shared over quarters of the columns give the same
    products: the threshold is moved so that each shape takes the form under test."""
    import colibri_stream.backends.cupy_quant_moe as quant_moe

    monkeypatch.setattr(quant_moe, "INT4_SHARED_ROWS_BELOW_BLOCKS_PER_SM", 0 if sharing == 1 else 1 << 20)
    store, device_store = quantized_experts(codec_name, 32, 2048, 768)
    x, weights, ids = random_routing(np.random.default_rng(3), 5, 32, 8, 2048)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    assert any(name.startswith("moe_gate_up_int4<") and name.endswith(f", {sharing}>") for name in launched), launched
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE)


@pytest.mark.parametrize("codec_name", ["int4-g128", "int4-g32-zero", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("gemv", [True, False])
def test_int4_few_tokens_on_cuda_cores_or_tensor_cores(codec_name, tokens, gemv, monkeypatch):
    """A step of a few tokens gives the same products from moe_int4_gemv.cu (lanes along each row, dp4a) as from
    moe_int4.cu's tensor cores: the threshold is moved so that each takes the step."""
    import colibri_stream.backends.cupy_quant_moe as quant_moe

    monkeypatch.setattr(quant_moe, "INT4_GEMV_MAX_TOKENS", 4 if gemv else 0)
    store, device_store = quantized_experts(codec_name, 32, 2048, 768)
    x, weights, ids = random_routing(np.random.default_rng(tokens), tokens, 32, 8, 2048)
    launched = launched_kernels(monkeypatch)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids), 5, device_store)
    assert any(("_gemv<" in name) == gemv for name in launched if name.startswith("moe_down_int4")), launched
    check(ours, REF.routed_experts(x, weights, ids, 5, store), MMA_TOLERANCE)


def test_int4_chunks_follow_the_group_width():
    """A group of 128 columns reads 16 bytes a lane, 64 eight and 32 four; a row shorter than its group is one
    group of its own width, read in the largest chunk that divides it."""
    for name, hidden, lane_bytes in [("int4-g128", 256, 16), ("int4-g64", 256, 8), ("int4-g32-zero", 256, 4),
                                     ("int4-g128", 96, 4), ("int4-g128", 64, 8)]:
        _, device_store = quantized_experts(name, 8, hidden, 160)
        layer = device_store.layers[5]
        layout = QuantMatrix.of(layer.gate, layer.gate_scale, hidden, "gate")
        assert (layout.lane_bytes, layout.chunk) == (lane_bytes, 8 * lane_bytes), (name, hidden)


@pytest.mark.parametrize("codec_name", ["int4-g32-zero", "fp8-block", "mxfp4"])
def test_resident_quantized_experts_read_back_as_stored(codec_name):
    store, device_store = quantized_experts(codec_name, 8, 256, 128)
    stored = device_store.expert(5, 3)
    original = store.expert(5, 3)
    assert stored.keys() == original.keys()
    for name, array in original.items():
        assert stored[name].dtype == array.dtype, name
        assert np.array_equal(stored[name].view(np.uint8), array.view(np.uint8)), name


def test_rows_the_kernels_cannot_read_are_refused_in_one_line():
    codes = cupy.zeros((1, 8, 1, 24), np.uint8)  # int4 rows of 48 columns in one group
    with pytest.raises(ValueError, match="not whole 32-column chunks"):
        QuantMatrix.of(codes, cupy.zeros((1, 8, 1), np.float32), 48, "experts (intermediate size)")
    with pytest.raises(ValueError, match="not a multiple of 16"):
        QuantMatrix.of(cupy.zeros((1, 8, 40), np.uint8), cupy.zeros((1, 8), np.float32), 40, "experts")


EXPORTS = {"int4-g128": dict(quantize="int4"), "int4-g32-zero": dict(quantize="int4", group_size=32, zero_point=True),
           "fp8-block": dict(quantize="fp8"), "fp8-channel": dict(quantize="fp8", fp8_scales="channel"),
           "mxfp4": dict(quantize="mxfp4")}


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("export", list(EXPORTS))
def test_quantized_exports_on_the_gpu_follow_the_numpy_backend(arch, export, tmp_path):
    """A tiny model exported with quantized experts: resident on the GPU and in one GPU slot per layer (every miss
    copied, or computed on the CPU) it gives the NumPy backend's greedy tokens, logits within 1e-4 of the largest
    (tensor-core products of the activations' 16-bit parts), and the slots give the resident logits bit for bit."""
    from colibri_stream.export import export_model

    build_hf_model(arch, tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "model", dtype="fp32", progress=False, **EXPORTS[export])
    model_dir = tmp_path / "model"
    reference = load_model(str(model_dir), device="cpu")
    resident = load_model(str(model_dir), device="cuda")
    assert isinstance(resident.store, DeviceExpertStore)
    ids = prompt_ids()
    resident_logits = colibri_logits(resident, ids)
    assert relative_error(resident_logits, colibri_logits(reference, ids)) < 1e-4
    tokens = colibri_greedy(resident, ids, NEW_TOKENS)
    assert tokens == colibri_greedy(reference, ids, NEW_TOKENS)
    for cpu_experts in ("off", "all"):
        tiered = load_model(str(model_dir), device="cuda",
                            experts=ExpertStoreConfig(gpu_memory_limit=gpu_budget(model_dir, 1),
                                                      cpu_experts=cpu_experts))
        assert isinstance(tiered.store, GpuTieredStore)
        logits = colibri_logits(tiered, ids)
        if cpu_experts == "off":
            np.testing.assert_array_equal(logits, resident_logits)
        else:
            assert relative_error(logits, resident_logits) < 1e-4
        assert colibri_greedy(tiered, ids, NEW_TOKENS) == tokens
