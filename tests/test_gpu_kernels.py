"""Every CuPy backend operation against the NumPy reference, on fresh random inputs of several shapes (CUDA GPU).

Outputs are poisoned: before each operation the memory pool is refilled with NaN, so an element a kernel fails
to write comes back as NaN and fails the check. Error is ||ours - ref|| / ||ref||. Both backends compute in
float32 from the same stored weights (bf16 and int8 widen exactly), so the bound is 1e-5 (summation order
only), except above SMALL_BATCH tokens, where cuBLAS multiplies the activations split into a bf16/fp16 high and
low part (about 16 significant bits): 1e-4.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.backends.cupy_backend import SMALL_BATCH, CupyBackend, DeviceExpertStore  # noqa: E402
from colibri_stream.backends.numpy_backend import NumpyBackend  # noqa: E402
from colibri_stream.config import RopeConfig  # noqa: E402
from colibri_stream.experts.store import ExpertStore  # noqa: E402
from colibri_stream.model.batch import ForwardBatch  # noqa: E402
from colibri_stream.model.rope import cos_sin_table  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = CupyBackend()
REF = NumpyBackend()
STORAGE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


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
def test_embedding(dtype, tokens):
    rng = np.random.default_rng(tokens)
    table = weight(rng, (100, 96), dtype)
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


def test_elementwise():
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, 5, 48)).astype(np.float32) * 4
    poison()
    check(GPU.silu_mul(cupy.asarray(gate), cupy.asarray(up)), REF.silu_mul(gate, up))
    check(GPU.sigmoid(cupy.asarray(gate)), REF.sigmoid(gate))
    check(GPU.clip(cupy.asarray(gate), 0.5), REF.clip(gate, 0.5), 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_from_float32_rounds_to_nearest_even(dtype):
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 100
    poison()
    ours = cupy.asnumpy(GPU.from_float32(cupy.asarray(values), dtype))
    expected = values.astype(STORAGE[dtype]).view(np.uint16 if dtype == "bfloat16" else np.float16)
    assert np.array_equal(ours.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("head_dim,heads", [(24, 4), (64, 2), (128, 32)])
def test_rotary(head_dim, heads):
    rng = np.random.default_rng(head_dim)
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), head_dim, 512)
    x = rng.standard_normal((9, heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 512, 9)
    poison()
    ours = GPU.rotary(cupy.asarray(x), cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(positions))
    check(ours, REF.rotary(x, cos, sin, positions))


def test_write_kv():
    rng = np.random.default_rng(3)
    shape = (6, 8, 2, 24)  # [num_blocks, block_size, K, D]
    key_cache, value_cache = rng.standard_normal((2, *shape)).astype(np.float32)
    key, value = rng.standard_normal((2, 11, 2, 24)).astype(np.float32)
    slots = rng.permutation(48)[:11]
    gpu_keys, gpu_values = cupy.asarray(key_cache), cupy.asarray(value_cache)
    GPU.write_kv(gpu_keys, gpu_values, cupy.asarray(key), cupy.asarray(value), cupy.asarray(slots))
    REF.write_kv(key_cache, value_cache, key, value, slots)
    check(gpu_keys, key_cache, 0)
    check(gpu_values, value_cache, 0)


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


@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_attention(head_dim, window, block_size):
    rng = np.random.default_rng(head_dim + block_size)
    seqs = [(1, 1), (37, 37), (100, 1), (64, 5), (200, 1)]
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    batch = attention_batch(rng, seqs, block_size, num_blocks)
    heads, kv_heads = 8, 2
    key_cache, value_cache = rng.standard_normal((2, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    query = rng.standard_normal((batch.num_tokens, heads, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    device_batch = {name: cupy.asarray(getattr(batch, name)) for name in ("block_tables", "query_start", "positions")}
    poison()
    ours = GPU.paged_attention(cupy.asarray(query), cupy.asarray(key_cache), cupy.asarray(value_cache), batch,
                               device_batch, scale, window)
    check(ours, REF.paged_attention(query, key_cache, value_cache, batch, {}, scale, window))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route(dtype, experts, top_k, renormalize):
    rng = np.random.default_rng(experts + top_k)
    x = rng.standard_normal((21, 256)).astype(np.float32)
    router = weight(rng, (experts, 256), dtype)
    poison()
    weights, ids = GPU.route(cupy.asarray(x), GPU.prepare_weight(router), top_k, renormalize)
    ref_weights, ref_ids = REF.route(x, REF.prepare_weight(router), top_k, renormalize)
    assert np.array_equal(cupy.asnumpy(ids), ref_ids)
    check(weights, ref_weights)


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
def test_routed_experts(dtype, tokens, experts, top_k, hidden, inter):
    rng = np.random.default_rng(tokens * 31 + experts)
    store = random_experts(rng, experts, hidden, inter, dtype)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])  # [T, k]
    weights = rng.random((tokens, top_k)).astype(np.float32)  # [T, k]
    device_store = DeviceExpertStore.upload(store, [5], experts)
    poison()
    ours = GPU.routed_experts(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids.astype(np.int32)), 5,
                              device_store)
    check(ours, REF.routed_experts(x, weights, ids, 5, store))
    stored = device_store.expert(5, 3)
    for name, array in store.expert(5, 3).items():
        assert np.array_equal(stored[name].view(np.uint8), array.view(np.uint8)), name


def test_greedy_takes_the_first_of_equal_maxima():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 5000)).astype(np.float32)
    logits[1, [7, 4000]] = 50.0  # a tie: the lower id wins, as np.argmax
    logits[2, 4999] = 60.0
    poison()
    assert np.array_equal(cupy.asnumpy(GPU.greedy(cupy.asarray(logits))), logits.argmax(axis=1))
