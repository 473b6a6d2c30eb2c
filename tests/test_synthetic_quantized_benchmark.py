"""benchmarks/quantized.py's files (quantized_files.py) and records on the CPU, on a tiny Mixtral-like shape: the
bf16 folder, its GGUF and the quantized GGUFs (when llama.cpp's tools are given), the quantized Colibri folders, one
record per case with the Colibri side failing as it does without a GPU (its error recorded, the run going on), every
file deleted at the end. With COLIBRI_LLAMA_BIN (a folder of llama-quantize, llama-batched-bench and llama-bench,
a CPU build of benchmarks/build_llama_cpp.sh's targets serves) and COLIBRI_GGUF_PY (llama.cpp's gguf-py), llama.cpp
runs too.

mxfp4 on a tiny gpt-oss-like shape: its folders written with YaRN's truncate on (long_context.py's
benchmark_config, as llama.cpp computes it), offload cases (and the bf16 offload) as any shape's, its GGUF written
from the mxfp4 folder (with COLIBRI_GGUF_PY; llama-quantize's MXFP4_MOE, a stand-in that copies its input, only with
--llama-dense quantized), files prepared ahead (--prepare-only), and decode-only runs (--gpu-fractions without
values)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from colibri_stream import synthetic
from colibri_stream.checkpoint import ModelFolder
from colibri_stream.config import RopeConfig
from colibri_stream.experts import pinned
from colibri_stream.loader import load_model

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = dict(architecture="mixtral", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, num_experts=4, top_k=2, moe_intermediate_size=256, norm_topk_prob=True,
            rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5, max_position_embeddings=4096)
# gpt-oss-20b's options (biased clamped-SwiGLU experts, sinks, windows, YaRN with truncate off) at tiny dimensions
# (multiples of mxfp4's 32-channel blocks)
TINY_GPT_OSS = dict(synthetic.SHAPES["gpt-oss-20b"], vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, num_experts=4, top_k=2, moe_intermediate_size=128)
GGUF_PY = os.environ.get("COLIBRI_GGUF_PY")
needs_gguf_py = pytest.mark.skipif(not GGUF_PY or not (Path(GGUF_PY) / "gguf").is_dir(),
                                   reason="COLIBRI_GGUF_PY names no gguf-py folder of a llama.cpp tree")


@pytest.fixture
def quantized(monkeypatch):
    """benchmarks/quantized.py imported, the tiny shape known, no GPU asked for, the Colibri side refused."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("quantized")
    monkeypatch.setitem(synthetic.SHAPES, "tiny-mixtral", TINY)
    monkeypatch.setitem(synthetic.SHAPES, "tiny-gpt-oss", TINY_GPT_OSS)
    monkeypatch.setattr(module, "require_gpu", lambda: None)
    monkeypatch.setattr(module, "hbm_bandwidth", lambda: 1000.0)
    monkeypatch.setattr(module, "machine", lambda: {"gpu": "none (test)"})

    def no_gpu(config):
        raise RuntimeError("no GPU in this test")

    monkeypatch.setattr(module, "check_gpu_runs", no_gpu)
    monkeypatch.setattr(pinned, "PinnedExperts", HostExperts)
    return module


@pytest.fixture
def quantized_files(quantized):
    """benchmarks/quantized_files.py, which makes quantized.py's files (imported by it)."""
    return sys.modules["quantized_files"]


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


