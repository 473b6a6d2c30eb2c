"""The CPU expert worker (experts/cpu_worker.py): one compiled call per layer, handed over without the GIL.

Its weighted sums match the NumPy reference for bf16, int8, float32, int4 and fp8 experts, whole and by row
ranges, and for gpt-oss's experts (biases and the clamped SwiGLU) in bf16, int4 and mxfp4; it raises the flag word
after writing the sum; it sleeps when idle and wakes for the next job; a failing job still ends (the flag is
raised, `wait` raises).
"""

from __future__ import annotations

import ctypes
import time

import ml_dtypes
import numpy as np
import pytest

from colibri_stream.config import ClampedSwiglu
from colibri_stream.expert_codecs import Fp8Codec, Int4Codec, Mxfp4Codec, PlainCodec, expert_bias_tensors
from colibri_stream.experts import cpu_worker
from colibri_stream.experts.cpu_executor import intermediate_rows, numpy_expert
from colibri_stream.experts.jit import activation_of

pytestmark = pytest.mark.skipif(cpu_worker.numba is None, reason="numba is not installed (the `cpu` extra)")
HIDDEN, INTER, EXPERTS, TOP_K = 64, 96, 4, 2  # multiples of mxfp4's 32-channel blocks
CODECS = {"int4-g32": Int4Codec(32, False), "int4-g64-zero": Int4Codec(64, True), "fp8-block": Fp8Codec("block"),
          "fp8-channel": Fp8Codec("channel")}


