"""Benchmarks run end to end on the CPU with tiny settings, so that a script the GPU machine will run is known to work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_serving_gpu_records_served_and_offline_figures(tmp_path):
    """serving_gpu.py on the shipped model: offline engine and `colibri serve` at two concurrencies, one record each
    with the fields BENCHMARKS.md reads; every request got its tokens (the script fails otherwise)."""
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "serving_gpu.py"), "--device", "cpu", "--models",
                           "default", "--concurrency", "1", "2", "--output-len", "8", "--input-len", "8",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [(r["bench"], r["model"], r["concurrency"], r["num_requests"]) for r in records] == [
        ("serving_gpu", "default", 1, 1), ("serving_gpu", "default", 2, 2)]
    for r in records:
        assert r["output_len"] == 8 and r["device"] == "cpu" and r["layers"] == 8
        assert r["served_tok_s"] > 0 and r["offline_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["served_tok_s"] / r["offline_tok_s"])
        assert r["ttft_p50_ms"] > 0 and r["offline_ttft_p50_ms"] > 0
        assert r["itl_p99_ms"] is None or r["itl_p99_ms"] > 0  # None: the bytes of a reply came in one chunk
        assert r["served_step_interval_ms"] > 0 and r["offline_step_interval_ms"] > 0
        assert r["server_loop_cpu_us_per_token"] is None or r["server_loop_cpu_us_per_token"] >= 0
        assert "--max-batch-size=2" in r["server_command"] and r["machine"]["commit"] == r["commit"]
    table = done.stdout.splitlines()
    assert table[0].startswith("| model | streams | offline tok/s | served tok/s |") and len(table) == 2 + 2


def test_prefill_attention_says_when_there_is_no_gpu(tmp_path):
    """prefill_attention.py times GPU kernels only: without a GPU it says so, exits 2 and writes nothing."""
    from colibri_stream.backends.cupy_backend import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present: the benchmark would run")
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "prefill_attention.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA GPU" in done.stderr
    assert not out.exists()
