"""The CPU expert executor: the compiled kernel against the float32 NumPy formulas in every storage dtype, the
NumPy fallback, its counters, and the NumPy backend's use of it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.experts import cpu_executor
from colibri_stream.experts.cpu_executor import CpuExpertExecutor, intermediate_rows, numpy_expert
from colibri_stream.experts.store import ExpertStore

HIDDEN, INTER = 100, 40  # neither a multiple of the kernel's 6-row tile: the leftover rows are exercised


def expert(dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """gate [I, H], up [I, H], down [H, I] in `dtype` (int8 with float32 row scales)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        if dtype == "int8":
            scale = np.abs(w).max(axis=1) / np.float32(127)  # [rows]
            tensors[name], tensors[f"{name}_scale"] = np.round(w / scale[:, None]).astype(np.int8), scale
        else:
            tensors[name] = w.astype({"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[dtype])
    return tensors


def tokens(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, HIDDEN), dtype=np.float32)  # [n, H]


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp32", "fp16"])
@pytest.mark.parametrize("n", [1, 2, 3, 6, 7, 17])  # every mix of the 4-, 2- and 1-token tiles
def test_kernel_matches_numpy(dtype, n):
    pytest.importorskip("numba")
    executor = CpuExpertExecutor(num_threads=2, min_kernel_bytes=0)
    x, tensors = tokens(n), expert(dtype)
    reference = numpy_expert(x, tensors)
    np.testing.assert_allclose(executor.run(x, tensors), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    assert executor.library == "numba"


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp32", "fp16"])
@pytest.mark.parametrize("min_kernel_bytes", [0, 1 << 30])  # the numba kernel and the NumPy path
@pytest.mark.parametrize("cut", [1, 13, 24, 39])  # mid-tile, tile-aligned, and one row on either side
def test_parts_over_intermediate_rows_sum_to_the_expert(dtype, min_kernel_bytes, cut):
    executor = CpuExpertExecutor(num_threads=2, min_kernel_bytes=min_kernel_bytes)
    x, tensors = tokens(5), expert(dtype)
    reference = numpy_expert(x, tensors)
    first, second = executor.run(x, tensors, (0, cut)), executor.run(x, tensors, (cut, INTER))
    np.testing.assert_allclose(first + second, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    part = intermediate_rows(tensors, cut, INTER)  # the second part alone, as the NumPy reference sees it
    assert part["down"].shape == (HIDDEN, INTER - cut)
    np.testing.assert_allclose(second, numpy_expert(x, part), rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    read = sum(a.nbytes for a in part.values())
    assert executor.stats.cpu_bytes_read == sum(a.nbytes for a in intermediate_rows(tensors, 0, cut).values()) + read


def test_threads_claim_every_chunk_exactly_once():
    """_claim is the counter the kernel's threads take chunks from: across parallel threads every value is handed
    out once (a plain read-then-write would give two threads the same chunk, and lose increments)."""
    numba = pytest.importorskip("numba")
    claim = cpu_executor._claim

    @numba.njit(parallel=True)
    def take_all(counter, total, workers):
        times = np.zeros(total, np.int64)  # [total] how often each value was handed out
        for _ in numba.prange(workers):
            c = claim(counter)
            while c < total:
                times[c] += 1
                c = claim(counter)
        return times

    total, workers = 200_000, 8
    counter = np.zeros(1, np.int64)
    times = take_all(counter, total, workers)
    assert (times == 1).all()
    assert counter[0] == total + workers  # each worker's last claim is the one past the end


def test_strided_tokens_are_accepted():
    pytest.importorskip("numba")
    x, tensors = tokens(6)[::2], expert("bf16")  # [3, H], not contiguous
    got = CpuExpertExecutor(min_kernel_bytes=0).run(x, tensors)
    np.testing.assert_allclose(got, numpy_expert(x, tensors), rtol=1e-5, atol=1e-6)


def test_fallback_without_numba(monkeypatch):
    monkeypatch.setattr(cpu_executor, "numba", None)
    executor = CpuExpertExecutor()
    assert executor.library == "numpy"
    x, tensors = tokens(2), expert("int8")
    np.testing.assert_array_equal(executor.run(x, tensors), numpy_expert(x, tensors))


def test_beside_a_gpu_the_executor_leaves_the_step_thread_a_core(monkeypatch):
    assert cpu_executor.threads_beside_gpu() == max(1, CpuExpertExecutor().num_threads - 1)
    monkeypatch.setattr(cpu_executor, "numba", None)
    monkeypatch.setattr(cpu_executor.os, "cpu_count", lambda: 1)
    assert cpu_executor.threads_beside_gpu() == 1


def test_small_experts_take_the_numpy_path():
    x, tensors = tokens(2), expert("bf16")
    np.testing.assert_array_equal(CpuExpertExecutor().run(x, tensors), numpy_expert(x, tensors))


def test_counters():
    executor = CpuExpertExecutor(use_kernel=False)
    tensors = expert("bf16")
    executor.run(tokens(1), tensors)
    executor.run(tokens(4), tensors)
    stats = executor.stats
    assert stats.cpu_experts == 2 and stats.gpu_experts == 0 and stats.cpu_seconds > 0
    assert stats.cpu_bytes_read == 2 * 3 * HIDDEN * INTER * 2
    assert stats.as_dict(steps=2)["cpu_experts_per_step"] == 1.0


class OneLayer(ExpertStore):
    def __init__(self, experts):
        self.experts = experts

    def expert(self, layer, e):
        return self.experts[e]


def test_backend_routes_through_the_executor():
    store = OneLayer([expert("int8", seed) for seed in range(3)])
    x = tokens(4)
    ids = np.array([[0, 2], [2, 1], [0, 1], [2, 0]])  # [T, k]
    weights = np.full((4, 2), 0.5, np.float32)  # [T, k]
    fast, plain = NumpyBackend(CpuExpertExecutor(min_kernel_bytes=0)), NumpyBackend(CpuExpertExecutor(use_kernel=False))
    out = fast.routed_experts(x, weights, ids, 0, store)
    np.testing.assert_allclose(out, plain.routed_experts(x, weights, ids, 0, store), rtol=1e-5, atol=1e-6)
    assert fast.experts.stats.cpu_experts == 3
