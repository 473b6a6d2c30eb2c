"""A bench report as text: JSON, a table for the terminal, and a plot of the distributions (matplotlib, optional)."""

from __future__ import annotations

import orjson

from ..errors import ColibriError
from .client import BenchRun
from .stats import LATENCIES, latencies

_LATENCY_LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_latency_ms": "E2E"}


def to_json(report: dict) -> str:
    return orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()


def to_table(report: dict) -> str:
    """The report for a terminal: throughputs, latency percentiles and the server's step breakdown."""
    limit = f"concurrency {report['concurrency'] or 'unbounded'}"
    if report["request_rate"]:
        limit += f", {report['request_rate']:g} req/s (Poisson)"
    errors = ", ".join(f"{status}: {count}" for status, count in report["errors"].items()) or "none"
    lines = [
        f"{report['num_requests']} requests to {report['url']} (model {report['model']}, {report['endpoint']}), "
        f"{limit}, max_tokens {report['output_len']}",
        f"{'duration':<24}{report['duration_s']:.2f} s",
        f"{'completed / failed':<24}{report['completed']} / {report['failed']}   errors: {errors}",
        f"{'request throughput':<24}{report['request_throughput']:.2f} req/s",
        f"{'output token throughput':<24}{report['output_token_throughput']:.1f} tok/s "
        f"(with prompts {report['total_token_throughput']:.1f} tok/s)",
        f"{'prompt / output tokens':<24}{report['prompt_tokens']} / {report['output_tokens']}",
        "",
        f"{'latency (ms)':<24}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for key in LATENCIES:
        figures = report[key]
        cells = "".join(f"{figures[k]:>9.2f}" for k in ("mean", "p50", "p90", "p99")) if figures else f"{'-':>9}"
        lines.append(f"{_LATENCY_LABELS[key]:<24}{cells}")
    server = report["server"]
    if server is not None:
        lines += ["", f"server: {server['steps']} steps, busy {server['busy_fraction']:.0%} of the run, "
                      f"{server['tokens_per_step']:.2f} sampled tokens per step",
                  f"{'step phase':<24}{'ms/step':>9}{'share':>9}"]
        for entry in server["phases"]:
            name = "  " * entry["depth"] + entry["phase"]
            lines.append(f"{name:<24}{entry['ms_per_step']:>9.3f}{entry['share']:>9.1%}")
    return "\n".join(lines)


def plot(run: BenchRun, report: dict, path: str) -> None:
    """Write a PNG: a histogram per latency, and the server's step breakdown when there is one."""
    try:
        import matplotlib
    except ImportError:
        raise ColibriError("--plot needs matplotlib: pip install 'colibri-stream[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    values = latencies(run)
    server = report["server"]
    fig, axes = plt.subplots(1, len(LATENCIES) + (server is not None), figsize=(4.2 * (len(LATENCIES) + 1), 3.6),
                             squeeze=False)
    for ax, key in zip(axes[0], LATENCIES):
        ms = [v * 1e3 for v in values[key]]
        ax.hist(ms, bins=40, color="tab:blue")
        if report[key]:
            for p, style in (("p50", "-"), ("p99", "--")):
                ax.axvline(report[key][p], color="black", linestyle=style, linewidth=1, label=p)
            ax.legend()
        ax.set_title(f"{_LATENCY_LABELS[key]} ({len(ms)} values)")
        ax.set_xlabel("ms")
    if server is not None:
        ax = axes[0][-1]
        entries = [e for e in server["phases"] if e["depth"] > 0][::-1]  # the step's parts, top row first
        ax.barh([" " * 2 * e["depth"] + e["phase"] for e in entries], [e["ms_per_step"] for e in entries],
                color=["tab:orange" if e["depth"] == 1 else "tab:green" for e in entries])
        ax.set_title(f"server step: {server['phases'][0]['ms_per_step']:.2f} ms mean ({server['steps']} steps)")
        ax.set_xlabel("ms per step")
    fig.suptitle(f"{run.model} at {report['url']}: {report['request_throughput']:.2f} req/s, "
                 f"{report['output_token_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
