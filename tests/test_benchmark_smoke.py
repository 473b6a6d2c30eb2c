"""Every benchmark script runs end to end on the CPU with its smallest options (the shipped model or a tiny synthetic
one) and writes its JSON record, so that a script the GPU machine will run is known to work; a script that times the
GPU exits before any work with a message saying it needs one."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# imported by the scripts, not run
LIBRARIES = {"conditions.py", "gguf_writer.py", "offload_llama.py", "quantized_files.py"}

# Scripts that time the GPU, with the options of a run: each must stop at the GPU check, before writing anything.
GPU_SCRIPTS = {
    "compare_revisions.py": ["--baseline-tree", str(ROOT), "--rounds", "1"],
    "decode.py": ["--shapes", "mixtral-8x7b", "--batches", "1"],
    "decode_attention.py": ["--shapes", "mixtral-8x7b", "--contexts", "64", "--batches", "1"],
    "dense_projection.py": ["--tokens", "1"],
    "engine_decode.py": ["--shapes", "mixtral-8x7b", "--layers", "1", "--batches", "1"],
    "handoff_latency.py": ["--repeats", "1"],
    "host_pages.py": ["--blocks", "1", "--rounds", "1"],
    "long_context.py": ["--shapes", "mixtral-8x7b:1", "--contexts", "64", "--batches", "1", "--decode-tokens", "2"],
    "moe_prefill.py": ["--shapes", "mixtral-8x7b", "--tokens", "64"],
    "moe_formats.py": ["--shapes", "qwen3-30b-a3b", "--tokens", "1"],
    "offload.py": ["--layers", "1", "--fractions", "0.5", "--batches", "1"],
    "offload_timeline.py": ["--layers", "1", "--steps", "1"],
    "prefill_attention.py": ["--contexts", "64", "--shapes", "mixtral-8x7b", "--short-chunks"],
    "quantized.py": ["--shapes", "mixtral-8x7b:1", "--formats", "int4", "--batches", "1"],
    "step_kernels.py": ["--layers", "1"],
}
# Scripts with a test of their own below.
CPU_SCRIPTS = {"cpu_expert_kernels.py", "exit_stress.py", "expert_format_quality.py", "export_peak_rss.py",
               "llama_cpp.py", "llama_cpp_parity.py", "offload_accelerate.py", "policy_eval.py", "prefix_cache_ttft.py", "sampling_host.py",
               "serving_cpu.py", "serving_gpu.py", "step_kernels_table.py", "timing_overhead.py"}


def run_script(name: str, *args, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME ARGS` from the repository root, as BENCHMARKS.md's commands run."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def succeeded(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_script_has_a_smoke_test():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - LIBRARIES
    assert scripts == set(GPU_SCRIPTS) | CPU_SCRIPTS


def test_gpu_scripts_stop_with_a_message_when_no_gpu_is_visible(tmp_path):
    """One child runs every GPU script's main (imports shared) with no CUDA device visible, even on a GPU machine:
    each exits naming what it needs, and writes no record."""
    child = textwrap.dedent("""
        import json, runpy, sys
        sys.path.insert(0, sys.argv[1])
        exits = {}
        for script, args in json.loads(sys.argv[2]).items():
            sys.argv = [script, *args]
            try:
                runpy.run_path(f"{sys.path[0]}/{script}", run_name="__main__")
                exits[script] = None
            except SystemExit as exit:
                exits[script] = exit.code
        print(json.dumps(exits))
        """)
    runs = {script: [*args, "--out", str(tmp_path / f"{script}.json")] for script, args in GPU_SCRIPTS.items()}
    runs["step_kernels.py"] = GPU_SCRIPTS["step_kernels.py"]  # it writes no record: ncu reads its kernels
    done = subprocess.run([sys.executable, "-c", child, str(BENCHMARKS), json.dumps(runs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    succeeded(done)
    exits = json.loads(done.stdout.splitlines()[-1])
    for script in GPU_SCRIPTS:
        assert isinstance(exits[script], str) and exits[script].startswith(f"{script} needs a GPU: "), exits[script]
    assert list(tmp_path.iterdir()) == []


def test_quantized_gpt_oss_mxfp4_command_stops_at_the_gpu_check(tmp_path):
    """quantized.py's command for gpt-oss-20b's mxfp4 experts against llama.cpp's MXFP4_MOE, decode only
    (--gpu-fractions without values), parses and stops at the GPU check with no device visible, before writing
    anything; --help names the format and the optional fractions."""
    out, files = tmp_path / "quantized.json", tmp_path / "files"
    done = run_script("quantized.py", "--shapes", "gpt-oss-20b:14", "--formats", "mxfp4", "--batches", 1, 16, 64,
                      "--gpu-fractions", "--no-bf16-offload", "--llama-bin", tmp_path / "bin", "--gguf-py",
                      tmp_path / "gguf-py", "--folder-root", files, "--out", out,
                      env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode != 0 and "quantized.py needs a GPU: " in done.stderr, done.stderr[-2000:]
    assert not out.exists() and not files.exists()
    shown = run_script("quantized.py", "--help")
    succeeded(shown)
    assert "mxfp4" in shown.stdout and "--gpu-fractions [GPU_FRACTIONS ...]" in shown.stdout


def test_cpu_expert_kernels(tmp_path):
    out = tmp_path / "cpu_expert_kernels.json"
    succeeded(run_script("cpu_expert_kernels.py", "--shapes", "qwen3-30b-a3b", "--dtypes", "bf16", "--tokens", "1",
                         "--threads", "1", "--rounds", "1", "--cycle-mib", "8", "--candidates", "numpy,numba",
                         "--out", out))
    record = json.loads(out.read_text())
    assert {"machine", "baseline", "rounds", "results"} <= set(record)
    assert [(r["candidate"], r["shape"], r["tokens"]) for r in record["results"]] == [
        ("numpy", "qwen3-30b-a3b", 1), ("numba", "qwen3-30b-a3b", 1)]
    for row in record["results"]:
        assert row["median_ms"] > 0 and row["gbs"] > 0 and row["max_rel_err"] < 0.05


def test_exit_stress(tmp_path):
    out = tmp_path / "exit_stress.json"
    succeeded(run_script("exit_stress.py", "--generate-runs", "1", "--concurrency", "1", "--server-cycles", "1",
                         "--output", out))
    record = json.loads(out.read_text())
    assert {"bench", "colibri", "machine", "model"} <= set(record)
    assert {"generate", "server"} <= set(record["colibri"])


def test_export_peak_rss(tmp_path):
    out = tmp_path / "export_peak_rss.json"
    succeeded(run_script("export_peak_rss.py", "--layers", "1", "--hidden", "64", "--intermediate", "128",
                         "--experts", "2", "--vocab", "256", "--modes", "bf16", "--workdir", tmp_path, "--out", out))
    record = json.loads(out.read_text())
    assert record["checkpoint"]["layers"] == 1 and record["checkpoint"]["bytes"] > 0
    assert [run["mode"] for run in record["runs"]] == ["bf16"] and record["runs"][0]["peak_rss_bytes"] > 0
    assert {path.name for path in tmp_path.iterdir()} == {"export_peak_rss.json"}  # its checkpoint removed


def test_llama_cpp_parity_needs_gguf_py_and_a_libllama_build(tmp_path):
    """Without llama.cpp's gguf-py, or without a libllama build, the comparison stops before writing a model."""
    done = run_script("llama_cpp_parity.py", "--gguf-py", tmp_path / "no-gguf-py", "--llama-lib", tmp_path)
    assert done.returncode != 0 and "needs llama.cpp's gguf-py folder" in done.stderr
    (tmp_path / "gguf-py" / "gguf").mkdir(parents=True)
    done = run_script("llama_cpp_parity.py", "--gguf-py", tmp_path / "gguf-py", "--llama-lib", tmp_path)
    assert done.returncode != 0 and "needs a CPU build of libllama" in done.stderr


