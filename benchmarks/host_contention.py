"""Do the CPU expert executor's reads and pinned host -> GPU copies add up? Both read host RAM at the same time when
the hybrid placement cuts an expert between them (experts/placement.py); the hybrid bound assumes their rates add.

Measures, on one machine: pinned copies alone, the CPU executor alone (Mixtral-8x7B experts in bf16 at one token,
cycled through more memory than the caches hold), then both at once (copies queued back to back on a side stream
while the executor runs), and writes the rates to JSON.

    python benchmarks/host_contention.py --out benchmarks/results/host_contention_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

HIDDEN, INTER = 4096, 14336  # Mixtral-8x7B's expert
COPY_BYTES = 1 << 30  # one pinned source buffer


def experts(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    return [{name: rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
             for name, shape in shapes.items()} for _ in range(count)]


def cpu_rate(executor, tensors: list[dict], done) -> float:
    """Bytes per second the executor reads, cycling through the experts until done() says stop."""
    x = np.ones((1, HIDDEN), np.float32)
    moved, start = 0, time.perf_counter()
    while not done():
        for t in tensors:
            executor.run(x, t)
            moved += sum(a.nbytes for a in t.values())
    return moved / (time.perf_counter() - start)


def for_seconds(seconds: float):
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


def main() -> None:
    import cupy as cp

    from colibri_stream.experts.cpu_executor import CpuExpertExecutor
    from colibri_stream.experts.pinned import pinned_empty

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host_contention.json"))
    args = parser.parse_args()

    source = pinned_empty(1, COPY_BYTES)[0]  # [COPY_BYTES] uint8
    source[:] = 1
    target = cp.empty(COPY_BYTES, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def copy_rate(busy) -> tuple[float, float | None]:
        """Bytes per second of about args.seconds of back-to-back pinned copies, and what busy(copies_done) returns
        when run meanwhile."""
        start_event, end_event = cp.cuda.Event(), cp.cuda.Event()
        copies = max(1, int(args.seconds * 55e9 / COPY_BYTES))
        start_event.record(stream)
        for _ in range(copies):
            cp.cuda.runtime.memcpyAsync(target.data.ptr, source.ctypes.data, COPY_BYTES,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        end_event.record(stream)
        result = busy(lambda: end_event.done)
        end_event.synchronize()
        return copies * COPY_BYTES / (cp.cuda.get_elapsed_time(start_event, end_event) / 1e3), result

    executor = CpuExpertExecutor()
    weights = experts(8)  # 2.8 GB
    cpu_rate(executor, weights[:1], for_seconds(0.1))  # compile
    copy_alone, _ = copy_rate(lambda copies_done: None)
    cpu_alone = cpu_rate(executor, weights, for_seconds(args.seconds))
    copy_both, cpu_both = copy_rate(lambda copies_done: cpu_rate(executor, weights, copies_done))
    record = {"bench": "host_contention", "commit": os.environ.get("COLIBRI_COMMIT", "unknown"),
              "cpu_threads": executor.num_threads,
              "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "copy_alone_gbps": copy_alone / 1e9, "cpu_alone_gbps": cpu_alone / 1e9,
              "copy_with_cpu_gbps": copy_both / 1e9, "cpu_with_copy_gbps": cpu_both / 1e9,
              "sum_alone_gbps": (copy_alone + cpu_alone) / 1e9, "sum_together_gbps": (copy_both + cpu_both) / 1e9}
    print(json.dumps(record, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([record], indent=1) + "\n")


if __name__ == "__main__":
    main()
