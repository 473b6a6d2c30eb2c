"""What real clients and hostile inputs broke, each on the real server (or the real CLI): tool_choice "auto" for a
model whose template teaches no tool-call syntax, and the shipped model's template that teaches one (an agent's two
turns); a Responses stream cut by max_output_tokens, which ends with response.incomplete as OpenAI's does; vLLM's
GET /tokenizer_info, which lm-evaluation-harness's tokenizer detection reads; config.json sizes past any model
(one `error:` line, no table allocated from them); template variables named as the renderer's own; request heads
sent slowly; the exit code of a drain that timed out; error bodies that named internal exception classes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import CHATML_TEMPLATE, model_with_template
from test_server import API_KEY, LiveServer, request, sse_events

from colibri_stream.checkpoint import default_model_path
from colibri_stream.errors import CheckpointError
from colibri_stream.server.state import STATE
from colibri_stream.server.tool_syntax import HermesToolSyntax, tool_syntax_of
from colibri_stream.tokenizer import Tokenizer

pytest.importorskip("llguidance")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHILD_ENV = dict(os.environ, PYTHONFAULTHANDLER="1")


def regex(text: str) -> dict:
    """extra_body that makes the model write exactly `text`."""
    escaped = "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def default_server():
    """The shipped model, as `colibri serve` serves it with no model folder."""
    live = LiveServer(default_model_path(), dict(max_batch_size=4, max_seq_len=1024), api_key=API_KEY,
                      served_model_name="default")
    yield live
    live.close()


# ------------------------------------------------------------------- tool_choice "auto" and the shipped template

def test_the_shipped_model_takes_tools_without_a_tool_choice(default_server):
    """What LangChain's bind_tools and openai-agents send: tools and no tool_choice. A 200, text or calls."""
    client = client_of(default_server)
    for stream in (False, True):
        answer = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=24,
                                                temperature=0, stream=stream)
        if stream:
            chunks = list(answer)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
        else:
            choice = answer.choices[0]
            assert choice.finish_reason in ("stop", "length", "tool_calls")
            assert isinstance(choice.message.content, str) or choice.message.tool_calls
    response = client.responses.create(model="default", input="Weather in Paris?", max_output_tokens=16,
                                       tools=[{"type": "function", "name": "weather", "parameters": WEATHER}])
    assert response.status in ("completed", "incomplete")


def test_an_agent_loop_of_two_turns_on_the_shipped_model(default_server):
    """Turn one: the model (steered by a regex) writes a call in the syntax its template teaches; it comes back as
    tool_calls. Turn two, as openai-agents sends it (no tool_choice): the call and its result go back, the template
    shows them as it teaches, and the model answers."""
    client = client_of(default_server)
    assert isinstance(tool_syntax_of(Tokenizer.from_folder(default_model_path()).chat_templates), HermesToolSyntax)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=64,
                                           temperature=0, extra_body=regex(call))
    assert first.choices[0].finish_reason == "tool_calls"
    (made,) = first.choices[0].message.tool_calls
    assert made.function.name == "weather" and json.loads(made.function.arguments) == {"city": "Paris"}
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": made.id, "content": "Sunny, 24 C"}]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS, max_tokens=16,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    status, _, raw = request(default_server, "POST", "/tokenize", {"messages": history, "tools": TOOLS})
    assert status == 200, raw
    tokens = json.loads(raw)["tokens"]
    assert len(tokens) == second.usage.prompt_tokens
    status, _, raw = request(default_server, "POST", "/detokenize", {"tokens": tokens})
    prompt = json.loads(raw)["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt
    forced = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=64,
                                            temperature=0, tool_choice="required")
    assert forced.choices[0].finish_reason in ("tool_calls", "length")  # forced, under the tools' grammar


def test_the_shipped_template_renders_plain_chats_as_the_model_was_trained():
    """Without tools, the prompt is the ChatML the model was trained on (docs/DEFAULT_MODEL.md), byte for byte."""
    tokenizer = Tokenizer.from_folder(default_model_path())
    trained = Tokenizer.from_folder(default_model_path())
    trained.chat_templates = {"default": ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + "
                                          "'\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
                                          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                                          "{%- endif %}")}
    chats = [[{"role": "user", "content": "What does len() return?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again, ünïcødé 🙂\n"}],
             [{"role": "user", "content": ""}, {"role": "assistant", "content": "", "tool_calls": []}],
             [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}]]
    for chat in chats:
        for add in (True, False):
            assert tokenizer.apply_chat_template(chat, add) == trained.apply_chat_template(chat, add)


