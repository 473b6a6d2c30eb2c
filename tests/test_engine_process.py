"""The engine's steps in a process of their own (`engine_process.py`): the server's engine runs elsewhere, a crash
of that process fails its requests and the health check (no hang), aborts and disconnects free its KV blocks,
loading errors arrive as they would in-process, and the process ends with its parent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from test_server import LiveServer, request

from colibri_stream.async_engine import AsyncEngine
from colibri_stream.errors import EngineStoppedError
from colibri_stream.request import SamplingParams
from colibri_stream.server.app import STATE

OPTIONS = dict(device="cpu", max_batch_size=4, max_seq_len=512)
LONG = 400  # tokens a stream asks for: it is still running when the test acts on it


def parent_pid_of(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def live(tiny_model_dir):
    server = LiveServer(tiny_model_dir, dict(max_batch_size=4, max_seq_len=512))
    yield server
    server.close()


def engine_of(live: LiveServer) -> AsyncEngine:
    return live.app[STATE].engine


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_servers_engine_runs_in_a_child_process(live):
    engine = engine_of(live)
    assert engine.pid != os.getpid() and parent_pid_of(engine.pid) == os.getpid()
    answer = client_of(live).completions.create(model="tiny-mixtral", prompt="The quick brown", max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 6 and answer.choices[0].text
    stats = engine.stats()  # the child's snapshot, sent with its steps
    assert stats.num_steps >= 6 and stats.num_generated_tokens >= 6 and stats.kv_blocks_used == 0
    status, _, raw = request(live, "GET", "/metrics", key=None)
    steps = [line for line in raw.decode().splitlines() if line.startswith("colibri_step_seconds_count")]
    assert status == 200 and steps and float(steps[0].split()[-1]) >= 6  # step records crossed the pipe


def test_the_engine_and_a_thread_give_the_same_tokens(tiny_model_dir):
    prompts = ["The quick brown fox", "Mixture of experts", "你好，世界"]

    async def tokens(engine: AsyncEngine) -> list[list[int]]:
        async with engine:
            outputs = []
            for prompt in prompts:
                ids = []
                async for out in engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True)):
                    ids += out.token_ids
                outputs.append(ids)
        await engine.close()
        return outputs

    in_process = asyncio.run(tokens(AsyncEngine.from_pretrained(str(tiny_model_dir), **OPTIONS)))
    spawned = asyncio.run(tokens(AsyncEngine.from_pretrained(str(tiny_model_dir), engine_process=True, **OPTIONS)))
    assert spawned == in_process and all(len(ids) == 12 for ids in spawned)


def test_a_killed_engine_process_fails_its_requests_and_the_health_check(live):
    engine = engine_of(live)

    async def stream_until_killed() -> tuple[list[str], str]:
        texts, error = [], ""
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny-mixtral", "prompt": "The quick", "max_tokens": LONG, "stream": True,
                    "ignore_eos": True}
            async with session.post(live.url + "/v1/completions", json=body) as response:
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        continue
                    texts.append(event["choices"][0]["text"])
                    if len(texts) == 3:
                        os.kill(engine.pid, signal.SIGKILL)
        return texts, error

    texts, error = live.call(asyncio.wait_for(stream_until_killed(), 30))
    assert 3 <= len(texts) < LONG  # it ended early, with an error event, instead of hanging
    assert "engine process ended unexpectedly (killed by SIGKILL)" in error, error
    status, _, raw = request(live, "GET", "/health", key=None)
    assert status == 503, raw
    status, _, raw = request(live, "POST", "/v1/completions", {"model": "tiny-mixtral", "prompt": "x",
                                                               "max_tokens": 2}, key=None)
    assert status == 503, raw


def test_aborts_and_disconnects_free_the_engine_processes_kv_blocks(live):
    engine = engine_of(live)

    async def aborted() -> tuple[int, int]:
        stream = engine.generate("The quick brown fox", SamplingParams(max_tokens=LONG, ignore_eos=True),
                                 request_id="to-abort")
        await stream.__anext__()
        held = engine.stats().kv_blocks_used
        await engine.abort("to-abort")  # returns once the child freed the blocks: the snapshot came with the ack
        freed = engine.stats().kv_blocks_used
        await stream.aclose()
        return held, freed

    held, freed = live.call(aborted())
    assert held > 0 and freed == 0

    async def disconnected() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny-mixtral", "prompt": "Hello", "max_tokens": LONG, "stream": True,
                    "ignore_eos": True}
            async with session.post(live.url + "/v1/completions", json=body) as response:
                await response.content.readline()
                await response.content.readline()
        # leaving the session closes the connection mid-stream

    live.call(disconnected())
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0)
    assert engine.stats().num_generated_tokens < 2 * LONG


def test_a_bad_model_folder_fails_as_it_does_in_process(tiny_model_dir, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["num_layers"] = "two"
    (folder / "config.json").write_text(json.dumps(config))
    errors = []
    for engine_process in (False, True):
        with pytest.raises(Exception) as caught:
            AsyncEngine.from_pretrained(str(folder), engine_process=engine_process, **OPTIONS)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1] and "num_layers" in errors[0][1], errors


def test_a_stopped_engine_refuses_requests_and_its_process_exits(tiny_model_dir):
    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), engine_process=True, **OPTIONS)

    async def body() -> None:
        await engine.start()
        await engine.stop()
        with pytest.raises(EngineStoppedError):
            await engine.generate("x", SamplingParams(max_tokens=2)).__anext__()
        await engine.start()  # a stopped engine starts again
        outputs = [out async for out in engine.generate("x", SamplingParams(max_tokens=2, ignore_eos=True))]
        assert sum(len(out.token_ids) for out in outputs) == 2
        await engine.close()

    pid = engine.pid
    asyncio.run(body())
    assert not pid_alive(pid)


@pytest.mark.parametrize("end, code", [("os.kill(os.getpid(), 9)", -signal.SIGKILL), ("sys.exit(3)", 3)])
def test_the_engine_process_ends_when_its_parent_dies_or_exits_without_closing_it(tiny_model_dir, end, code):
    script = ("import os, sys\n"
              "from colibri_stream.async_engine import AsyncEngine\n"
              "if __name__ == '__main__':\n"
              f"    engine = AsyncEngine.from_pretrained({str(tiny_model_dir)!r}, engine_process=True, device='cpu')\n"
              "    print(engine.pid, flush=True)\n"
              f"    {end}\n")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"orphan-{os.getpid()}.py"
    path.write_text(script)
    try:
        result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    finally:
        path.unlink()
    assert result.returncode == code, result.stderr[-2000:]
    child = int(result.stdout.split()[0])
    assert wait_until(lambda: not pid_alive(child), 30), f"the engine process {child} outlived its parent"


def test_a_step_report_crosses_the_pipe_whole():
    import pickle

    from colibri_stream.engine import EngineStats
    from colibri_stream.engine_loop import StepFailure, StepReport
    from colibri_stream.errors import EngineStepError, InvalidParameterError, PromptTooLongError
    from colibri_stream.request import RequestOutput

    first = RequestOutput("a", 0, " word", [12], False, None, None, 5, 1, logprobs=[(12, -0.5, [(12, -0.5)])],
                          time_to_first_token=0.02)
    outputs = [first, first.merge(RequestOutput("a", 0, "!", [3], True, "stop", 3, 5, 2,
                                                inter_token_latencies=[0.01]))]
    stats = EngineStats(*range(12), 0.5, 7)
    report = StepReport(outputs, stats, 4, acks=[3],
                        failed={"b": InvalidParameterError("bad top_k", "top_k"), "c": PromptTooLongError(9, 4, 10)},
                        step_failure=StepFailure({"d"}, EngineStepError("device lost")))
    received = pickle.loads(pickle.dumps(report))
    assert received.outputs == outputs and received.stats == stats and received.acks == [3]
    invalid, too_long = received.failed["b"], received.failed["c"]
    assert type(invalid) is InvalidParameterError and invalid.param == "top_k" and str(invalid) == "bad top_k"
    assert type(too_long) is PromptTooLongError and str(too_long) == str(PromptTooLongError(9, 4, 10))
    assert too_long.max_seq_len == 10
    assert received.step_failure.request_ids == {"d"} and str(received.step_failure.error) == "device lost"