def test_prepared_files_are_what_the_timed_run_uses(quantized, tmp_path):
    """--prepare-only (while llama.cpp builds): each format's Colibri folder written and kept, nothing timed, no
    record; with COLIBRI_GGUF_PY the bf16 GGUF and its bf16 folder too. The run after it reuses them and deletes
    them at its end."""
    root = tmp_path / "files"
    gguf_py = ["--gguf-py", GGUF_PY] if GGUF_PY and (Path(GGUF_PY) / "gguf").is_dir() else []
    assert quantized.main(["--prepare-only", "--shapes", "tiny-mixtral:2", "--formats", "int4", "fp8",
                           "--folder-root", str(root), "--out", str(tmp_path / "none.json"), *gguf_py]) == 0
    assert not (tmp_path / "none.json").exists()
    prepared = {path.name: path.stat().st_mtime_ns for path in root.iterdir()}
    bf16 = {"tiny-mixtral-2-bf16", "tiny-mixtral-2-bf16.gguf"} if gguf_py else set()
    assert set(prepared) == {"tiny-mixtral-2-int4-g128", "tiny-mixtral-2-fp8"} | bf16
    records = run(quantized, tmp_path, "--keep", "--no-bf16-offload", "--gpu-fractions")
    kept = {path.name: path.stat().st_mtime_ns for path in root.iterdir()}
    # the Colibri folders untouched; the bf16 GGUF, which no llama.cpp run asked for here, left as it was
    assert kept == {name: prepared[name] for name in prepared if name != "tiny-mixtral-2-bf16"}
    assert [(r["bench"], r["expert_dtype"]) for r in records] == [("decode", "int4")] * 2 + [("decode", "fp8")] * 2


def test_decode_only_runs_no_offload_case(quantized, tmp_path, monkeypatch):
    """--gpu-fractions without values: decode records only, no expert pinned, no bf16 folder written (neither the
    bf16 offload, which has no case to be the reference of, nor llama.cpp needs it); --no-bf16-offload beside it
    changes nothing."""
    import offload

    def no_pinning(*args, **kwargs):
        raise AssertionError("an offload case ran")

    monkeypatch.setattr(offload, "open_folder", no_pinning)
    for extra in (["--gpu-fractions"], ["--gpu-fractions", "--no-bf16-offload"]):
        records = run(quantized, tmp_path, *extra)
        assert [(r["bench"], r["expert_dtype"], r["batch"]) for r in records] == [
            ("decode", "int4", 1), ("decode", "int4", 4), ("decode", "fp8", 1), ("decode", "fp8", 4)]
        assert "bf16_folder_s" not in records[0]["preparation"]