@pytest.fixture(scope="module")
def shown_tools_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with a template that lists the tools by name but teaches no way to call them."""
    template = "{% if tools %}Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}\n{% endif %}" \
               + CHATML_TEMPLATE
    folder = model_with_template(tiny_model_dir, tmp_path_factory.mktemp("shown") / "model", template)
    live = LiveServer(folder, dict(max_batch_size=4, max_seq_len=512), api_key=API_KEY, served_model_name="tiny")
    yield live
    live.close()
    shutil.rmtree(folder)


def test_auto_without_a_syntax_answers_in_text_with_the_tools_shown(shown_tools_server):
    """As OpenAI answers "auto": accepted, the tools reach the template, the reply is text (even one that looks like
    a call: no syntax is read), streamed or not, in chat and Responses; "required" still forces a call."""
    client = client_of(shown_tools_server)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for choice in (None, "auto"):
        fields = {"tool_choice": choice} if choice else {}
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body=regex(call), **fields)
        assert answer.choices[0].message.content == call and answer.choices[0].message.tool_calls is None
        assert answer.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80,
                                                     temperature=0, stream=True, extra_body=regex(call), **fields))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == call
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    shown = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    hidden = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    assert shown.usage.prompt_tokens > hidden.usage.prompt_tokens  # the template listed the tool
    response = client.responses.create(model="tiny", input="Weather?", max_output_tokens=80, extra_body=regex(call),
                                       tools=[{"type": "function", "name": "weather", "parameters": WEATHER}])
    assert [item.type for item in response.output] == ["message"] and response.output_text == call
    forced = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200,
                                            temperature=0, tool_choice="required")
    assert forced.choices[0].finish_reason in ("tool_calls", "length")
    if forced.choices[0].finish_reason == "tool_calls":
        assert "city" in json.loads(forced.choices[0].message.tool_calls[0].function.arguments)


# ------------------------------------------------------------------------------- Responses: response.incomplete

def test_a_responses_stream_cut_by_max_output_tokens_ends_with_response_incomplete(tiny_server):
    body = {"model": "tiny", "input": "Tell me about experts", "max_output_tokens": 6, "temperature": 0,
            "stream": True, "ignore_eos": True}
    status, _, raw = request(tiny_server, "POST", "/v1/responses", body)
    assert status == 200
    events = [event for event in sse_events(raw) if event != "[DONE]"]
    kinds = [event["type"] for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "response.completed" not in kinds and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert (final["status"], final["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert final["usage"]["output_tokens"] == 6 and events[-2]["item"]["status"] == "incomplete"

    client = client_of(tiny_server)
    with client.responses.stream(model="tiny", input="Tell me about experts", max_output_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        seen = list(stream)
    text = "".join(event.delta for event in seen if event.type == "response.output_text.delta")
    assert seen[-1].type == "response.incomplete" and seen[-1].response.status == "incomplete"
    assert seen[-1].response.incomplete_details.reason == "max_output_tokens"
    assert seen[-1].response.output_text == text and text
    with client.responses.stream(model="tiny", input="hi", max_output_tokens=64, temperature=0,
                                 extra_body={"stop": [" ", "e", "a", "\n"]}) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        done = stream.get_final_response()  # a reply that ended by itself: response.completed
    assert done.status == "completed" and done.output_text == deltas


# ------------------------------------------------------------------------------------------ GET /tokenizer_info

def test_tokenizer_info_as_vllm_serves_it_for_lm_eval(default_server):
    status, _, raw = request(default_server, "GET", "/tokenizer_info")
    assert status == 200, raw
    info = json.loads(raw)
    config = json.loads((default_model_path() / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["chat_template"] == config["chat_template"]
    assert (info["eos_token"], info["pad_token"], info["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert info["model_max_length"] == 1024 and info["added_tokens_decoder"]["2"] == "<|im_end|>"
    assert request(default_server, "GET", "/tokenizer_info", key=None)[0] == 401  # behind the key, as /tokenize
    # lm-evaluation-harness's check_remote_tokenizer_support: eos_token in the info, then a tokenize of "test";
    # its RemoteTokenizer's eos_token_id is the first id of its eos_token's text
    status, _, raw = request(default_server, "POST", "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert status == 200 and json.loads(raw)["tokens"]
    status, _, raw = request(default_server, "POST", "/tokenize", {"prompt": info["eos_token"],
                                                                   "add_special_tokens": False})
    assert json.loads(raw)["tokens"] == [2]


# ------------------------------------------------------------------------------------ config bounds, one error line

def colibri(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_stream.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=CHILD_ENV)


def model_with_config(folder: Path, **changes) -> Path:
    """`folder` holding the shipped model's files (linked) with `changes` made to its config.json."""
    folder.mkdir()
    for path in default_model_path().iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((default_model_path() / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


YARN_OF_2_40 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2**40}


@pytest.mark.parametrize("changes", [{"max_position_embeddings": 2**40}, {"vocab_size": 2**40},
                                     {"num_layers": 2**31}, {"head_dim": 2**20}, {"rope": YARN_OF_2_40}])
def test_absurd_config_sizes_are_one_error_line(tmp_path, changes):
    folder = model_with_config(tmp_path / "model", **changes)
    for command in (["inspect", str(folder), "--verify"],
                    ["generate", "--model", str(folder), "--prompt", "def f", "--max-tokens", "1", "--device", "cpu"]):
        result = colibri(*command)
        assert result.returncode == 1, (command, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: config.json: "), result.stderr[-2000:]
        assert "beyond any model" in lines[0] or "at most" in lines[0]


def test_rotary_tables_are_sized_by_the_longest_sequence_served(tmp_path):
    """A model of 16 M positions (the bound) served with max_seq_len 256 holds tables of 256 positions, not GiBs."""
    folder = model_with_config(tmp_path / "model", max_position_embeddings=1 << 24)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=256, engine_process=False), api_key=API_KEY)
    try:
        model = live.app[STATE].engine._core.runner.model
        assert model.rope_cos.shape[0] == model.max_positions == 256
        answer = client_of(live).completions.create(model=live.app[STATE].model_name, prompt="def f", max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length")
    finally:
        live.close()


# ------------------------------------------------------------------------- template variables, the renderer's own

@pytest.mark.parametrize("key", ["self", "source", "messages", "tools", "documents"])
def test_template_variables_named_as_the_renderers_own_are_a_400(tiny_server, key):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 1, "chat_template_kwargs": {key: 1}}
    for path, fields in (("/v1/chat/completions", body), ("/tokenize", {"messages": ASK,
                                                                         "chat_template_kwargs": {key: 1}})):
        status, _, raw = request(tiny_server, "POST", path, fields)
        assert status == 400, (path, raw)
        assert json.loads(raw)["error"]["param"] == "chat_template_kwargs"
    status, _, raw = request(tiny_server, "POST", "/v1/chat/completions",
                             dict(body, chat_template_kwargs={"enable_thinking": False}))
    assert status == 200, raw


