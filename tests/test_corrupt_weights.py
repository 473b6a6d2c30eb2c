"""Corrupt weights are found without --verify: a flipped byte in an expert block of experts.bin (its CRC32 checked
the first time the block is read, on the memory-mapped CPU path) or in a tensor of dense.safetensors (its CRC32
checked when the dense weights load). `colibri generate` exits non-zero with one `error:` line naming the file and
the expert or tensor; `colibri serve` refuses to start on a corrupt dense file; on a corrupt expert the real server
answers the request that reads it with a 500 (an error event in a stream) naming it, and goes on answering. A
model whose weights are intact but give NaN logits ends each request with an error, never a crash of sampling."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import orjson
import pytest
from conftest import linked_model
from test_request_isolation import nan_weights_model
from test_server import LiveServer, request

from colibri_stream.checkpoint import ExpertFile, read_config

PROMPT = "The quick brown fox jumps over the lazy dog. Mixture of experts models route every token"
LAYER, EXPERT = 1, 5  # the block flipped: the prompt's tokens route to it (asserted through the error)
EXPERT_ERROR = f"experts.bin: expert {EXPERT} of layer {LAYER} fails its checksum (the file is corrupt)"
TENSOR = "layers.1.q_proj"
DENSE_ERROR = f"dense.safetensors: tensor {TENSOR} fails its checksum (the file is corrupt)"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x40]))


def copy_with(model_dir: Path, folder: Path, name: str) -> Path:
    """`folder`: `model_dir`'s files linked, but `name`, copied (to be damaged)."""
    linked_model(model_dir, folder, leave_out=name)
    shutil.copyfile(model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def corrupt_expert_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with one byte flipped inside the gate weights of expert EXPERT of layer LAYER."""
    folder = copy_with(tiny_model_dir, tmp_path_factory.mktemp("models") / "corrupt-expert", "experts.bin")
    experts = ExpertFile(folder / "experts.bin", read_config(folder))
    offset = int(experts.entry(LAYER, EXPERT)["offset"]) + experts.slots[0].offset + 1001
    experts.close()
    flip_byte(folder / "experts.bin", offset)
    return folder


@pytest.fixture(scope="module")
def corrupt_dense_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with one byte flipped inside the dense tensor TENSOR."""
    folder = copy_with(tiny_model_dir, tmp_path_factory.mktemp("models") / "corrupt-dense", "dense.safetensors")
    path = folder / "dense.safetensors"
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        begin, end = json.loads(f.read(header_len))[TENSOR]["data_offsets"]
    flip_byte(path, 8 + header_len + (begin + end) // 2)
    return folder


def generate(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_stream", "generate", "--model", str(folder), "--device",
                           "cpu", "--prompt", PROMPT, "--max-tokens", "8"], capture_output=True, text=True,
                          timeout=300)


def assert_one_error_line(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 1, and stderr ends with the one `error:` line (after log lines, if any), no traceback."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:] == [f"error: {message}"]
    assert "Traceback" not in result.stderr


def test_generate_refuses_a_flipped_byte_in_an_expert_block(corrupt_expert_dir, tiny_model_dir):
    assert generate(tiny_model_dir).returncode == 0
    assert_one_error_line(generate(corrupt_expert_dir), EXPERT_ERROR)


def test_generate_and_serve_refuse_a_flipped_byte_in_a_dense_tensor(corrupt_dense_dir):
    assert_one_error_line(generate(corrupt_dense_dir), DENSE_ERROR)
    served = subprocess.run([sys.executable, "-m", "colibri_stream", "serve", "--model", str(corrupt_dense_dir),
                             "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=300)
    assert_one_error_line(served, DENSE_ERROR)


def test_the_server_answers_a_request_reading_a_corrupt_expert_with_a_500_and_goes_on(corrupt_expert_dir):
    live = LiveServer(corrupt_expert_dir, dict(max_batch_size=4, max_seq_len=256))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(2):  # the block's verdict is kept: every read of it fails, none serves its bytes
            with pytest.raises(openai.InternalServerError) as refused:
                client.completions.create(model="corrupt-expert", prompt=PROMPT, max_tokens=4)
            assert EXPERT_ERROR in refused.value.message
        with pytest.raises(openai.APIError, match="fails its checksum"):  # once the stream is open: its event
            for _ in client.completions.create(model="corrupt-expert", prompt=PROMPT, max_tokens=4, stream=True):
                pass
        assert client.models.list().data[0].id == "corrupt-expert"  # the server goes on answering
        status, _, raw = request(live, "GET", "/health", key=None)
        assert status == 503 and orjson.loads(raw) == {"status": "unhealthy"}  # its last step failed
    finally:
        live.close()


def test_nan_logits_end_the_request_with_an_error_not_a_sampling_crash(tiny_model_dir, tmp_path):
    """Intact checksums over a final norm of NaN: every row's logits are NaN. generate exits with one error line
    (sampled and greedy), the server answers 500 naming the cause and its health stays 200."""
    folder = nan_weights_model(tiny_model_dir, tmp_path / "nan-norm", "norm", np.s_[:])
    result = subprocess.run([sys.executable, "-m", "colibri_stream", "generate", "--model", str(folder), "--device",
                             "cpu", "--prompt", PROMPT, "--max-tokens", "4", "--temperature", "0.8"],
                            capture_output=True, text=True, timeout=300)
    assert_one_error_line(result, "request 0: the model's logits are not finite (NaN or infinity) for this sequence")
    live = LiveServer(folder, dict(max_batch_size=4, max_seq_len=256))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for temperature in (0.0, 0.8):
            with pytest.raises(openai.InternalServerError, match="not finite"):
                client.completions.create(model="nan-norm", prompt=PROMPT, max_tokens=4, temperature=temperature)
        assert request(live, "GET", "/health", key=None)[0] == 200
    finally:
        live.close()
