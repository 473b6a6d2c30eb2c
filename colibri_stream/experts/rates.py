"""Start-up measurements of the rates the expert placement goes on with: pinned host -> GPU copies, the CPU expert
executor's read and arithmetic rates, and both running at once (they read the same host RAM).

`GpuTieredStore` measures on one expert block at start (`placement.Bandwidths`); `benchmarks/offload.py` reports
the same figures.
"""

from __future__ import annotations

import time

import numpy as np

from .cpu_executor import CpuExpertExecutor

FLOP_PROBE_TOKENS = 32  # tokens of the start-up measurement of the CPU expert executor's arithmetic rate


def _timed_copies(source: np.ndarray, destination: int, stream, copies: int):
    """Queue `copies` host -> GPU copies of the pinned `source` to device address `destination` on `stream`
    between two timing events; returns (start, end)."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(copies):
        cp.cuda.runtime.memcpyAsync(destination, source.ctypes.data, source.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
    end.record(stream)
    return start, end


def _copy_rate(source: np.ndarray, copies: int, start, end) -> float:
    """Bytes per second of `copies` copies of `source` timed by the events (waits for the last)."""
    import cupy as cp

    end.synchronize()
    return copies * source.nbytes / (cp.cuda.get_elapsed_time(start, end) / 1e3)


def pinned_copy_rate(source: np.ndarray, destination: int, stream, copies: int = 3) -> float:
    """Bytes per second of host -> GPU copies of the pinned `source` to device address `destination` on `stream`
    (after one untimed copy)."""
    _timed_copies(source, destination, stream, 1)
    return _copy_rate(source, copies, *_timed_copies(source, destination, stream, copies))


def cpu_expert_rates(executor: CpuExpertExecutor, tensors: dict[str, np.ndarray], params: int) -> tuple[float, float]:
    """(bytes read per second at one token, FLOP per second at FLOP_PROBE_TOKENS) of `executor` on one expert's
    `tensors` of `params` weights: the best of five runs each, after one that compiles the kernel."""
    nbytes = sum(t.nbytes for t in tensors.values())
    x = np.ones((FLOP_PROBE_TOKENS, tensors["down"].shape[0]), np.float32)  # [n, H]: down is [H, ...] in every format
    executor.run(x[:1], tensors)

    def fastest(tokens: int) -> float:  # the best of five: slow runs (a busy core) must not decide
        runs = []
        for _ in range(5):
            begin = time.perf_counter()
            executor.run(x[:tokens], tensors)
            runs.append(time.perf_counter() - begin)
        return min(runs)

    return nbytes / fastest(1), 2.0 * params * FLOP_PROBE_TOKENS / fastest(FLOP_PROBE_TOKENS)


def shared_rates(executor: CpuExpertExecutor, tensors: dict[str, np.ndarray], source: np.ndarray, destination: int,
                 stream, copies: int = 4, trials: int = 3) -> tuple[float, float]:
    """(bytes per second the CPU executor reads at one token, bytes per second of pinned host -> GPU copies) while
    both run at once: `copies` back-to-back copies of `source` to `destination` on `stream`, the executor running
    one expert's `tensors` (a block's views) over and over until they end. Both read host RAM, so each is slower
    than alone; this is what a step that cuts an expert between them gets. The trial of the median CPU rate of
    `trials`: single trials vary widely from one to the next, and the placement goes on with what this gives."""
    x = np.ones((1, tensors["down"].shape[0]), np.float32)  # [1, H]
    nbytes = sum(t.nbytes for t in tensors.values())
    results = []
    for _ in range(trials):
        start, end = _timed_copies(source, destination, stream, copies)
        runs, begin = 0, time.perf_counter()
        while runs == 0 or not end.done:
            executor.run(x, tensors)
            runs += 1
        results.append((runs * nbytes / (time.perf_counter() - begin), _copy_rate(source, copies, start, end)))
    return sorted(results)[len(results) // 2]