def test_llama_cpp_needs_the_gguf_writer_of_a_llama_cpp_tree(tmp_path):
    """Without llama.cpp's gguf-py the script stops before writing its model folder."""
    folder = tmp_path / "model"
    done = run_script("llama_cpp.py", "--folder", folder, "--gguf", tmp_path / "model.gguf", "--gguf-py",
                      tmp_path / "no-llama-cpp")
    assert done.returncode != 0 and "llama_cpp.py needs llama.cpp's gguf-py folder" in done.stderr
    assert not folder.exists()


def test_offload_accelerate(tmp_path):
    """transformers + accelerate on a tiny model on the CPU, or, without accelerate, a message naming it."""
    out = tmp_path / "offload_accelerate.json"
    done = run_script("offload_accelerate.py", "--device", "cpu", "--tiny", "--layers", "1", "--prompt-tokens", "4",
                      "--new-tokens", "1", "--gpu-expert-fraction", "0.5", "--json", out)
    if importlib.util.find_spec("accelerate") is None:
        assert done.returncode != 0 and "offload_accelerate.py needs accelerate" in done.stderr
        return
    succeeded(done)
    record = json.loads(out.read_text())
    assert record["bench"] == "offload_baseline" and record["device"] == "cpu" and record["prefill_tok_s"] > 0