def expert_blocks(dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """[EXPERTS, block] uint8 and each block's tensors (views), laid out as in experts.bin (gate, up, down, scales)."""
    if dtype in CODECS:
        return codec_blocks(CODECS[dtype], rng)
    storage = {"bf16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8), "fp32": np.dtype(np.float32)}[dtype]
    shapes = [("gate", storage, (INTER, HIDDEN)), ("up", storage, (INTER, HIDDEN)), ("down", storage, (HIDDEN, INTER))]
    if dtype == "int8":
        shapes += [("gate_scale", np.float32, (INTER,)), ("up_scale", np.float32, (INTER,)),
                   ("down_scale", np.float32, (HIDDEN,))]
    offsets, size = [], 0
    for _, kind, shape in shapes:
        offsets.append(size)
        size += -(-int(np.prod(shape)) * np.dtype(kind).itemsize // 256) * 256
    blocks = np.zeros((EXPERTS, size), np.uint8)
    views = []
    for block in blocks:
        tensors = {}
        for (name, kind, shape), offset in zip(shapes, offsets):
            view = block[offset: offset + int(np.prod(shape)) * np.dtype(kind).itemsize].view(kind).reshape(shape)
            if kind == np.int8:
                view[:] = rng.integers(-127, 128, shape)
            elif name.endswith("scale"):
                view[:] = rng.uniform(0.001, 0.01, shape)
            else:
                view[:] = (rng.standard_normal(shape) * 0.2).astype(kind)
            tensors[name] = view
        views.append(tensors)
    return blocks, views


def codec_blocks(codec, rng: np.random.Generator,
                 biased: bool = False) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Blocks of random experts quantized by `codec`, its tensors 256-byte aligned as in experts.bin; `biased`:
    with float32 gate, up and down biases after them (gpt-oss's experts)."""
    layout = codec.expert_tensors(HIDDEN, INTER) + (expert_bias_tensors(HIDDEN, INTER) if biased else [])
    sizes = [-(-int(np.prod(shape)) * np.dtype(stored(kind)).itemsize // 256) * 256 for _, kind, shape in layout]
    blocks = np.zeros((EXPERTS, sum(sizes)), np.uint8)
    views = []
    for block in blocks:
        values = {}
        for name, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
            values.update(codec.quantize_matrix(name, (rng.standard_normal(shape) * 0.2).astype(np.float32)))
        values.update({name: rng.standard_normal(shape).astype(np.float32)
                       for name, _, shape in expert_bias_tensors(HIDDEN, INTER)})
        tensors, offset = {}, 0
        for (name, kind, shape), size in zip(layout, sizes):
            view = block[offset: offset + int(np.prod(shape)) * np.dtype(stored(kind)).itemsize]
            tensors[name] = view.view(stored(kind)).reshape(shape)
            tensors[name][:] = values[name]
            offset += size
        views.append(tensors)
    return blocks, views


def stored(kind: str) -> np.dtype:
    from colibri_stream.checkpoint import NUMPY_DTYPES

    return NUMPY_DTYPES[kind]


def reference(x, ids, weights, views, items, swiglu=None) -> np.ndarray:
    """sum over items (expert, rows) of the expert's part over those rows, weighted, for the tokens routed to it
    (whole experts only where `swiglu` or biases are given)."""
    out = np.zeros_like(x)
    for expert, (first, last) in items:
        part = views[expert] if (first, last) == (0, INTER) else intermediate_rows(views[expert], first, last)
        tokens, which = np.nonzero(ids == expert)
        out[tokens] += numpy_expert(x[tokens], part, swiglu) * weights[tokens, which][:, None]
    return out


def job_items(blocks: np.ndarray, items) -> list[tuple[int, int, int, int]]:
    """The worker's (block address, first row, last row, expert) for (expert, (first, last)) items."""
    return [(blocks[e].ctypes.data, first, last, e) for e, (first, last) in items]


def assert_sums_match(out: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def routing(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)  # [T, H]
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).astype(np.int64)  # [T, k]
    weights = rng.uniform(0.1, 1.0, (tokens, TOP_K)).astype(np.float32)  # [T, k]
    return x, ids, weights


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp32", *CODECS])
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_layer_job_matches_the_numpy_reference_and_raises_the_flag(dtype, tokens):
    rng = np.random.default_rng(tokens)
    blocks, views = expert_blocks(dtype, rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=2)
    flag = np.zeros(1, np.uint32)
    try:
        x, ids, weights = routing(rng, tokens)
        used = sorted(set(ids.reshape(-1).tolist()))
        items = [(e, (0, INTER)) for e in used[:-1]] + [(used[-1], (16, INTER))]  # the last one cut by rows
        out = np.full_like(x, np.nan)  # every element must be written
        ticket = worker.submit(job_items(blocks, items), ids, x, weights, out, flag.ctypes.data, 7)
        seconds = worker.wait(ticket)
        assert flag[0] == 7 and seconds > 0
        want = reference(x, ids, weights, views, items)
        assert_sums_match(out, want)
    finally:
        worker.close()


@pytest.mark.parametrize("codec", [PlainCodec("bfloat16"), Int4Codec(32, False), Mxfp4Codec()],
                         ids=["bf16", "int4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_biased_experts_with_the_clamped_swiglu_match_the_reference(codec, tokens):
    """gpt-oss's experts: the gate and up biases before the clamped SwiGLU, the down bias added once per expert; a
    limit low enough that the clamps bite. The same blocks under silu (a worker without the activation) differ."""
    rng = np.random.default_rng(10 + tokens)
    blocks, views = codec_blocks(codec, rng, biased=True)
    swiglu = ClampedSwiglu(limit=0.5, alpha=1.702)
    x, ids, weights = routing(rng, tokens)
    x *= 4.0  # products past the limit
    items = [(e, (0, INTER)) for e in sorted(set(ids.reshape(-1).tolist()))]
    want = reference(x, ids, weights, views, items, swiglu)
    sums = {}
    for name, activation in (("swiglu", activation_of(swiglu)), ("silu", activation_of(None))):
        worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=2, activation=activation)
        try:
            out = np.full_like(x, np.nan)
            worker.wait(worker.submit(job_items(blocks, items), ids, x, weights, out))
            sums[name] = out
        finally:
            worker.close()
    assert_sums_match(sums["swiglu"], want)
    assert not np.allclose(sums["silu"], want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    bias_free = reference(x, ids, weights, [{k: v for k, v in view.items() if "bias" not in k} for view in views],
                          items, swiglu)
    assert not np.allclose(bias_free, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())  # the biases count


def test_jobs_after_an_idle_sleep_a_grown_table_and_an_unwaited_job():
    rng = np.random.default_rng(1)
    blocks, views = expert_blocks("bf16", rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=1)
    try:
        for pause in (0.0, 2 * cpu_worker.SPIN_SECONDS):  # the second job finds the worker asleep
            time.sleep(pause)
            x, ids, weights = routing(rng, 3)
            items = [(e, (0, INTER)) for e in range(EXPERTS)] * 3  # more items than the first table holds
            out = np.empty_like(x)
            ticket = worker.submit(job_items(blocks, items), ids, x, weights, out)
            with pytest.raises(RuntimeError, match="not been waited for"):
                worker.submit([], ids, x, weights, out)
            worker.wait(ticket)
            want = reference(x, ids, weights, views, items)
            assert_sums_match(out, want)
        assert worker._thread.is_alive()
    finally:
        worker.close()
    assert not worker._thread.is_alive()


def test_many_short_jobs_in_a_row_never_lose_a_wake_up():
    """The waiting thread sleeps on the DONE word (a futex on Linux) while the job runs: hundreds of short jobs, some
    after the worker went to sleep, all end with the reference's sums."""
    import threading

    rng = np.random.default_rng(4)
    blocks, views = expert_blocks("bf16", rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=2)
    x, ids, weights = routing(rng, 2)
    items = [(e, (0, INTER)) for e in sorted(set(ids.reshape(-1).tolist()))]
    want = reference(x, ids, weights, views, items)
    sums = []

    def jobs():
        for i in range(300):
            if i % 100 == 99:
                time.sleep(2 * cpu_worker.SPIN_SECONDS)  # the worker is asleep for the next one
            out = np.empty_like(x)
            worker.wait(worker.submit(job_items(blocks, items), ids, x, weights, out))
            sums.append(out)

    runner = threading.Thread(target=jobs, daemon=True)
    try:
        runner.start()
        runner.join(timeout=60)
        assert not runner.is_alive(), "a wait never ended"
        assert len(sums) == 300
        for out in sums:
            assert_sums_match(out, want)
    finally:
        worker.close()


def test_a_waiter_that_spins_through_the_job_gets_its_sums():
    """`wait_spin_seconds`: the waiting thread spins that long (here through the whole job) before it sleeps."""
    rng = np.random.default_rng(6)
    blocks, views = expert_blocks("bf16", rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=1)
    try:
        worker.wait_spin_seconds = 10.0
        x, ids, weights = routing(rng, 4)
        items = [(e, (0, INTER)) for e in range(EXPERTS)] * 8  # long enough to outlast the short spin
        out = np.empty_like(x)
        worker.wait(worker.submit(job_items(blocks, items), ids, x, weights, out))
        assert_sums_match(out, reference(x, ids, weights, views, items))
    finally:
        worker.close()


def test_a_waiter_spins_through_the_job_only_where_its_threads_leave_it_a_core():
    rng = np.random.default_rng(7)
    blocks, views = expert_blocks("bf16", rng)
    cores = cpu_worker.numba.config.NUMBA_NUM_THREADS
    for threads, spin in [(cores, 0.0), (cores - 1, cpu_worker.WAIT_SPIN_SECONDS)][:1 + (cores > 1)]:
        worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=threads)
        try:
            assert worker.wait_spin_seconds == spin, threads
        finally:
            worker.close()


def test_a_worker_nobody_holds_stops_its_thread():
    import gc

    rng = np.random.default_rng(3)
    blocks, views = expert_blocks("bf16", rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=1)
    thread = worker._thread
    del worker
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_failing_job_ends_raises_the_flag_and_reports_its_error():
    rng = np.random.default_rng(2)
    blocks, views = expert_blocks("bf16", rng)
    worker = cpu_worker.CpuLayerWorker(views[0], blocks[0], threads=1)
    flag = np.zeros(1, np.uint32)
    try:
        def failing(*args):
            raise MemoryError("no room for the expert's scratch")

        worker._shared.serve = failing
        time.sleep(20 * cpu_worker.SPIN_SECONDS)  # the worker has left the compiled loop: the next wake calls this
        x, ids, weights = routing(rng, 2)
        ticket = worker.submit([(blocks[0].ctypes.data, 0, INTER, 0)], ids, x, weights, np.empty_like(x),
                               flag.ctypes.data, 3)
        with pytest.raises(RuntimeError, match="CPU expert worker failed") as raised:
            worker.wait(ticket)
        assert isinstance(raised.value.__cause__, MemoryError) and flag[0] == 3
        assert ctypes.c_uint32.from_address(flag.ctypes.data).value == 3
    finally:
        worker.close()


def test_experts_the_kernel_does_not_serve_are_refused():
    from colibri_stream.experts.cpu_executor import CpuExpertExecutor

    half = {"gate": np.zeros((INTER, HIDDEN), np.float16)}
    assert not cpu_worker.CpuLayerWorker.serves(CpuExpertExecutor(min_kernel_bytes=0), half)
    with pytest.raises(ValueError, match="does not serve"):
        cpu_worker.CpuLayerWorker(half, np.zeros(16, np.uint8), threads=1)
    bf16 = {"gate": np.zeros((INTER, HIDDEN), ml_dtypes.bfloat16)}
    assert cpu_worker.CpuLayerWorker.serves(CpuExpertExecutor(min_kernel_bytes=0), bf16)
    assert not cpu_worker.CpuLayerWorker.serves(CpuExpertExecutor(), bf16)  # under the kernel's size threshold
    assert not cpu_worker.CpuLayerWorker.serves(CpuExpertExecutor(use_kernel=False, min_kernel_bytes=0), bf16)
    assert not cpu_worker.CpuLayerWorker.serves(None, bf16)
