"""Where a batch-1 offload step's time goes, layer by layer: host timestamps around the GPU slot store's steps.

Wraps (in this process only) the store's readback, placement hand-off, CPU thread body, executor calls and the
step thread's wait for the CPU, records `time.perf_counter()` at each, and prints per MoE layer the mean of:
  sync      readback returned (routing on the host) -> CPU work submitted, in three parts:
  before_place -> the cost model starts (slots looked up, prefetch predictions)
  place       the planner's placement of the misses (_place_misses)
  after_place -> the CPU work submitted (copies queued)
  wake      submitted -> the CPU thread starts
  glue      CPU thread time outside the executor (block lookup, unpacking, weighted sum)
  executor  inside CpuExpertExecutor.run
(with the CpuLayerWorker, "wake" runs to its job's start and "executor" is the whole job, as it timed them on the
same clock as time.perf_counter; "glue" is 0)
  tail      the CPU thread's end (flag raised) -> the next layer's routing on the host, in two parts:
  host_wake   -> the step thread has taken in the CPU's end
  after_collect -> the routing is on the host (the GPU's attention and router after the flag, the readback), of
            which
  readback    the host's wait for the routing's copies (queued before the CPU's end was taken in)
and CUDA events on the compute stream around the flag wait (GPU clock):
  gpu_experts   the routing read back -> the GPU's own experts queued before the wait are done
  gpu_waited    how long the stream waited on the flag (about 0: the GPU's experts ended after the CPU's)
  gpu_next      the flag seen -> the next layer's routing ready to read back (sum copied in, attention, router)
and the step's share of each. Same model folder and decode loop as offload.py.

    python benchmarks/offload_timeline.py --fractions 0.5 0 --out benchmarks/results/offload_timeline_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

from conditions import require_gpu
from decode import log, machine
from offload import decode, make_model, open_folder, write

from colibri_stream.config import GPU_SLOT_LAYOUTS
from colibri_stream.experts.placement import MIN_CUT_GAIN
from colibri_stream.experts.cpu_worker import WAIT_SPIN_SECONDS
from colibri_stream.experts.slots import layer_slot_counts

THREAD_ENV = ("NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def threading_layer() -> str | None:
    """numba's threading layer once a parallel kernel has run (omp, tbb or workqueue)."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:
        return None