def test_expert_format_quality(tmp_path):
    out = tmp_path / "expert_formats.json"
    succeeded(run_script("expert_format_quality.py", "--max-windows", "1", "--formats", "int8", "int4-g128",
                         "fp8-block", "--out", out))
    record = json.loads(out.read_text())
    formats = record["formats"]
    assert record["windows"] == 1 and set(formats) == {"int8", "int4-g128", "fp8-block"}
    assert formats["int8"]["perplexity_vs_int8"] == 0 and all(f["perplexity"] > 1 for f in formats.values())
    assert formats["int4-g128"]["expert_bytes"] < 0.6 * formats["int8"]["expert_bytes"]
    assert formats["int4-g128"]["perplexity"] != formats["int8"]["perplexity"]  # the experts really changed


def test_kv_cache_quality(tmp_path):
    out = tmp_path / "kv_cache_quality.json"
    succeeded(run_script("expert_format_quality.py", "--max-windows", "1", "--kv-dtypes", "fp32", "fp8", "--out", out))
    record = json.loads(out.read_text())
    kv = record["kv_dtypes"]
    assert record["bench"] == "kv_cache_quality" and set(kv) == {"fp32", "fp8"}
    assert kv["fp32"]["perplexity_vs_fp32"] == 0 and kv["fp8"]["perplexity"] != kv["fp32"]["perplexity"]
    refused = run_script("expert_format_quality.py", "--kv-dtypes", "fp8")
    assert refused.returncode == 2 and "starts with fp32" in refused.stderr


def test_matmul_precision_quality_wants_high_first_and_a_gpu():
    refused = run_script("expert_format_quality.py", "--matmul-precisions", "medium")
    assert refused.returncode == 2 and "starts with high" in refused.stderr
    if importlib.util.find_spec("cupy") is None:
        no_gpu = run_script("expert_format_quality.py", "--max-windows", "1", "--matmul-precisions", "high", "medium")
        assert no_gpu.returncode != 0 and "needs a GPU" in no_gpu.stderr


def test_policy_eval(tmp_path):
    out = tmp_path / "policy_eval.json"
    succeeded(run_script("policy_eval.py", "--decode-tokens", "2", "--window-tokens", "16", "--out", out))
    record = json.loads(out.read_text())
    assert {"replay", "lfu_decay_sweep", "prefetch_recall", "store_runs", "conditions"} <= set(record)
    assert set(record["replay"]) == {"batch 1", "batch 4"}
    assert record["store_runs"] and all(run["logits_equal_resident"] for run in record["store_runs"])


