"""Exit codes of many `colibri generate` runs (back to back and concurrent) and `colibri serve` start/SIGTERM cycles.

Each run must end with exit code 0. The model is the test suite's tiny Mixtral (built here with transformers, as
tests/conftest.py does): it answers in a fraction of a second, so a run's exit comes while the threads the engine
started at load may still be working, which is the race this measures. With `--baseline-ref REF` the same runs are
made with the package of git revision REF (installed from a temporary worktree, put first on PYTHONPATH), in the
same process and on the same machine, so the record holds both; `--ref` measures a revision the same way (edits in
the work tree during the run then do not reach the children). Results: benchmarks/results/exit_stress_cpu.json.

    python benchmarks/exit_stress.py [--generate-runs 1000] [--concurrency 4] [--server-cycles 100]
                                     [--ref HEAD] [--baseline-ref a28294f --baseline-generate-runs 300]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conditions import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "exit_stress_cpu.json"


def build_tiny_model(folder: Path) -> Path:
    """The test suite's tiny Mixtral, exported to fp32 with its tokenizer (tests/conftest.py's tiny_model_dir)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import MAX_POSITIONS, TOKENIZER_VOCAB_SIZE, write_tokenizer
    from tiny_models import build_hf_model

    from colibri_stream.export import export_model

    build_hf_model("mixtral", folder / "hf", vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS)
    export_model(folder / "hf", folder / "model", dtype="fp32", progress=False)
    write_tokenizer(folder / "model")
    return folder / "model"


CLI = [sys.executable, "-m", "colibri_stream.cli"]


def child_env(package_root: Path | None) -> dict:
    """The children's environment: `package_root` (a folder holding an installed colibri_stream) first on
    PYTHONPATH when given. Children run in the scratch folder, so the checkout is not on their path."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    env.pop("PYTHONPATH", None)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    return env


def generate_runs(model: Path, runs: int, concurrency: int, env: dict) -> dict:
    command = [*CLI, "generate", "--model", str(model), "--prompt",
               "The quick brown fox", "--max-tokens", "16", "--temperature", "0", "--json"]

    def one(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=model.parent)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(runs)))
    codes = [d.returncode for d in done]
    return {"runs": runs, "concurrency": concurrency, "exit_codes": dict(collections.Counter(map(str, codes))),
            "failures": sum(code != 0 for code in codes), "seconds": round(time.perf_counter() - start, 1),
            "failure_stderr": [d.stderr[-400:] for d in done if d.returncode != 0][:5]}


def server_cycles(model: Path, cycles: int, env: dict) -> dict:
    """Start `colibri serve`, wait for /health, answer one completion, SIGTERM; the exit code of each."""
    codes, start = [], time.perf_counter()
    for _ in range(cycles):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        process = subprocess.Popen([*CLI, "serve", "--model", str(model),
                                    "--port", str(port), "--max-seq-len", "256"], env=env, cwd=model.parent,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if wait_healthy(port, process):
                body = json.dumps({"prompt": "The quick", "max_tokens": 8, "temperature": 0}).encode()
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                urllib.request.urlopen(request, timeout=60).read()
                process.send_signal(signal.SIGTERM)
            codes.append(process.wait(timeout=120))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return {"cycles": cycles, "exit_codes": dict(collections.Counter(map(str, codes))),
            "failures": sum(code != 0 for code in codes), "seconds": round(time.perf_counter() - start, 1)}


def wait_healthy(port: int, process: subprocess.Popen, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.05)
    return False


def installed(ref: str, scratch: Path, name: str) -> dict:
    """The children's environment for git revision `ref`, installed (not editable: the package maps export/,
    tokenizer/ and kernels/ into itself) from a temporary worktree into scratch/NAME-site."""
    worktree, site = scratch / name, scratch / f"{name}-site"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), ref], check=True,
                   capture_output=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        str(worktree)], check=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    env = child_env(site)
    where = subprocess.run([sys.executable, "-c", "import colibri_stream; print(colibri_stream.__file__)"],
                           env=env, cwd=scratch, capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(site)):
        raise SystemExit(f"revision {ref} imports {where}, not the package installed in {site}")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate-runs", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4, help="generate runs at once")
    parser.add_argument("--server-cycles", type=int, default=100)
    parser.add_argument("--ref", default=None,
                        help="git revision measured (default: the checkout as it is, through its install)")
    parser.add_argument("--baseline-ref", default=None, help="git revision whose package is the baseline")
    parser.add_argument("--baseline-generate-runs", type=int, default=300)
    parser.add_argument("--baseline-server-cycles", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        model = build_tiny_model(scratch)
        env = child_env(None) if args.ref is None else installed(args.ref, scratch, "measured")
        record = {"bench": "exit_stress", "machine": machine(), "model": "tests' tiny Mixtral (fp32)",
                  "colibri": {"ref": args.ref or "work tree",
                              "generate": generate_runs(model, args.generate_runs, args.concurrency, env),
                              "server": server_cycles(model, args.server_cycles, env)}}
        if args.baseline_ref is not None:
            env = installed(args.baseline_ref, scratch, "baseline")
            record["baseline"] = {"ref": args.baseline_ref,
                                  "generate": generate_runs(model, args.baseline_generate_runs, args.concurrency, env),
                                  "server": server_cycles(model, args.baseline_server_cycles, env)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