class Recorder:
    """Timestamps of one store's layer steps: events[name] lists (layer rank, seconds) in order."""

    def __init__(self, store):
        self.store = store
        self.events: dict[str, list[float]] = defaultdict(list)
        self.rank = 0
        self._wrap("_start_cpu_work", before="submit")
        self._wrap("_compute", before="cpu_start", after="cpu_end", owner=store.cpu)
        self._wrap("_collect_cpu_work", before="collect", after="collected")
        self._wrap("_place_misses", before="place", after="placed")
        self._wrap_executor()
        if store.cpu.worker is not None:
            self._wrap_worker(store.cpu.worker)
        readback = store._readback
        original_queue, original_wait = readback.queue, readback.wait

        def queue(stream, **arrays):
            self._event("routing")
            return original_queue(stream, **arrays)

        def wait(stream):
            self.events["readback_start"].append(time.perf_counter())
            original_wait(stream)
            self.events["routing"].append(time.perf_counter())

        readback.queue, readback.wait = queue, wait
        self.gpu: list[tuple[str, object]] = []  # ("routing" | "wait" | "waited", timing event) in stream order
        self._wrap_flag(store.cpu.flag)

    def _event(self, name: str) -> None:
        import cupy as cp

        event = cp.cuda.Event()
        event.record(cp.cuda.get_current_stream())
        self.gpu.append((name, event))

    def _wrap_flag(self, flag) -> None:
        original_wait = flag.wait

        def wait(stream, value):
            self._event("wait")
            original_wait(stream, value)
            self._event("waited")

        flag.wait = wait

    def _wrap(self, name: str, before: str, after: str | None = None, owner=None) -> None:
        """Record `before` (and `after`) around every call of the method `name` of `owner` (default: the store)."""
        owner = self.store if owner is None else owner
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.events[before].append(time.perf_counter())
            try:
                return original(*args, **kwargs)
            finally:
                if after is not None:
                    self.events[after].append(time.perf_counter())

        setattr(owner, name, wrapped)

    def _wrap_executor(self) -> None:
        executor = self.store.executor
        original = executor.run

        def run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.events["executor"].append(time.perf_counter() - begin)
                self.events["executor_at"].append(begin)

        executor.run = run

    def _wrap_worker(self, worker) -> None:
        original_wait = worker.wait

        def wait(ticket):
            seconds = original_wait(ticket)
            start, end = worker.span()
            self.events["cpu_start"].append(start)
            self.events["cpu_end"].append(end)
            self.events["executor"].append(end - start)
            self.events["executor_at"].append(start)
            return seconds

        worker.wait = wait

    def clear(self) -> None:
        self.events.clear()
        self.gpu.clear()

    def gpu_intervals(self) -> dict[str, float | None]:
        """Means over the stream's flag waits, in ms (GPU clock): see gpu_* in the module docstring."""
        import cupy as cp

        rows = {"gpu_experts": [], "gpu_waited": [], "gpu_next": []}
        names = [name for name, _ in self.gpu]
        for i, (name, event) in enumerate(self.gpu):
            if name != "wait" or i == 0 or i + 2 >= len(self.gpu) or names[i - 1] != "routing":
                continue
            waited, following = self.gpu[i + 1], self.gpu[i + 2]
            if waited[0] != "waited" or following[0] != "routing":
                continue
            following[1].synchronize()
            rows["gpu_experts"].append(cp.cuda.get_elapsed_time(self.gpu[i - 1][1], event))
            rows["gpu_waited"].append(cp.cuda.get_elapsed_time(event, waited[1]))
            rows["gpu_next"].append(cp.cuda.get_elapsed_time(waited[1], following[1]))
        return {key: statistics.mean(values) if values else None for key, values in rows.items()}

    def layers(self) -> list[dict]:
        """Per CPU hand-off (one a layer that has CPU work): the intervals named in the module docstring, in ms."""
        e = self.events
        routing = e["routing"]
        out = []
        for start, end in zip(e["cpu_start"], e["cpu_end"]):
            submit = max(t for t in e["submit"] if t <= start)  # the hand-off of this work
            before = [t for t in routing if t <= submit]
            after = [t for t in routing if t > end]
            executor = sum(d for d, at in zip(e["executor"], e["executor_at"]) if start <= at <= end)
            collected = [t for t in e["collected"] if t >= end]
            routed = before[-1] if before else None
            placed = [(a, b) for a, b in zip(e["place"], e["placed"]) if routed is not None and routed <= a <= submit]
            read = [t for t in e["readback_start"] if after and end < t <= after[0]]
            out.append({"sync": 1e3 * (submit - routed) if before else None,
                        "before_place": 1e3 * (placed[0][0] - routed) if placed else None,
                        "place": 1e3 * (placed[0][1] - placed[0][0]) if placed else None,
                        "after_place": 1e3 * (submit - placed[0][1]) if placed else None,
                        "wake": 1e3 * (start - submit),
                        "glue": 1e3 * (end - start - executor), "executor": 1e3 * executor,
                        "tail": 1e3 * (after[0] - end) if after else None,
                        "host_wake": 1e3 * (collected[0] - end) if collected else None,
                        "after_collect": 1e3 * (after[0] - collected[0]) if after and collected else None,
                        "readback": 1e3 * (after[0] - read[-1]) if read else None})
        return out


