"""What step timing costs: one engine run, its decode steps timed from outside with the step timer off, on (the
Prometheus histograms `colibri serve` keeps), on with a Chrome trace as well, and off again, interleaved step by
step (off, metrics, trace, off again, off, ...), so the arms see the same batch and nearly the same context lengths.
Each round starts fresh sequences; the rounds' steps are pooled.

The figure per arm is the median step time; the overhead is an arm's median over the off arm's, and also the
median over the cycles of an arm's step minus the mean of the two off steps around it (paired, so robust to the
machine's load drifting); the second off arm against the first gives the noise floor of either comparison. The timer's own bookkeeping per step (its phases entered and
left, the record built, the sinks called) is also timed in isolation, which is the cost without the run's noise.
Results go to benchmarks/results/timing_overhead.json.

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
ARMS = ("off", "metrics", "trace", "off_again")


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


def measure_batch(core: EngineCore, arms: Arms, batch_size: int, prompt_len: int, steps: int, rounds: int) -> dict:
    """Decode `batch_size` sequences for `steps` steps per arm and round, the arms taking turns; step times per arm."""
    rng = np.random.default_rng(batch_size)
    params = SamplingParams(max_tokens=len(ARMS) * steps + 8, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for round_ in range(rounds):
        for i in range(batch_size):
            prompt = rng.integers(3, core.model_config.vocab_size, prompt_len).tolist()
            core.add_request(f"b{batch_size}-r{round_}-{i}", prompt, params)
        core.timer.enabled = False
        while core.scheduler.num_waiting:  # prefill (and warm up) outside the timed steps
            core.step()
        for i in range(len(ARMS) * steps):
            arms.current = ARMS[i % len(ARMS)]
            core.timer.enabled = arms.current in ("metrics", "trace")
            start = time.perf_counter()
            core.step()
            times[arms.current].append(time.perf_counter() - start)
        core.abort_all()
    core.timer.enabled = False
    off = float(np.median(times["off"]))
    cycles = {name: np.asarray(values) for name, values in times.items()}  # [rounds * steps] each, in cycle order
    baseline = (cycles["off"] + cycles["off_again"]) / 2  # [rounds * steps] the off steps on either side
    metrics_cost = bookkeeping(arms.last, arms.metrics.observe_step)
    arms.current = "trace"
    trace_cost = bookkeeping(arms.last, arms)
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "context_len_end": prompt_len + len(ARMS) * steps,
        "rounds": rounds,
        "steps_per_arm": steps * rounds,
        "phases_per_step": len(arms.last.spans),
        "arms": {name: spread(values) for name, values in times.items()},
        "metrics_overhead": float(np.median(times["metrics"])) / off - 1,
        "trace_overhead": float(np.median(times["trace"])) / off - 1,
        "noise_off_again": float(np.median(times["off_again"])) / off - 1,
        # Paired within each cycle of four neighbouring steps: robust to the load drifting during the run.
        "metrics_overhead_paired": float(np.median(cycles["metrics"] - baseline)) / off,
        "trace_overhead_paired": float(np.median(cycles["trace"] - baseline)) / off,
        "noise_paired": float(np.median(cycles["off_again"] - cycles["off"])) / off,
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
    parser.add_argument("--steps", type=int, default=200, help="decode steps per arm and round")
    parser.add_argument("--rounds", type=int, default=3, help="fresh batches per batch size")
    args = parser.parse_args()

    core = EngineCore.from_pretrained(args.model, device="cpu")
    config = core.model_config
    with tempfile.TemporaryDirectory() as tmp, ChromeTraceWriter(Path(tmp) / "trace.json") as trace:
        arms = Arms(ServerMetrics(core), trace)
        core.timer.add_sink(arms)
        runs = [measure_batch(core, arms, int(b), args.prompt_len, args.steps, args.rounds)
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
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        medians = ", ".join(f"{name} {run['arms'][name]['median_ms']:.3f} ms" for name in ARMS)
        print(f"batch {run['batch_size']}: median step {medians}; metrics {run['metrics_overhead']:+.2%} "
              f"(paired {run['metrics_overhead_paired']:+.2%}), trace {run['trace_overhead']:+.2%} "
              f"(paired {run['trace_overhead_paired']:+.2%}), off again {run['noise_off_again']:+.2%} "
              f"(paired {run['noise_paired']:+.2%}); bookkeeping {run['bookkeeping_metrics_us']:.1f} us "
              f"({run['bookkeeping_metrics_share']:.2%} of a step), with the trace {run['bookkeeping_trace_us']:.1f} us "
              f"({run['bookkeeping_trace_share']:.2%})")


if __name__ == "__main__":
    main()
