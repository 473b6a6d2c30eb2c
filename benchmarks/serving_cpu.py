"""Serving on the CPU backend: `colibri serve --device cpu` with the shipped model, loaded by `colibri bench`.

Starts the server on a loopback port, warms it up (page cache, first steps) with an unrecorded run, then runs
`colibri bench` once per load (fixed concurrencies, then Poisson arrivals) and keeps each JSON report with its
exact command line. Results go to benchmarks/results/serving_cpu.json; the Markdown table for BENCHMARKS.md is
printed.

    python benchmarks/serving_cpu.py [--port 8011] [--input-len 64] [--output-len 64] [--max-requests N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conditions import machine

RESULTS = Path(__file__).resolve().parent / "results" / "serving_cpu.json"
# (label, bench arguments that set the load, requests, seed). Each run has its own seed, so its prompts are new to
# the server: with prefix caching (on by default) a repeated prompt set would be served from the cache.
LOADS = (
    ("concurrency 1", ["--concurrency", "1"], 16, 1),
    ("concurrency 4", ["--concurrency", "4"], 32, 2),
    ("concurrency 16", ["--concurrency", "16"], 64, 3),
    ("concurrency 32", ["--concurrency", "32"], 96, 4),
    ("Poisson 8 req/s", ["--request-rate", "8"], 64, 0),
)
WARM_UP_SEED = 100


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def bench(url: str, load: list[str], num_requests: int, seed: int, input_len: int, output_len: int
          ) -> tuple[list[str], dict]:
    """Run `colibri bench` for one load; returns its command line and JSON report."""
    command = ["colibri", "bench", "--url", url, *load, "--num-requests", str(num_requests), "--seed", str(seed),
               "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos", "--output-format",
               "json", "--quiet"]
    done = subprocess.run([sys.executable, "-m", "colibri_stream", *command[1:]], check=True, capture_output=True,
                          text=True)
    return command, json.loads(done.stdout)


def markdown(runs: list[dict]) -> str:
    """One row per load: throughput, latency percentiles, the server's mean step and where it went."""
    lines = ["| load | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms | E2E p50 ms | "
             "step ms | tokens/step | attention / experts / other forward / outside forward |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        r, server = run["report"], run["report"]["server"]
        share = {(e["phase"], e["parent"]): e["share"] for e in server["phases"]}
        outside = 1 - share[("forward", "step")]
        lines.append(
            f"| {run['load']} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.0f} | "
            f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['p50']:.1f} / "
            f"{r['tpot_ms']['p99']:.1f} | {r['itl_ms']['p99']:.1f} | {r['e2e_latency_ms']['p50']:.0f} | "
            f"{server['phases'][0]['ms_per_step']:.1f} | {server['tokens_per_step']:.1f} | "
            f"{share[('attention', 'forward')]:.0%} / {share[('experts', 'forward')]:.0%} / "
            f"{share[('other', 'forward')]:.0%} / {outside:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--input-len", type=int, default=64, help="words per synthetic prompt")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--max-requests", type=int, default=None, help="at most N requests per load")
    args = parser.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    serve = ["colibri", "serve", "--device", "cpu", "--port", str(args.port)]
    server = subprocess.Popen([sys.executable, "-m", "colibri_stream", *serve[1:]], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server)
        bench(url, ["--concurrency", "4"], 8, WARM_UP_SEED, args.input_len, args.output_len)  # warm-up, not recorded
        conditions = machine()  # its load average: before the recorded runs
        runs = []
        for label, load, num_requests, seed in LOADS:
            num_requests = min(num_requests, args.max_requests or num_requests)
            command, report = bench(url, load, num_requests, seed, args.input_len, args.output_len)
            runs.append({"load": label, "command": " ".join(command), "report": report})
            print(f"{label}: {report['output_token_throughput']:.0f} output tok/s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    result = {
        "server_command": " ".join(serve),
        "model": "the shipped default model (Qwen3-MoE shape, 8 layers, 32 experts top-4, int8 experts)",
        "cache": "warm: the model is memory-mapped and was read by the warm-up run",
        "runs": runs,
        "machine": conditions,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(runs))


if __name__ == "__main__":
    main()
