"""How long each hand-off between a host thread and the GPU stream takes on its own, in microseconds (median of
many): what a CPU expert hand-off in an offload step is made of (benchmarks/offload_timeline.py).

  flag_to_event      the host raises a HostFlag the stream has been waiting on -> an event after the wait is done
                     (the host polls the event)
  flag_copy_event    the same with the 16 KiB copy of a [1, 4096] float32 sum in between (what a step does)
  copy_event         that copy alone, queued on an idle stream -> its event done
  sync_wake          the flag raised by another thread -> stream.synchronize() returns (against flag_to_event)
  thread_event       threading.Event.set() -> the waiting thread runs
  pool_future        ThreadPoolExecutor.submit() -> the task runs; its end -> future.result() returns

    python benchmarks/handoff_latency.py --out benchmarks/results/handoff_latency_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from conditions import require_gpu
from decode import log, machine
from offload import write

from colibri_stream.experts.handoff import HostFlag
from colibri_stream.experts.pinned import pinned_empty

PARK_SECONDS = 0.001  # the stream waits this long on the flag before the host raises it


def _poll(event) -> float:
    while not event.done:
        pass
    return time.perf_counter()


def flag_latency(flag: HostFlag, stream, repeats: int, copy: tuple | None) -> list[float]:
    import cupy as cp

    out = []
    for _ in range(repeats):
        ticket = flag.ticket()
        flag.wait(stream, ticket)
        if copy is not None:
            destination, source = copy
            cp.cuda.runtime.memcpyAsync(destination.data.ptr, source.ctypes.data, source.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        event = cp.cuda.Event(disable_timing=True)
        event.record(stream)
        time.sleep(PARK_SECONDS)
        begin = time.perf_counter()
        flag.set(ticket)
        out.append(_poll(event) - begin)
    return out


def copy_latency(stream, destination, source, repeats: int) -> list[float]:
    import cupy as cp

    out = []
    for _ in range(repeats):
        event = cp.cuda.Event(disable_timing=True)
        begin = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(destination.data.ptr, source.ctypes.data, source.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        event.record(stream)
        out.append(_poll(event) - begin)
    return out


def sync_wake(flag: HostFlag, stream, repeats: int) -> list[float]:
    """A helper thread raises the flag after a pause while the step thread sits in stream.synchronize(): the flag
    raised -> synchronize() returned (compare flag_to_event, where the host polls)."""
    out = []
    for _ in range(repeats):
        ticket = flag.ticket()
        flag.wait(stream, ticket)
        raised: list[float] = []

        def raise_flag(ticket=ticket, raised=raised):
            time.sleep(PARK_SECONDS)
            raised.append(time.perf_counter())
            flag.set(ticket)

        helper = threading.Thread(target=raise_flag)
        helper.start()
        stream.synchronize()
        returned = time.perf_counter()
        helper.join()
        out.append(returned - raised[0])
    return out


def thread_event(repeats: int) -> list[float]:
    go, stamps = threading.Event(), []

    def waiter():
        for _ in range(repeats):
            go.wait()
            stamps.append(time.perf_counter())
            go.clear()

    thread = threading.Thread(target=waiter)
    thread.start()
    out = []
    for i in range(repeats):
        time.sleep(PARK_SECONDS)
        begin = time.perf_counter()
        go.set()
        while len(stamps) <= i:
            time.sleep(0)
        out.append(stamps[i] - begin)
    thread.join()
    return out


def pool_future(repeats: int) -> tuple[list[float], list[float]]:
    pool = ThreadPoolExecutor(1)
    start, end = [], []
    for _ in range(repeats):
        time.sleep(PARK_SECONDS)
        begin = time.perf_counter()
        future = pool.submit(lambda: (time.perf_counter(), time.sleep(PARK_SECONDS), time.perf_counter()))
        started, _, ended = future.result()
        returned = time.perf_counter()
        start.append(started - begin)
        end.append(returned - ended)
    pool.shutdown()
    return start, end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/handoff_latency_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    flag = HostFlag.create(stream)
    source = pinned_empty(1, 4096 * 4)[0].view(np.float32)  # [4096]
    source[:] = 1.0
    destination = cp.empty(4096, np.float32)
    pool_start, pool_end = pool_future(args.repeats)
    samples = {
        "copy_event": copy_latency(stream, destination, source, args.repeats),
        "flag_to_event": flag_latency(flag, stream, args.repeats, None) if flag else [],
        "flag_copy_event": flag_latency(flag, stream, args.repeats, (destination, source)) if flag else [],
        "sync_wake": sync_wake(flag, stream, args.repeats // 4) if flag else [],
        "thread_event": thread_event(args.repeats),
        "pool_future_start": pool_start,
        "pool_future_result": pool_end,
    }
    figures = {}
    for name, values in samples.items():
        if values:
            us = sorted(1e6 * v for v in values)
            figures[name] = {"median_us": statistics.median(us), "p10_us": us[len(us) // 10],
                             "p90_us": us[9 * len(us) // 10]}
            log(f"{name:20s} median {figures[name]['median_us']:8.1f} us  p10 {figures[name]['p10_us']:8.1f}  "
                f"p90 {figures[name]['p90_us']:8.1f}")
    write(args.out, [dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                          bench="handoff_latency", figures=figures)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
