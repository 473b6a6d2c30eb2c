"""What step timing costs: one engine run, its decode steps timed from outside with the step timer off, on (the
Prometheus histograms `colibri serve` keeps), and on with a Chrome trace as well, interleaved step by step
(off, metrics, trace, off, ...), so the three arms see the same batch and nearly the same context lengths.

The figure per arm is the median step time; the overhead is the metrics arm's median over the off arm's. The
timer's own bookkeeping per step (its phases entered and left, the record built, the sinks called) is also timed
in isolation, which is the overhead without the run's noise. Results go to benchmarks/results/timing_overhead.json.

    python benchmarks/timing_overhead.py [--model FOLDER] [--batch-sizes 1,8] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_stream.engine import EngineCore
from colibri_stream.metrics import ServerMetrics
from colibri_stream.request import SamplingParams
from colibri_stream.timing import ChromeTraceWriter, StepRecord, StepSink, StepTimer

RESULTS = Path(__file__).resolve().parent / "results" / "timing_overhead.json"
ARMS = ("off", "metrics", "trace")


def spread(values: list[float]) -> dict[str, float]:
    """min, median, max in milliseconds."""
    ms = np.asarray(values) * 1e3  # [n]
    return {"min_ms": float(ms.min()), "median_ms": float(np.median(ms)), "max_ms": float(ms.max())}


class Arms:
    """The step sink of the run: the Prometheus histograms always, the trace in the trace arm; keeps the last record."""

    def __init__(self, metrics: ServerMetrics, trace: ChromeTraceWriter):
        self.metrics, self.trace = metrics, trace
        self.current = "off"
        self.last: StepRecord | None = None

    def __call__(self, record: StepRecord) -> None:
        self.metrics.observe_step(record)
        if self.current == "trace":
            self.trace(record)
        self.last = record


def measure_batch(core: EngineCore, arms: Arms, batch_size: int, prompt_len: int, steps: int) -> dict:
    """Decode `batch_size` sequences for `steps` steps per arm, the arms taking turns; step times per arm."""
    rng = np.random.default_rng(batch_size)
    params = SamplingParams(max_tokens=len(ARMS) * steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        core.add_request(f"b{batch_size}-{i}", rng.integers(3, core.model_config.vocab_size, prompt_len).tolist(),
                         params)
    core.timer.enabled = False
    while core.scheduler.num_waiting:  # prefill (and warm up) outside the timed steps
        core.step()
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for i in range(len(ARMS) * steps):
        arms.current = ARMS[i % len(ARMS)]
        core.timer.enabled = arms.current != "off"
        start = time.perf_counter()
        core.step()
        times[arms.current].append(time.perf_counter() - start)
    core.abort_all()
    off = float(np.median(times["off"]))
    metrics_cost = bookkeeping(arms.last, arms.metrics.observe_step)
    trace_cost = bookkeeping(arms.last, arms)  # arms.current is "trace" after the last step
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "context_len_end": prompt_len + len(ARMS) * steps,
        "steps_per_arm": steps,
        "phases_per_step": len(arms.last.spans),
        "arms": {name: spread(values) for name, values in times.items()},
        "metrics_overhead": float(np.median(times["metrics"])) / off - 1,
        "trace_overhead": float(np.median(times["trace"])) / off - 1,
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


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "commit": commit, "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="decode steps per arm and batch size")
    args = parser.parse_args()

    core = EngineCore.from_pretrained(args.model, device="cpu")
    config = core.model_config
    with tempfile.TemporaryDirectory() as tmp, ChromeTraceWriter(Path(tmp) / "trace.json") as trace:
        arms = Arms(ServerMetrics(core), trace)
        core.timer.add_sink(arms)
        runs = [measure_batch(core, arms, int(b), args.prompt_len, args.steps) for b in args.batch_sizes.split(",")]
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": {"path": core.config.model, "architecture": config.architecture, "layers": config.num_layers,
                  "hidden_size": config.hidden_size, "experts": config.num_experts, "top_k": config.top_k,
                  "dtype": config.dtype, "expert_dtype": config.expert_dtype},
        "backend": "numpy (CPU)",
        "runs": runs,
        "machine": machine(),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        medians = ", ".join(f"{name} {run['arms'][name]['median_ms']:.3f} ms" for name in ARMS)
        print(f"batch {run['batch_size']}: median step {medians}; metrics {run['metrics_overhead']:+.2%}, "
              f"trace {run['trace_overhead']:+.2%}; bookkeeping {run['bookkeeping_metrics_us']:.1f} us "
              f"({run['bookkeeping_metrics_share']:.2%} of a step), with the trace {run['bookkeeping_trace_us']:.1f} us "
              f"({run['bookkeeping_trace_share']:.2%})")


if __name__ == "__main__":
    main()
