"""`colibri bench`: load any OpenAI-compatible server with streamed requests and report what the client measured
(throughput, TTFT, TPOT, inter-token and end-to-end latency) and, on a Colibri server, the engine's step breakdown
over the same window."""

from __future__ import annotations

import asyncio

from .client import BenchConfig, BenchRun, read_prompts, run_benchmark, synthetic_prompts
from .report import plot, to_json, to_table
from .stats import build_report

__all__ = ["BenchConfig", "BenchRun", "bench", "build_report", "plot", "read_prompts", "run_benchmark",
           "synthetic_prompts", "to_json", "to_table"]


def bench(config: BenchConfig, output_format: str = "table", plot_path: str | None = None,
          progress: bool = True) -> tuple[dict, str]:
    """Run the benchmark; returns the report and its text (`json` or `table`), after writing the plot if asked."""
    run = asyncio.run(run_benchmark(config, progress))
    report = build_report(run)
    if plot_path is not None:
        plot(run, report, plot_path)
    return report, to_json(report) if output_format == "json" else to_table(report)
