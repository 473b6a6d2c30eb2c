"""The figures of a bench run: throughputs, latency percentiles, errors by status, and the server's step breakdown.

Latencies are measured by the client (`client.RequestResult`): TTFT to the first chunk with content, TPOT as the
time after the first token divided by the tokens after it, ITL as the gaps between content chunks (a server that
coalesces tokens into one chunk shows fewer, longer gaps), end-to-end to the end of the stream. The step breakdown
is the difference of two scrapes of a Colibri server's /metrics around the run (`colibri_step_seconds`,
`colibri_step_phase_seconds{phase}`), so it covers the steps of the same window.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ..timing import PHASES
from .client import BenchRun

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")  # the report's latency keys


def summarize(seconds: list[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds; None without values."""
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1e3  # [n]
    percentiles = np.percentile(ms, PERCENTILES)  # [len(PERCENTILES)]
    return {"mean": float(ms.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, percentiles)}}


def latencies(run: BenchRun) -> dict[str, list[float]]:
    """The successful requests' latencies in seconds, by report key."""
    ok = [r for r in run.results if r.ok]
    return {
        "ttft_ms": [r.ttft for r in ok if r.ttft is not None],
        "tpot_ms": [(r.latency - r.ttft) / (r.num_output_tokens - 1) for r in ok
                    if r.ttft is not None and r.num_output_tokens > 1],
        "itl_ms": [later - earlier for r in ok for earlier, later in zip(r.chunk_times, r.chunk_times[1:])],
        "e2e_latency_ms": [r.latency for r in ok],
    }


def build_report(run: BenchRun) -> dict:
    """The run's figures as a JSON-ready dict (what `--output-format json` prints)."""
    config, ok = run.config, [r for r in run.results if r.ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    report = {
        "url": config.api_base,
        "model": run.model,
        "endpoint": config.endpoint,
        "num_requests": config.num_requests,
        "concurrency": config.concurrency,
        "request_rate": config.request_rate,
        "output_len": config.output_len,
        "duration_s": run.duration,
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "errors": dict(Counter(r.status for r in run.results if not r.ok)),
        "request_throughput": len(ok) / run.duration,
        "output_token_throughput": output_tokens / run.duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / run.duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_without_usage": sum(r.output_tokens is None for r in ok),
    }
    report.update({key: summarize(values) for key, values in latencies(run).items()})
    report["server"] = step_breakdown(run.metrics_before, run.metrics_after, run.duration)
    return report


def step_breakdown(before: str | None, after: str | None, duration: float) -> dict | None:
    """A Colibri server's steps between two /metrics scrapes; None for a server without step metrics."""
    if before is None or after is None:
        return None
    start, end = _step_samples(before), _step_samples(after)
    steps = end.get(("colibri_step_seconds_count", ""), 0.0) - start.get(("colibri_step_seconds_count", ""), 0.0)
    if steps <= 0:
        return None
    totals = {key[1]: end[key] - start.get(key, 0.0) for key in end
              if key[0] == "colibri_step_phase_seconds_sum"}  # phase -> seconds in the window
    totals["step"] = end[("colibri_step_seconds_sum", "")] - start.get(("colibri_step_seconds_sum", ""), 0.0)
    generated = (end.get(("colibri_engine_generated_tokens_total", ""), 0.0)
                 - start.get(("colibri_engine_generated_tokens_total", ""), 0.0))
    ahead = (end.get(("colibri_engine_steps_launched_ahead_total", ""), 0.0)
             - start.get(("colibri_engine_steps_launched_ahead_total", ""), 0.0))
    return {
        "steps": int(steps),
        "busy_fraction": totals["step"] / duration,  # of the run's wall time spent in steps
        "generated_tokens": int(generated),
        "tokens_per_step": generated / steps,
        "steps_launched_ahead": int(ahead),  # launched before the step before was read (async scheduling)
        "phases": [dict(entry, ms_per_step=seconds / steps * 1e3, share=seconds / totals["step"])
                   for entry, seconds in _phase_tree(totals)],
    }


def _step_samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, phase label) -> value for the samples a step breakdown reads."""
    wanted = {"colibri_step_seconds_sum", "colibri_step_seconds_count", "colibri_step_phase_seconds_sum",
              "colibri_engine_generated_tokens_total", "colibri_engine_steps_launched_ahead_total"}
    return {(s.name, s.labels.get("phase", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in wanted}


def _phase_tree(totals: dict[str, float], parent: str | None = None, depth: int = 0):
    """(entry, seconds) for the phases under `parent` in PHASES order, depth first; each parent with children is
    followed by an `other` entry for its time outside them."""
    children = [name for name, above in PHASES.items() if above == parent and name in totals]
    for name in children:
        yield {"phase": name, "parent": parent, "depth": depth}, totals[name]
        yield from _phase_tree(totals, name, depth + 1)
    if parent is not None and children:
        yield ({"phase": "other", "parent": parent, "depth": depth},
               totals[parent] - sum(totals[name] for name in children))