# ----------------------------------------------------------------------------------- request heads sent slowly

HEAD_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def head_timeout_server(tiny_model_dir):
    live = LiveServer(tiny_model_dir, dict(max_batch_size=2, max_seq_len=2048), api_key=API_KEY,
                      serve_options={"request_head_timeout": HEAD_TIMEOUT})
    yield live
    live.close()


def connect(live: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=10)
    sock.settimeout(10)
    return sock


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (reading whatever it sends first)."""
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


def test_a_request_head_sent_slowly_is_cut_off(head_timeout_server):
    """Slowloris: a head sent one byte every 50 ms never completes; the server closes the connection within two
    timeouts (and another connection is answered meanwhile). A connection that sends nothing is closed too."""
    slow, idle = connect(head_timeout_server), connect(head_timeout_server)
    head = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n")
    start = time.monotonic()
    slow.setblocking(False)
    sent, closed = 0, False
    while time.monotonic() - start < 4 * HEAD_TIMEOUT and sent < len(head) - 4:
        try:
            slow.send(head[sent:sent + 1])
            sent += 1
            if slow.recv(1) == b"":
                closed = True
                break
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    assert closed and elapsed < 2 * HEAD_TIMEOUT + 1.0, (closed, elapsed, sent)
    assert sent < len(head) - 4  # the head never arrived whole
    assert closed_after(idle) < 2 * HEAD_TIMEOUT + 1.0
    prompt = connect(head_timeout_server)
    prompt.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert prompt.recv(65536).startswith(b"HTTP/1.1 200")
    prompt.close()
    answer = client_of(head_timeout_server).completions.create(model=head_timeout_server.app[STATE].model_name,
                                                               prompt="The quick", max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_stream_longer_than_the_head_timeout_is_not_cut(head_timeout_server):
    """The timeout is the head's: an answer that streams for several timeouts goes out whole; the connection is
    closed once it has then waited a timeout for another request."""
    body = {"model": head_timeout_server.app[STATE].model_name, "prompt": "The quick", "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    sock = connect(head_timeout_server)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    start = time.monotonic()
    while b"data: [DONE]" not in received:
        piece = sock.recv(65536)
        assert piece, "the connection closed while its answer streamed"
        received += piece
    assert time.monotonic() - start > 2 * HEAD_TIMEOUT  # (the stream outlasted the timeout)
    assert b'"finish_reason":"length"' in received  # all 2000 tokens went out
    assert closed_after(sock) < 2 * HEAD_TIMEOUT + 1.0
    sock.close()


# --------------------------------------------------------------------------- the exit code after a drain timeout

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


def test_serve_exits_non_zero_when_its_drain_timed_out_and_aborted_requests(tiny_model_dir):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "colibri_stream.cli", "serve", "--model", str(tiny_model_dir),
                                "--port", str(port), "--max-seq-len", "2048", "--drain-timeout", "0.5"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CHILD_ENV)
    try:
        wait_healthy(port, process)
        body = json.dumps({"prompt": "The quick", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                               {"Content-Type": "application/json"}), timeout=60)
        assert stream.readline().startswith(b"data: ")  # generating
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        stream.close()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, err.decode()[-2000:]
    assert "error: stopped with 1 request aborted: the drain timeout (0.5 s) passed" in err.decode()
    assert "Traceback" not in err.decode()


# ------------------------------------------------------------------------------- no class names in error bodies

@pytest.fixture
def in_process_server(tiny_model_dir):
    """tiny_server's configuration with the engine's steps on a thread of this process, whose model a test can
    reach (`engine._core`)."""
    live = LiveServer(tiny_model_dir, dict(max_batch_size=4, max_seq_len=256, engine_process=False),
                      api_key=API_KEY, served_model_name="tiny")
    yield live
    live.close()


def test_a_failed_step_says_what_failed_without_internal_class_names(in_process_server):
    tiny_server = in_process_server
    engine = tiny_server.app[STATE].engine
    execute = engine._core.runner.execute

    def corrupt(step):
        raise CheckpointError("experts.bin: block 3 of layer 1 does not match its checksum")

    engine._core.runner.execute = corrupt
    try:
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4}
        status, _, raw = request(tiny_server, "POST", "/v1/completions", body)
        message = json.loads(raw)["error"]["message"]
        assert status == 500 and "block 3 of layer 1 does not match its checksum" in message, raw
        assert "CheckpointError" not in message and "('" not in message
        status, _, raw = request(tiny_server, "POST", "/v1/completions", dict(body, stream=True))
        error = next(event for event in sse_events(raw) if isinstance(event, dict) and "error" in event)["error"]
        assert "block 3 of layer 1" in error["message"] and "CheckpointError" not in error["message"]
    finally:
        engine._core.runner.execute = execute
    for _ in range(100):  # the next step succeeds: healthy again
        status, _, raw = request(tiny_server, "POST", "/v1/completions", {"model": "tiny", "prompt": "x",
                                                                          "max_tokens": 2})
        if status == 200:
            break
    assert status == 200, raw
