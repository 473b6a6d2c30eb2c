"""benchmarks/quantized.py's files and records on the CPU, on a tiny Mixtral-like shape: the bf16 folder, its GGUF
and the quantized GGUFs (when llama.cpp's tools are given), the quantized Colibri folders, one record per case with
the Colibri side failing as it does without a GPU (its error recorded, the run going on), every file deleted at the
end. With COLIBRI_LLAMA_BIN (a folder of llama-quantize, llama-batched-bench and llama-bench, a CPU build of
benchmarks/build_llama_cpp.sh's targets serves) and COLIBRI_GGUF_PY (llama.cpp's gguf-py), llama.cpp runs too."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_stream import synthetic
from colibri_stream.experts import pinned
from colibri_stream.config import RopeConfig

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = dict(architecture="mixtral", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, num_experts=4, top_k=2, moe_intermediate_size=256, norm_topk_prob=True,
            rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5, max_position_embeddings=4096)


@pytest.fixture
def quantized(monkeypatch):
    """benchmarks/quantized.py imported, the tiny shape known, no GPU asked for, the Colibri side refused."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("quantized")
    monkeypatch.setitem(synthetic.SHAPES, "tiny-mixtral", TINY)
    monkeypatch.setattr(module, "require_gpu", lambda: None)
    monkeypatch.setattr(module, "hbm_bandwidth", lambda: 1000.0)
    monkeypatch.setattr(module, "machine", lambda: {"gpu": "none (test)"})

    def no_gpu(config):
        raise RuntimeError("no GPU in this test")

    monkeypatch.setattr(module, "check_gpu_runs", no_gpu)
    monkeypatch.setattr(pinned, "PinnedExperts", HostExperts)
    return module


class HostExperts:
    """PinnedExperts in plain host memory (no CuPy): every block read through the reader it is given."""

    def __init__(self, expert_file, reader):
        layers, experts = expert_file.config.moe_layers, expert_file.config.num_experts
        self.arena = np.empty((len(layers) * experts, expert_file.block_size), np.uint8)  # [L*E, block_size]
        for rank, layer in enumerate(layers):
            for expert in range(experts):
                reader.read_into(layer, expert, self.arena[rank * experts + expert])


def held_deleted_files(root: Path) -> list[str]:
    """Files under `root` deleted but still open or mapped by this process (their disk space not given back)."""
    links = [os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [name for name in links + maps if str(root) in name and "(deleted)" in name]


def run(quantized, tmp_path, *extra) -> list[dict]:
    out = tmp_path / "quantized.json"
    root = tmp_path / "files"
    assert quantized.main(["--shapes", "tiny-mixtral:2", "--formats", "int4", "fp8", "--batches", "1", "4",
                           "--repeats", "2", "--prefill", "16", "--steps", "2", "--folder-root", str(root),
                           "--out", str(out), *extra]) == 0
    if "--keep" not in extra:
        assert list(root.iterdir()) == []  # every file of the shape deleted after its cases
        if Path("/proc/self/fd").is_dir():
            assert held_deleted_files(root) == []  # and its disk space given back
    return json.loads(out.read_text())


def check_records(records: list[dict]) -> None:
    decode = [r for r in records if r["bench"] == "decode"]
    offload = [r for r in records if r["bench"] == "offload"]
    assert [(r["expert_dtype"], r["batch"]) for r in decode] == [("int4", 1), ("int4", 4), ("fp8", 1), ("fp8", 4)]
    assert [(r["expert_dtype"], r["gpu_fraction"], r["batch"]) for r in offload] == [
        ("bfloat16", 0.0, 1), ("bfloat16", 0.0, "prefill"),
        ("int4", 0.0, 1), ("int4", 0.0, "prefill"), ("int4", 0.5, 1), ("int4", 0.5, "prefill"),
        ("fp8", 0.0, 1), ("fp8", 0.0, "prefill"), ("fp8", 0.5, 1), ("fp8", 0.5, "prefill")]
    for r in records:
        assert r["shape"] == "tiny-mixtral" and r["layers"] == 2 and r["commit"]
        assert r["colibri_error"] and r["colibri_tok_s"] is None
    int4 = decode[0]
    assert int4["expert_format"] == "int4, groups of 128, symmetric" and int4["llama_format"] == "Q4_0"
    assert decode[2]["expert_format"].startswith("fp8") and decode[2]["llama_format"] == "Q8_0"
    # codes and scales of gate, up (128 groups of 128 rows... ) and down: 3 * H * I / 2 bytes of codes, a float32
    # scale per 128 of them
    h, i = TINY["hidden_size"], TINY["moe_intermediate_size"]
    assert int4["expert_bytes"] == 3 * h * i // 2 + 4 * (2 * i * (h // 128) + h * (i // 128))
    assert int4["expert_block_bytes"] % 4096 == 0 and int4["expert_block_bytes"] >= int4["expert_bytes"]
    assert offload[4]["llama_n_cpu_moe"] == 1 and offload[2]["llama_n_cpu_moe"] == 2
    assert {"bf16_folder_s", "colibri_folder_s"} <= set(records[-1]["preparation"])


def test_files_and_records_without_llama_cpp(quantized, tmp_path):
    records = run(quantized, tmp_path)
    check_records(records)
    assert all(r["llama_tok_s"] is None and "no --llama-bin" in r["llama_error"] for r in records
               if r["expert_dtype"] != "bfloat16")


@pytest.mark.skipif(not (os.environ.get("COLIBRI_LLAMA_BIN") and os.environ.get("COLIBRI_GGUF_PY")),
                    reason="COLIBRI_LLAMA_BIN and COLIBRI_GGUF_PY name no llama.cpp build and gguf-py")
def test_files_and_records_with_llama_cpp(quantized, tmp_path):
    records = run(quantized, tmp_path, "--llama-bin", os.environ["COLIBRI_LLAMA_BIN"], "--gguf-py",
                  os.environ["COLIBRI_GGUF_PY"], "--threads", str(min(4, os.cpu_count() or 1)))
    check_records(records)
    quantized_records = [r for r in records if r["expert_dtype"] != "bfloat16"]
    for r in quantized_records:
        assert r["llama_error"] is None and r["llama_tok_s"] > 0, r
        assert r["llama_gguf_bytes"] > 0
    decode = [r for r in records if r["bench"] == "decode"]
    assert all(len(r["llama_tok_s_runs"]) == 2 for r in decode)  # one llama-batched-bench run a round
    prep = records[-1]["preparation"]
    assert set(prep["llama_quantize"]) == {"Q4_0", "Q8_0"} and prep["bf16_gguf_s"] > 0
    assert "--tensor-type attn=bf16" in prep["llama_quantize"]["Q4_0"]["command"]
    assert sys.modules["quantized"].table(records).count("\n") == len(records) + 1


def test_kept_files_are_reused(quantized, tmp_path):
    check_records(run(quantized, tmp_path, "--keep"))
    kept = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "files").iterdir()}
    assert set(kept) == {"tiny-mixtral-2-int4-g128", "tiny-mixtral-2-fp8"}  # the bf16 folder is never kept
    records = run(quantized, tmp_path, "--keep", "--no-bf16-offload", "--formats", "int4")
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "files").iterdir()} == kept
    assert [(r["bench"], r["expert_dtype"]) for r in records] == [("decode", "int4")] * 2 + [("offload", "int4")] * 4
    assert "colibri_folder_s" in records[0]["preparation"] and "bf16_folder_s" not in records[0]["preparation"]
