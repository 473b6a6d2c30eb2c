"""What step timing costs: one engine run whose decode steps are timed from outside, in A/B passes that alternate
step by step between the step timer off (A) and on (B), so both see the same batch and nearly the same contexts:

- metrics: on with the Prometheus histograms `colibri serve` always keeps (the figure that matters);
- trace: on with the histograms and a Chrome trace file;
- noise: off against off, the resolution of the comparison on this machine.

Each pass runs `rounds` fresh batches. Per pass: the ratio of the B and A medians, and the paired figure, the
median over B steps of the step minus the mean of the A steps on either side (robust to the machine's load drifting
during the run). The timer's own bookkeeping per step (its phases entered and left, the record built, the sinks
called) is also timed in isolation. Results go to benchmarks/results/timing_overhead.json.

    python benchmarks/timing_overhead.py [--model FOLDER] [--batch-sizes 1,8,32] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from conditions import machine

from colibri_stream.engine import EngineCore
from colibri_stream.metrics import ServerMetrics
from colibri_stream.request import SamplingParams
from colibri_stream.timing import ChromeTraceWriter, StepRecord, StepSink, StepTimer

RESULTS = Path(__file__).resolve().parent / "results" / "timing_overhead.json"
PASSES = ("metrics", "trace", "noise")  # what the B steps run with; noise: timer off, like A


def spread(values: np.ndarray) -> dict[str, float]:
    """min, median, max in milliseconds."""
    ms = values * 1e3  # [n]
    return {"min_ms": float(ms.min()), "median_ms": float(np.median(ms)), "max_ms": float(ms.max())}


class Sink:
    """The step sink of the run: the Prometheus histograms always, the trace in the trace pass; keeps the last record."""

    def __init__(self, metrics: ServerMetrics, trace: ChromeTraceWriter):
        self.metrics, self.trace = metrics, trace
        self.tracing = False
        self.last: StepRecord | None = None

    def __call__(self, record: StepRecord) -> None:
        self.metrics.observe_step(record)
        if self.tracing:
            self.trace(record)
        self.last = record


def ab_pass(core: EngineCore, sink: Sink, name: str, batch_size: int, prompt_len: int, steps: int,
            rounds: int) -> dict:
    """Alternate off (A) and `name` (B) steps over `rounds` fresh batches; compare the two."""
    rng = np.random.default_rng(batch_size)
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    a_steps, b_steps, paired = [], [], []
    sink.tracing = name == "trace"
    for round_ in range(rounds):
        for i in range(batch_size):
            prompt = rng.integers(3, core.model_config.vocab_size, prompt_len).tolist()
            core.add_request(f"{name}-b{batch_size}-r{round_}-{i}", prompt, params)
        core.timer.enabled = False
        while core.scheduler.num_waiting:  # prefill (and warm up) outside the timed steps
            core.step()
        times = np.empty(2 * steps)  # [2 * steps] A, B, A, B, ...
        for i in range(2 * steps):
            core.timer.enabled = i % 2 == 1 and name != "noise"
            start = time.perf_counter()
            core.step()
            times[i] = time.perf_counter() - start
        core.abort_all()
        a, b = times[0::2], times[1::2]  # [steps] each
        a_steps.append(a)
        b_steps.append(b)
        paired.append(b[:-1] - (a[:-1] + a[1:]) / 2)  # [steps - 1] each B step against the A steps around it
    core.timer.enabled = False
    a, b = np.concatenate(a_steps), np.concatenate(b_steps)  # [rounds * steps] each
    off = float(np.median(a))
    return {"off": spread(a), "on": spread(b), "overhead": float(np.median(b)) / off - 1,
            "overhead_paired": float(np.median(np.concatenate(paired))) / off}


def measure_batch(core: EngineCore, sink: Sink, batch_size: int, prompt_len: int, steps: int, rounds: int) -> dict:
    passes = {name: ab_pass(core, sink, name, batch_size, prompt_len, steps, rounds) for name in PASSES}
    off = passes["metrics"]["off"]["median_ms"] / 1e3
    sink.tracing = False
    metrics_cost = bookkeeping(sink.last, sink.metrics.observe_step)
    sink.tracing = True
    trace_cost = bookkeeping(sink.last, sink)
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "context_len_end": prompt_len + 2 * steps,
        "steps_per_arm": steps * rounds,
        "phases_per_step": len(sink.last.spans),
        **passes,
        "bookkeeping_metrics_us": metrics_cost * 1e6,
        "bookkeeping_metrics_share": metrics_cost / off,
        "bookkeeping_trace_us": trace_cost * 1e6,
        "bookkeeping_trace_share": trace_cost / off,
    }


def bookkeeping(model: StepRecord, sink: StepSink, repeats: int = 2000) -> float:
    """Seconds one step of timing costs by itself: the phases of `model`, nested the same way and with no work
    inside, recorded and handed to `sink`; the median of `repeats` steps."""
    timer = StepTimer()
    timer.add_sink(sink)
    phases = [(span.name, span.depth) for span in model.spans[1:]]  # in start order

    def run(i: int, depth: int) -> int:
        """Replay the phases from index i at `depth` (and their children); returns the index after them."""
        while i < len(phases) and phases[i][1] == depth:
            with timer.phase(phases[i][0]):
                i = run(i + 1, depth + 1)
        return i

    costs = []
    for _ in range(repeats):
        start = time.perf_counter()
        with timer.phase("step"):
            run(0, 1)
        costs.append(time.perf_counter() - start)
    return float(np.median(costs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per arm, pass and round")
    parser.add_argument("--rounds", type=int, default=3, help="fresh batches per batch size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    core = EngineCore.from_pretrained(args.model, device="cpu")
    config = core.model_config
    with tempfile.TemporaryDirectory() as tmp, ChromeTraceWriter(Path(tmp) / "trace.json") as trace:
        sink = Sink(ServerMetrics(core), trace)
        core.timer.add_sink(sink)
        runs = [measure_batch(core, sink, int(b), args.prompt_len, args.steps, args.rounds)
                for b in args.batch_sizes.split(",")]
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": {"path": core.config.model, "architecture": config.architecture, "layers": config.num_layers,
                  "hidden_size": config.hidden_size, "experts": config.num_experts, "top_k": config.top_k,
                  "dtype": config.dtype, "expert_dtype": config.expert_dtype},
        "backend": "numpy (CPU)",
        "runs": runs,
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        figures = "; ".join(f"{name} {run[name]['overhead']:+.2%} (paired {run[name]['overhead_paired']:+.2%})"
                            for name in PASSES)
        print(f"batch {run['batch_size']}: median step off {run['metrics']['off']['median_ms']:.3f} ms; {figures}; "
              f"bookkeeping {run['bookkeeping_metrics_us']:.1f} us ({run['bookkeeping_metrics_share']:.2%} of a "
              f"step), with the trace {run['bookkeeping_trace_us']:.1f} us ({run['bookkeeping_trace_share']:.2%})")


if __name__ == "__main__":
    main()