def test_prefix_cache_ttft(tmp_path):
    out = tmp_path / "prefix_cache_ttft.json"
    succeeded(run_script("prefix_cache_ttft.py", "--prompt-tokens", "40", "--rounds", "1", "--out", out))
    record = json.loads(out.read_text())
    assert set(record["ttft_ms"]) == {"cached", "uncached"} and record["rounds"] == 1
    assert record["cached_tokens_per_resend"] > 0


def test_sampling_host(tmp_path):
    out = tmp_path / "sampling_host.json"
    succeeded(run_script("sampling_host.py", "--batch-sizes", "2", "--steps", "1", "--out", out))
    records = json.loads(out.read_text())
    assert [r["batch"] for r in records] == [2] and records[0]["numpy_ms_per_step"] > 0


def test_serving_cpu(tmp_path):
    out = tmp_path / "serving_cpu.json"
    succeeded(run_script("serving_cpu.py", "--port", free_port(), "--input-len", "4", "--output-len", "2",
                         "--max-requests", "2", "--out", out))
    record = json.loads(out.read_text())
    assert {"server_command", "model", "runs", "machine", "command"} <= set(record)
    assert [run["load"] for run in record["runs"]][0] == "concurrency 1"
    for run in record["runs"]:
        assert run["report"]["completed"] == 2 and run["report"]["output_token_throughput"] > 0


def test_serving_gpu_records_served_and_offline_figures(tmp_path):
    """serving_gpu.py on the shipped model: offline engine and `colibri serve` at two concurrencies, one record each
    with the fields BENCHMARKS.md reads; every request got its tokens (the script fails otherwise)."""
    out = tmp_path / "serving.json"
    succeeded(run_script("serving_gpu.py", "--device", "cpu", "--models", "default", "--concurrency", "1", "2",
                         "--output-len", "8", "--input-len", "8", "--rounds", "1", "--out", out))
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


def test_step_kernels_table(tmp_path):
    """Nsight Compute's CSV (two launches of one kernel, one of another) becomes the launch and per-kernel tables."""
    header = '"ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value"'
    rows = [(0, "rms_norm", "gpu__time_duration.sum", "ns", "4,000"), (0, "rms_norm", "dram__bytes_read.sum", "byte",
            "8,000"), (1, "void moe<float>(int)", "gpu__time_duration.sum", "us", "10"),
            (1, "void moe<float>(int)", "dram__bytes_read.sum", "Mbyte", "20"),
            (2, "rms_norm", "gpu__time_duration.sum", "ns", "6,000"), (2, "rms_norm", "dram__bytes_read.sum", "byte",
            "12,000")]
    csv = tmp_path / "ncu.csv"
    csv.write_text("==PROF== Connected\n" + header + "\n" + "\n".join(
        f'"{i}","{kernel}","(1, 1, 1)","{metric}","{unit}","{value}"' for i, kernel, metric, unit, value in rows))
    done = run_script("step_kernels_table.py", csv)
    succeeded(done)
    lines = done.stdout.splitlines()
    assert lines[0] == "| # | kernel | grid | us | MB read | GB/s |"
    assert [line.split(" | ")[1] for line in lines[2:5]] == ["rms_norm", "void moe<float>", "rms_norm"]  # in order
    assert "| void moe<float> | 1 | 10.0 | 20.0 | 2000 |" in lines
    assert "| rms_norm | 2 | 10.0 | 0.0 | 2 |" in lines


def test_timing_overhead(tmp_path):
    out = tmp_path / "timing_overhead.json"
    succeeded(run_script("timing_overhead.py", "--batch-sizes", "1", "--steps", "2", "--rounds", "1", "--out", out))
    record = json.loads(out.read_text())
    assert record["backend"] == "numpy (CPU)" and [run["batch_size"] for run in record["runs"]] == [1]
    assert {"metrics", "trace", "noise"} <= set(record["runs"][0])
