"""Where a batch-1 offload step's time goes, layer by layer: host timestamps around the GPU slot store's steps.

Wraps (in this process only) the store's readback, placement hand-off, CPU thread body, executor calls and the
step thread's wait for the CPU, records `time.perf_counter()` at each, and prints per MoE layer the mean of:
  sync      readback returned (routing on the host) -> CPU work submitted: placement, copies queued
  wake      submitted -> the CPU thread starts
  glue      CPU thread time outside the executor (block lookup, unpacking, weighted sum)
  executor  inside CpuExpertExecutor.run
  tail      the CPU thread's end (flag raised) -> the next layer's routing on the host, in two parts:
  host_wake   -> the step thread has taken in the CPU's end
  after_collect -> the routing is on the host (the GPU's attention and router after the flag, the readback; with
            the host waiting, also the Python that queues them)
and the step's share of each. Same model folder and decode loop as offload.py.

    python benchmarks/offload_timeline.py --fraction 0.5 --out benchmarks/results/offload_timeline_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

from decode import log, machine
from offload import decode, make_model, open_folder, write


class Recorder:
    """Timestamps of one store's layer steps: events[name] lists (layer rank, seconds) in order."""

    def __init__(self, store):
        self.store = store
        self.events: dict[str, list[float]] = defaultdict(list)
        self.rank = 0
        self._wrap("_start_cpu_work", before="submit")
        self._wrap("_compute_on_cpu", before="cpu_start", after="cpu_end")
        self._wrap("_collect_cpu_work", before="collect", after="collected")
        self._wrap_executor()
        original_read = store._readback.read

        def read(stream, **arrays):
            out = original_read(stream, **arrays)
            self.events["routing"].append(time.perf_counter())
            return out

        store._readback.read = read

    def _wrap(self, name: str, before: str, after: str | None = None) -> None:
        original = getattr(self.store, name)

        def wrapped(*args, **kwargs):
            self.events[before].append(time.perf_counter())
            try:
                return original(*args, **kwargs)
            finally:
                if after is not None:
                    self.events[after].append(time.perf_counter())

        setattr(self.store, name, wrapped)

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

    def clear(self) -> None:
        self.events.clear()

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
            out.append({"sync": 1e3 * (submit - before[-1]) if before else None, "wake": 1e3 * (start - submit),
                        "glue": 1e3 * (end - start - executor), "executor": 1e3 * executor,
                        "tail": 1e3 * (after[0] - end) if after else None,
                        "host_wake": 1e3 * (collected[0] - end) if collected else None,
                        "after_collect": 1e3 * (after[0] - collected[0]) if after and collected else None})
        return out


def summarise(layers: list[dict]) -> dict:
    def mean(values: list[float]) -> float | None:
        return statistics.mean(values) if values else None

    return {key: mean([row[key] for row in layers if row[key] is not None])
            for key in ("sync", "wake", "glue", "executor", "tail", "host_wake", "after_collect")}


def run(args) -> list[dict]:
    folder, pinned = open_folder(args.folder, "mixtral-8x7b", args.layers)
    slots = round(args.fraction * folder.config.num_experts)
    records = []
    for mode in args.modes:
        for waits in (True, False):
            model = make_model(folder, slots, pinned, mode, stream_waits=waits)
            recorder = Recorder(model.store)
            decode(model, 1, 2)  # warm
            recorder.clear()
            figures = decode(model, 1, args.steps)
            layers = recorder.layers()
            means = summarise(layers)
            handoff = "stream" if waits else "host"
            log(f"{args.fraction:.0%} {mode} {handoff} waits: {figures['tok_s']:.1f} tok/s, step "
                f"{1e3 * figures['step_s']:.1f} ms; per CPU hand-off (ms): "
                + ", ".join(f"{k} {v:.3f}" for k, v in means.items() if v is not None) + f"; {len(layers) / args.steps:.1f} a step")
            records.append(dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"),
                                command=" ".join(sys.argv), bench="offload_timeline", shape="mixtral-8x7b",
                                layers=args.layers, batch=1, gpu_expert_fraction=args.fraction, mode=mode,
                                handoff=handoff, figures=figures, handoff_ms=means,
                                handoffs_per_step=len(layers) / args.steps))
            write(args.out, records)
            del model, recorder
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--folder", default="/tmp/colibri-offload-model")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--modes", nargs="+", default=["colibri", "cpu_only"], choices=["colibri", "cpu_only"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/offload_timeline_h200.json")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