def run_gpt_oss(quantized, tmp_path, *extra) -> list[dict]:
    out = tmp_path / "quantized.json"
    assert quantized.main(["--shapes", "tiny-gpt-oss:2", "--formats", "mxfp4", "--batches", "1", "4", "--repeats",
                           "1", "--folder-root", str(tmp_path / "files"), "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_mxfp4_of_a_gpt_oss_shape(quantized, tmp_path):
    """gpt-oss with mxfp4 experts: decode records against MXFP4_MOE, the offload cases and Colibri's bf16 offload
    as for any shape (its biased experts take GPU slots, their misses computed by the CPU worker), the kept folder a
    model load_model opens on the CPU, with mxfp4 experts and YaRN's truncate on (the model llama.cpp computes),
    named for it."""
    records = run_gpt_oss(quantized, tmp_path, "--keep", "--prefill", "16", "--steps", "2")
    assert [(r["bench"], r["expert_dtype"], r.get("gpu_fraction"), r.get("batch")) for r in records] == [
        ("offload", "bfloat16", 0.0, 1), ("offload", "bfloat16", 0.0, "prefill"),
        ("decode", "mxfp4", None, 1), ("decode", "mxfp4", None, 4),
        ("offload", "mxfp4", 0.0, 1), ("offload", "mxfp4", 0.0, "prefill"),
        ("offload", "mxfp4", 0.5, 1), ("offload", "mxfp4", 0.5, "prefill")]
    for r in records:
        assert r["shape"] == "tiny-gpt-oss" and r["yarn_truncate"] is True
        assert r["colibri_error"] and r["colibri_tok_s"] is None and not r.get("skipped")
    assert [r["llama_format"] for r in records[2:]] == ["MXFP4_MOE"] * 6
    assert all("no --llama-bin" in r["llama_error"] for r in records[2:])
    decode = records[2]
    assert decode["expert_format"].startswith("mxfp4")
    assert decode["colibri_error"] == "RuntimeError: no GPU in this test"
    # codes (two a byte) and an exponent byte per 32 input channels of gate, up and down, and the float32 biases
    h, i = TINY_GPT_OSS["hidden_size"], TINY_GPT_OSS["moe_intermediate_size"]
    assert decode["expert_bytes"] == 3 * h * i // 2 + 3 * h * i // 32 + 4 * (2 * i + h)
    # only the mxfp4 folder is kept: the bf16 one (the bf16 offload's, and llama.cpp's source) never is
    kept = tmp_path / "files" / "tiny-gpt-oss-2-yarn-truncate-mxfp4"
    assert [path.name for path in (tmp_path / "files").iterdir()] == [kept.name]
    model = load_model(str(kept), device="cpu")
    config = model.config
    assert config.expert_dtype == "mxfp4" and config.expert_bias and config.sliding_windows == (128, None)
    assert config.rope.type == "yarn" and config.rope.truncate
    assert config == synthetic.with_expert_format(quantized.benchmark_config("tiny-gpt-oss", 2), "mxfp4")
    assert not synthetic.shape_config("tiny-gpt-oss", 2).rope.truncate  # the published shape's, which it is not


def test_the_bf16_folder_of_a_gpt_oss_shape_is_what_the_gguf_writer_writes(quantized_files, tmp_path):
    """The bf16 folder quantized.py writes of a gpt-oss shape is refused by nothing in gguf_writer (the published
    YaRN without truncate is); with COLIBRI_GGUF_PY its GGUF is written too."""
    import gguf_writer

    folder = quantized_files.ensure_shape_folder(tmp_path / "bf16", "tiny-gpt-oss", 2)
    config = ModelFolder(folder).config
    arch = gguf_writer.ARCHITECTURES[config.architecture]
    assert config.rope.truncate and gguf_writer.unwritable(config, arch) == []
    assert any("YaRN without truncate" in what
               for what in gguf_writer.unwritable(synthetic.shape_config("tiny-gpt-oss", 2), arch))
    if GGUF_PY and (Path(GGUF_PY) / "gguf").is_dir():
        path = gguf_writer.write_gguf(folder, tmp_path / "bf16.gguf", GGUF_PY)
        assert path.stat().st_size > 0


def fake_llama_bin(folder: Path) -> Path:
    """llama.cpp's three tools as stand-ins: llama-quantize copies its input GGUF to its output (its command line
    logged), the two benches fail as they would without a GPU."""
    folder.mkdir(parents=True)
    (folder / "llama-quantize").write_text(
        f"#!{sys.executable}\nimport shutil, sys\nshutil.copyfile(sys.argv[-4], sys.argv[-3])\n")
    for tool in ("llama-batched-bench", "llama-bench"):
        (folder / tool).write_text("#!/bin/sh\necho 'no GPU in this test' >&2\nexit 1\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


@needs_gguf_py
def test_mxfp4_gguf_is_written_from_the_mxfp4_folder(quantized, tmp_path):
    """With llama.cpp's tools (stand-ins) and gguf-py: the gpt-oss shape's GGUF (YaRN truncate on) is written from
    Colibri's mxfp4 folder, the same codes and exponents as GGML MXFP4: no bf16 folder, no bf16 GGUF, no
    llama-quantize; the benches' failures are recorded, and every file is deleted at the end."""
    llama_bin = fake_llama_bin(tmp_path / "bin")
    records = run_gpt_oss(quantized, tmp_path, "--gpu-fractions", "--llama-bin", str(llama_bin), "--gguf-py",
                          GGUF_PY)
    assert [(r["bench"], r["batch"]) for r in records] == [("decode", 1), ("decode", 4)]
    prep = records[0]["preparation"]
    assert prep["direct_gguf_s"] > 0 and "llama_quantize" not in prep
    assert "bf16_folder_s" not in prep and "bf16_gguf_s" not in prep
    for r in records:
        assert r["llama_gguf"].endswith("tiny-gpt-oss-2-yarn-truncate-MXFP4_MOE-dense-bf16.gguf")
        assert r["llama_gguf_bytes"] > 0 and "llama-batched-bench failed" in r["llama_error"]
    assert list((tmp_path / "files").iterdir()) == []


@needs_gguf_py
def test_mxfp4_with_quantized_dense_tensors_goes_through_llama_quantize(quantized, tmp_path):
    """--llama-dense quantized: the bf16 folder and its GGUF, then llama-quantize's MXFP4_MOE without the overrides
    that keep the other tensors bf16."""
    llama_bin = fake_llama_bin(tmp_path / "bin")
    records = run_gpt_oss(quantized, tmp_path, "--gpu-fractions", "--llama-bin", str(llama_bin), "--gguf-py",
                          GGUF_PY, "--llama-dense", "quantized")
    prep = records[0]["preparation"]
    assert prep["bf16_folder_s"] > 0 and prep["bf16_gguf_s"] > 0 and "direct_gguf_s" not in prep
    command = prep["llama_quantize"]["MXFP4_MOE"]["command"]
    assert " MXFP4_MOE " in command and "--tensor-type" not in command
    assert "tiny-gpt-oss-2-yarn-truncate-bf16.gguf" in command
    assert all(r["llama_gguf"].endswith("-yarn-truncate-MXFP4_MOE.gguf") for r in records)
    assert list((tmp_path / "files").iterdir()) == []


def test_llama_files_are_not_made_where_the_bf16_pair_does_not_fit(quantized, quantized_files, tmp_path,
                                                                   monkeypatch):
    """A bf16 folder and GGUF predicted past the free space: no bf16 folder is written and llama.cpp's records say
    why; Colibri's cases run."""
    (tmp_path / "gguf-py" / "gguf").mkdir(parents=True)
    monkeypatch.setattr(quantized_files, "folder_bytes", lambda config: 10**15)
    llama_bin = fake_llama_bin(tmp_path / "bin")
    records = run_gpt_oss(quantized, tmp_path, "--gpu-fractions", "--llama-bin", str(llama_bin), "--gguf-py",
                          str(tmp_path / "gguf-py"), "--llama-dense", "quantized")
    assert [(r["bench"], r["batch"]) for r in records] == [("decode", 1), ("decode", 4)]
    for r in records:
        assert r["llama_error"].startswith("not run: the bf16 folder and GGUF need about 1000000.0 GB more")
    assert "bf16_folder_s" not in records[0]["preparation"]


def test_disk_predictions_of_gpt_oss_20b(quantized_files, tmp_path, monkeypatch):
    """gpt-oss-20b's bf16 folder and GGUF at once: 83.7 GB at 24 layers, past a 64 GB disk; 50.8 GB at 14 layers.
    Its MXFP4_MOE GGUF with bf16 dense tensors: about 13.8 GB at 24 layers."""
    usage = types.SimpleNamespace(free=60e9, used=0.0)
    monkeypatch.setattr(quantized_files, "shutil", types.SimpleNamespace(disk_usage=lambda root: usage,
                                                                         rmtree=shutil.rmtree))
    config = quantized_files.benchmark_config("gpt-oss-20b", 24)
    assert config.rope.truncate
    files = quantized_files.ShapeFiles(tmp_path, "gpt-oss-20b", 24, "bf16")
    refusal = quantized_files.bf16_pair_refusal(files, config)
    assert refusal.startswith("the bf16 folder and GGUF need about 83.7 GB more at once, 60.0 GB free")
    small = quantized_files.benchmark_config("gpt-oss-20b", 14)
    files = quantized_files.ShapeFiles(tmp_path, "gpt-oss-20b", 14, "bf16")
    assert quantized_files.bf16_pair_refusal(files, small) is None
    bf16 = quantized_files.gguf_bytes(config)
    assert quantized_files.quantized_gguf_bytes(bf16, config, "MXFP4_MOE", "bf16") == pytest.approx(13.8e9, rel=0.01)
    assert quantized_files.LLAMA_BITS["MXFP4_MOE"] == 4.25