def summarise(layers: list[dict], average=statistics.mean) -> dict:
    """Each interval's `average` over the hand-offs (None where no hand-off has it)."""
    def over(values: list[float]) -> float | None:
        return average(values) if values else None

    return {key: over([row[key] for row in layers if row[key] is not None])
            for key in ("sync", "before_place", "place", "after_place", "wake", "glue", "executor", "tail", "host_wake",
                        "after_collect", "readback")}


def run(args) -> list[dict]:
    folder, pinned = open_folder(args.folder, "mixtral-8x7b", args.layers)
    records = []
    config = folder.config
    runs = [(f, m, lay, t, w) for f in args.fractions for m in args.modes for lay in args.layouts
            for t in args.cpu_threads for w in args.waiters]
    runs = [(r, *run) for r in range(args.rounds) for run in (runs if r % 2 == 0 else runs[::-1])]
    for round_index, fraction, mode, layout, threads, waiter in runs:
        slots = layer_slot_counts(round(fraction * config.num_experts), len(config.moe_layers), config.num_experts,
                                  layout)
        model = make_model(folder, slots, pinned, mode, threads)
        worker = model.store.cpu.worker
        cpu_call = "thread" if worker is None else "worker"
        if worker is not None and waiter != "default":
            worker.wait_spin_seconds = {"spin": WAIT_SPIN_SECONDS, "sleep": 0.0}[waiter]
        wait_spin = worker.wait_spin_seconds if worker is not None else None
        recorder = Recorder(model.store)
        decode(model, 1, 2)  # warm
        recorder.clear()
        figures = decode(model, 1, args.steps)
        layers = recorder.layers()
        means = summarise(layers)
        means.update(recorder.gpu_intervals())
        cpu_threads = model.store.executor.num_threads
        log(f"{fraction:.0%} {mode} {layout} {cpu_call} {cpu_threads} threads, waiter spins {wait_spin} s: "
            f"{figures['tok_s']:.1f} tok/s, step {1e3 * figures['step_s']:.1f} ms, experts a step: "
            f"{figures['cpu_experts_per_step']:.2f} CPU, {figures['split_experts_per_step']:.2f} cut; "
            f"per CPU hand-off (ms): "
            + ", ".join(f"{k} {v:.3f}" for k, v in means.items() if v is not None)
            + f"; {len(layers) / args.steps:.1f} a step")
        records.append(dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"),
                            command=" ".join(sys.argv), bench="offload_timeline", shape="mixtral-8x7b",
                            numba_threading_layer=threading_layer(),
                            thread_env={k: os.environ.get(k) for k in THREAD_ENV},
                            layers=args.layers, batch=1, gpu_expert_fraction=fraction, mode=mode,
                            slot_layout=layout, gpu_slots=slots, cpu_call=cpu_call, cpu_threads=cpu_threads,
                            min_cut_gain=MIN_CUT_GAIN, waiter=waiter, wait_spin_seconds=wait_spin,
                            handoff="stream", figures=figures, handoff_ms=means,
                            handoff_ms_median=summarise(layers, statistics.median),
                            handoffs_per_step=len(layers) / args.steps, round=round_index))
        write(args.out, records)
        del model, recorder
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--folder", default="/tmp/colibri-offload-model")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5])
    parser.add_argument("--modes", nargs="+", default=["colibri", "cpu_only"], choices=["colibri", "cpu_only"])
    parser.add_argument("--layouts", nargs="+", default=["spread"], choices=GPU_SLOT_LAYOUTS)
    parser.add_argument("--cpu-threads", type=int, nargs="+", default=[None],
                        help="the CPU executor's thread counts to compare (default: every core numba sees)")
    parser.add_argument("--waiters", nargs="+", default=["default"], choices=["default", "spin", "sleep"],
                        help="how the step thread waits for the CpuLayerWorker's job: the worker's default (spin where "
                             "its threads leave a core), spinning through the job (50 ms at most), or a short spin "
                             "then asleep")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the runs, every other round in reverse order")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/offload_timeline_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
