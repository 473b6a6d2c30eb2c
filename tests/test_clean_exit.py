"""Every thread the engine starts is joined before the interpreter shuts down, on every way out: the CLI and the
server run to their end many times and always exit 0; the offline `LLM` and the tiered expert store leave no
thread behind once closed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from colibri_stream.llm import LLM
from colibri_stream.request import SamplingParams

GENERATE_RUNS = 8
SERVER_CYCLES = 3
# Faulthandler prints the thread stacks of a crash; the model is the tiny Mixtral of conftest.
CHILD_ENV = dict(os.environ, PYTHONFAULTHANDLER="1")


def _generate(model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "colibri_stream.cli", "generate", "--model", str(model_dir),
               "--prompt", "The quick brown fox", "--max-tokens", "16", "--temperature", "0", "--json", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=CHILD_ENV)


def _colibri_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("colibri"))


def test_generate_exits_zero_every_time_back_to_back_and_concurrently(tiny_model_dir):
    with ThreadPoolExecutor(2) as pool:  # two processes at a time: each exit races the other's work
        results = list(pool.map(lambda _: _generate(tiny_model_dir), range(GENERATE_RUNS)))
    answers = {r.stdout for r in results}
    assert [r.returncode for r in results] == [0] * GENERATE_RUNS, [r.stderr[-2000:] for r in results]
    assert len(answers) == 1 and json.loads(answers.pop())["finish_reason"] in ("stop", "length")


def test_generate_through_the_tiered_store_exits_zero(tiny_model_dir):
    """With an L2 budget of two experts a layer, blocks are read by the tier's loader threads."""
    budget = 2 * _block_size(tiny_model_dir) * _moe_layers(tiny_model_dir)
    for _ in range(3):
        result = _generate(tiny_model_dir, "--l2-cache-size", str(budget), "--prefetch")
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["finish_reason"] in ("stop", "length")


def test_an_offline_llm_left_open_at_exit_exits_zero(tiny_model_dir):
    """A script that never closes its LLM (the finalizer closes it at exit), and one that raises while generating."""
    budget = 2 * _block_size(tiny_model_dir) * _moe_layers(tiny_model_dir)
    open_at_exit = ("from colibri_stream.llm import LLM\n"
                    f"llm = LLM({str(tiny_model_dir)!r}, l2_cache_size={budget}, prefetch=True)\n"
                    "print(llm.generate('hello').finish_reason)\n")
    raising = open_at_exit + "raise SystemExit(3)\n"
    for script, code in ((open_at_exit, 0), (raising, 3)):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                env=CHILD_ENV)
        assert result.returncode == code, result.stderr[-2000:]
        assert result.stdout.split() in (["stop"], ["length"])


def test_closing_an_llm_joins_the_tiered_stores_threads(tiny_model_dir):
    budget = 2 * _block_size(tiny_model_dir) * _moe_layers(tiny_model_dir)
    before = _colibri_threads()
    with LLM(str(tiny_model_dir), l2_cache_size=budget, prefetch=True) as llm:
        llm.generate("hello", SamplingParams(max_tokens=8, temperature=0.0))
        assert any(name.startswith("colibri-expert-io") for name in _colibri_threads())
    assert _colibri_threads() == before
    llm.close()  # a second close does nothing


def test_closing_a_collected_llm_joins_its_threads(tiny_model_dir):
    budget = 2 * _block_size(tiny_model_dir) * _moe_layers(tiny_model_dir)
    before = _colibri_threads()
    llm = LLM(str(tiny_model_dir), l2_cache_size=budget, prefetch=True)
    llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0))
    del llm
    import gc

    gc.collect()
    assert _colibri_threads() == before


def _default_sigint() -> None:
    """In the child before exec: SIGINT's default action, as a terminal's foreground process has it (a test run
    started as a background job of a non-interactive shell inherits SIGINT ignored, and Python keeps it so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_generate_exits_130_without_a_crash(tiny_model_dir):
    command = [sys.executable, "-m", "colibri_stream.cli", "generate", "--model", str(tiny_model_dir),
               "--prompt", "The quick brown fox", "--max-tokens", "2000", "--ignore-eos", "--temperature", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CHILD_ENV,
                               preexec_fn=_default_sigint)
    first = process.stdout.read(1)  # the first piece of text: the model is loaded and generating
    assert first and process.poll() is None
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    # 130 comes from the CLI's own KeyboardInterrupt handler: the signal came while it generated
    assert process.returncode == 130, err.decode()[-2000:]


@pytest.mark.slow
def test_server_start_and_sigterm_cycles_exit_zero(tiny_model_dir):
    for _ in range(SERVER_CYCLES):
        port = _free_port()
        process = subprocess.Popen([sys.executable, "-m", "colibri_stream.cli", "serve", "--model",
                                    str(tiny_model_dir), "--port", str(port), "--max-seq-len", "256"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CHILD_ENV)
        try:
            _wait_healthy(port, process)
            body = json.dumps({"prompt": "The quick", "max_tokens": 8, "temperature": 0}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                assert json.load(response)["choices"][0]["finish_reason"] in ("stop", "length")
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 0, err.decode()[-2000:]


def _wait_healthy(port: int, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read().decode()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block_size(model_dir: Path) -> int:
    from colibri_stream.checkpoint import ModelFolder

    return ModelFolder(str(model_dir)).experts.block_size


def _moe_layers(model_dir: Path) -> int:
    return len(json.loads((model_dir / "config.json").read_text())["moe_layers"])

