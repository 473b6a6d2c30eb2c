"""The native model folder refuses damage with one line naming the problem: ModelFolder, describe_model and the CLI."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

pytest.importorskip("torch")

from colibri_stream.checkpoint import ModelFolder  # noqa: E402
from colibri_stream.errors import CheckpointError  # noqa: E402
from colibri_stream.export import export_model  # noqa: E402
from colibri_stream.inspect import describe_model  # noqa: E402
from tiny_models import build_hf_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny qwen2_moe (dense and MoE layers, shared expert, biases) exported with int8 experts."""
    root = tmp_path_factory.mktemp("exported")
    build_hf_model("qwen2_moe", root / "hf")
    export_model(root / "hf", root / "model", quantize="int8", progress=False)
    return root / "model"


@pytest.fixture
def model(exported, tmp_path) -> Path:
    """A copy of the exported folder that the test may damage."""
    return Path(shutil.copytree(exported, tmp_path / "model"))


def error(folder: Path, verify: bool = True) -> str:
    """The one-line message both ModelFolder and describe_model raise for `folder`."""
    messages = []
    for open_folder in (lambda: ModelFolder(folder, verify=verify), lambda: describe_model(folder, verify=verify)):
        with pytest.raises(CheckpointError) as info:
            open_folder()
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "\n" not in messages[0], messages
    return messages[0]


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_describe_model_reports_config_files_and_expert_table(model):
    report = describe_model(model, verify=True)
    for text in ("qwen2_moe", "MoE: 0, 2; dense MLP (intermediate 96): 1", "shared expert", "intermediate 40",
                 "experts.bin", "16 expert blocks", "gate_scale", "float32", "dense bfloat16, routed experts int8",
                 "Checksums: all"):
        assert text in report, text
    table = report.split("Routed experts per MoE layer\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [row.split()[:4] for row in table] == [["0", "8", "8.0", "KiB"], ["2", "8", "8.0", "KiB"]]


def test_flipped_byte_in_experts_bin_fails_verification(model):
    folder = ModelFolder(model)
    offset = int(folder.experts.entry(2, 3)["offset"]) + 100
    folder.experts.close()
    flip_byte(model / "experts.bin", offset)
    ModelFolder(model).experts.close()  # headers are intact: only the checksum tells
    describe_model(model)
    assert error(model) == "experts.bin: expert 3 of layer 2 fails its checksum (the file is corrupt)"


def test_flipped_byte_in_dense_tensor_fails_verification(model):
    path = model / "dense.safetensors"
    flip_byte(path, path.stat().st_size - 3)  # inside the last tensor, lm_head
    assert error(model) == "dense.safetensors: tensor lm_head fails its checksum (the file is corrupt)"


def test_damaged_expert_file_headers(model):
    path = model / "experts.bin"
    original = path.read_bytes()
    path.write_bytes(original[: len(original) - 5000])
    assert "experts.bin is truncated" in error(model, verify=False)
    path.write_bytes(original[:10])
    assert "experts.bin is truncated" in error(model, verify=False)
    path.write_bytes(b"NOTMAGIC" + original[8:])
    assert "experts.bin is not a Colibri expert file" in error(model, verify=False)
    path.write_bytes(original[:8] + struct.pack("<I", 99) + original[12:])
    assert "experts.bin has format version 99" in error(model, verify=False)
    path.write_bytes(original)
    flip_byte(path, 40)  # inside the JSON header
    assert "header checksum mismatch" in error(model, verify=False)


@pytest.mark.parametrize("name", ["config.json", "dense.safetensors", "experts.bin"])
def test_missing_file(model, name):
    (model / name).unlink()
    assert f"{name} is missing" in error(model, verify=False)


@pytest.mark.parametrize("changes,words", [
    (dict(num_experts=6), ["does not match config.json", "router"]),
    (dict(hidden_size=48), ["does not match config.json", "[256, 48]"]),
    (dict(moe_intermediate_size=16), ["experts.bin does not match config.json", "moe_intermediate_size"]),
    (dict(expert_dtype="bfloat16"), ["experts.bin does not match config.json", "dtype"]),
    (dict(moe_layers=[0, 1, 2]), ["does not match config.json"]),
    (dict(colour="blue"), ["unknown keys ['colour']"]),
    (dict(format="other"), ["not a Colibri model folder"]),
    (dict(format_version=2), ["format_version 2 is not supported"]),
    (dict(num_heads=3), ["num_heads (3) must be a multiple of num_kv_heads (2)"]),
    # Values of the wrong type or range: refused by name, not read as something else or failing inside NumPy.
    ({"norm_topk_prob": "false"}, ["norm_topk_prob must be true or false, got 'false'"]),
    ({"sliding_windows": [True, None, None]}, ["sliding_windows must be a list of integers or nulls"]),
    ({"eos_token_ids": ["2"]}, ["eos_token_ids must be a list of integers, got ['2']"]),
    ({"max_position_embeddings": "512"}, ["max_position_embeddings must be an integer, got '512'"]),
    ({"rope": {"theta": "1e4"}}, ["rope theta must be a number, got '1e4'"]),
    ({"clip_qkv": "3"}, ["clip_qkv must be a number or null, got '3'"]),
    ({"pad_token_id": -5}, ["pad_token_id must not be negative"]),
    ({"head_dim": 15}, ["head_dim (15) must be even"]),
    ({"dense_file": "../hf/model.safetensors"}, ["dense_file '../hf/model.safetensors' is not a file name"]),
])
def test_config_not_matching_the_weights(model, changes, words):
    edit_config(model, **changes)
    message = error(model, verify=False)
    assert all(w in message for w in words), message


def test_dense_tensor_of_another_dtype(model):
    path = model / "dense.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tensors["norm"] = tensors["norm"].astype(np.int8)
    save_file(tensors, str(path), metadata=metadata)
    assert error(model, verify=False) == ("dense.safetensors does not match config.json: norm is stored as I8, "
                                          "config.json's dtype bfloat16 is BF16")


def test_invalid_json(model):
    (model / "config.json").write_text('{"format": "colibri",')
    assert "config.json is not valid JSON" in error(model, verify=False)


@pytest.mark.parametrize("text", ['{"hidden_size": NaN}', '{"rms_norm_eps": Infinity}', "[" * 100000 + "]" * 100000])
def test_json_that_python_reads_but_json_does_not_allow(model, text):
    """NaN and Infinity (Python's reader takes them, then a size check lets them through) and nesting too deep for
    the reader are refused in one line."""
    config = json.loads((model / "config.json").read_text())
    if text.startswith("{"):
        key, value = text[1:-1].split(": ")
        raw = json.dumps({**config, json.loads(key): 1.5}).replace("1.5", value)
    else:
        raw = text
    (model / "config.json").write_text(raw)
    assert "config.json is not valid JSON" in error(model, verify=False)


def test_an_index_offset_near_2_64_is_refused_as_past_the_end(model):
    """The index's offsets are added in Python's integers: a uint64 sum would wrap and pass the size check."""
    from colibri_stream.checkpoint import _FIXED_HEADER, INDEX_DTYPE, crc32

    path = model / "experts.bin"
    raw = bytearray(path.read_bytes())
    magic, version, json_len, entries, _, data_offset = _FIXED_HEADER.unpack_from(raw)
    start = -(-(_FIXED_HEADER.size + json_len) // 8) * 8
    index = np.frombuffer(raw, INDEX_DTYPE, entries, start).copy()
    index["offset"][0] = 2**64 - 4096
    raw[start: start + index.nbytes] = index.tobytes()
    header_crc = crc32(bytes(raw[_FIXED_HEADER.size: _FIXED_HEADER.size + json_len]) + index.tobytes())
    raw[: _FIXED_HEADER.size] = _FIXED_HEADER.pack(magic, version, json_len, entries, header_crc, data_offset)
    path.write_bytes(bytes(raw))
    assert "experts.bin is truncated" in error(model, verify=False)


def test_dense_checksums_that_are_not_an_object(model):
    path = model / "dense.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
    save_file(load_file(str(path)), str(path), metadata=dict(metadata, **{"colibri.crc32": "[1, 2]"}))
    assert "checksums are not an object" in error(model, verify=False)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_stream.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_output_to_a_reader_that_stops_reading(model):
    """`colibri inspect DIR | head -1` where head has gone before the output is written (its end of the pipe is
    closed before the command starts): no traceback."""
    child = subprocess.Popen([sys.executable, "-m", "colibri_stream.cli", "inspect", str(model)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 1 and stderr == "", stderr


@pytest.mark.skipif(not (REPO / "colibri_stream" / "cli.py").is_file(), reason="no CLI")
def test_cli_inspect(model):
    ok = run_cli("inspect", str(model), "--verify")
    assert ok.returncode == 0 and "Routed experts per MoE layer" in ok.stdout, ok.stderr
    folder = ModelFolder(model)
    offset = int(folder.experts.entry(0, 7)["offset"])
    folder.experts.close()
    flip_byte(model / "experts.bin", offset)
    bad = run_cli("inspect", str(model), "--verify")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "error: experts.bin: expert 7 of layer 0 fails its checksum (the file is corrupt)"
