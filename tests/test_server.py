"""The HTTP server end to end: the real server on a loopback port with the tiny exported model, driven by the
official openai client (sync and async, streamed and not) and by raw aiohttp requests."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from colibri_stream.async_engine import AsyncEngine
from colibri_stream.request import SamplingParams
from colibri_stream.server import create_app, serve
from colibri_stream.server.state import STATE

API_KEY = "test-key"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROMPTS = [f"Request {i}: the quick brown fox {'jumps ' * (i % 5)}over dog {i * 7}" for i in range(64)]


class LiveServer:
    """A real server on 127.0.0.1:<free port>, its event loop running in a thread of its own; its engine's steps
    in an engine process, as `colibri serve` runs them (engine_options engine_process=False: on a thread)."""

    def __init__(self, model_dir: Path, engine_options: dict, *, serve_options: dict | None = None,
                 **app_options: Any):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self.app, self._runner, port = self.call(self._start(model_dir, engine_options, app_options,
                                                             serve_options or {}))
        self.url = f"http://127.0.0.1:{port}"
        self.model_dir = model_dir

    @staticmethod
    async def _start(model_dir: Path, engine_options: dict, app_options: dict, serve_options: dict) -> tuple:
        engine = AsyncEngine.from_pretrained(str(model_dir), **{"device": "cpu", "engine_process": True,
                                                                **engine_options})
        app = create_app(engine, **app_options)
        return (app, *await serve(app, "127.0.0.1", 0, **serve_options))

    def call(self, coro: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def server(emoji_model_dir):
    """The main server (a tokenizer with whole emoji): a key, CORS for one origin, 64 KiB bodies, a batch of 64."""
    live = LiveServer(emoji_model_dir, dict(max_batch_size=64, max_seq_len=1024), api_key=API_KEY,
                      cors_origins=["http://app.example"], max_body_bytes=64 << 10)
    yield live
    live.close()


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    """One sequence at a time, 8-token prefill chunks, one waiting request at most, keep-alives every 10 ms."""
    live = LiveServer(tiny_model_dir, dict(max_batch_size=1, max_num_batched_tokens=8, max_queue=1,
                                           max_seq_len=2048), keepalive_interval=0.01)
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def request(server: LiveServer, method: str, path: str, body: Any = None, *, data: bytes | None = None,
            headers: dict | None = None, key: str | None = API_KEY) -> tuple[int, Any, bytes]:
    """A raw aiohttp request; returns status, headers and body."""
    async def go() -> tuple[int, Any, bytes]:
        all_headers = {"Authorization": f"Bearer {key}"} if key else {}
        all_headers.update(headers or {})
        payload = orjson.dumps(body) if body is not None else data
        async with aiohttp.ClientSession() as session:
            async with session.request(method, server.url + path, data=payload, headers=all_headers) as response:
                return response.status, response.headers, await response.read()

    return asyncio.run(go())


def post(server: LiveServer, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    status, _, raw = request(server, "POST", path, body, **kwargs)
    return status, orjson.loads(raw)


def sse_events(raw: bytes) -> list[Any]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line, or, where the stream names
    its events (Responses, Messages), `event: <its type>` then `data: ...`; comments are skipped."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw[:-2].split(b"\n\n"):
        if block.startswith(b":"):
            continue
        name = None
        if block.startswith(b"event: "):
            head, block = block.split(b"\n", 1)
            name = head[len(b"event: "):].decode()
        assert block.startswith(b"data: ") and b"\n" not in block, block
        data = block[len(b"data: "):]
        event = "[DONE]" if data == b"[DONE]" else orjson.loads(data)
        assert name is None or (event != "[DONE]" and event["type"] == name), (name, event)
        events.append(event)
    return events


def metric(server: LiveServer, name: str) -> float:
    status, _, raw = request(server, "GET", "/metrics", key=None)
    assert status == 200
    match = re.search(rb"^" + re.escape(name.encode()) + rb" ([0-9.e+-]+)$", raw, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def requests_counted(server: LiveServer, route: str, status: int) -> float:
    """colibri_requests_total of one route and status (0 before the first)."""
    name = f'colibri_requests_total{{route="{route}",status="{status}"}}'
    return metric(server, name) if name.encode() in request(server, "GET", "/metrics", key=None)[2] else 0.0


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


GREEDY = dict(temperature=0, max_tokens=8)


# ------------------------------------------------------------------------------------------------ simple routes

def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-mixtral"]
    assert models.data[0].object == "model"
    assert client.models.retrieve("tiny-mixtral").id == "tiny-mixtral"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, _, raw = request(server, "GET", "/health", key=None)
    assert (status, orjson.loads(raw)) == (200, {"status": "ok"})
    assert request(server, "HEAD", "/health", key=None)[0] == 200
    status, headers, raw = request(server, "GET", "/metrics", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("colibri_requests_total", "colibri_prompt_tokens_total", "colibri_generation_tokens_total",
                 "colibri_time_to_first_token_seconds_bucket", "colibri_inter_token_latency_seconds_bucket",
                 "colibri_num_requests_waiting", "colibri_num_requests_running", "colibri_kv_blocks_used",
                 "colibri_kv_blocks_free", "colibri_last_step_seconds", "colibri_event_loop_lag_seconds_bucket",
                 "colibri_engine_steps_launched_ahead_total"):
        assert name.encode() in raw, name


# ------------------------------------------------------------------------------------- chat and text completions

def test_every_answer_names_its_request(server, client):
    """X-Request-Id on answers and refusals: the client's own when it is plain, a new one per request otherwise."""
    model = client.models.list().data[0].id
    first = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=1)
    second = client.models.with_raw_response.list()
    assert first.request_id and second.request_id and first.request_id != second.request_id
    for given, echoed in (("trace-42.a:b_c", True), ("bad id\u00e9", False), ("x" * 129, False)):
        status, headers, _ = request(server, "GET", "/v1/models", headers={"X-Request-Id": given})
        assert status == 200 and (headers["X-Request-Id"] == given) == echoed and headers["X-Request-Id"]
    status, headers, _ = request(server, "POST", "/v1/completions", {"prompt": 5}, headers={"X-Request-Id": "r1"})
    assert status == 400 and headers["X-Request-Id"] == "r1"


def test_chat_non_streaming(client):
    reply = client.chat.completions.create(model="tiny-mixtral", messages=chat("Hello there"), **GREEDY)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == "tiny-mixtral" and isinstance(reply.created, int)
    [choice] = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_equals_non_streaming(client):
    messages = chat("Tell me about experts")
    whole = client.chat.completions.create(model="tiny-mixtral", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny-mixtral", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # the same counts, except that the second request took the first's prompt blocks from the prefix cache
    assert chunks[-1].choices == [] and (chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"})
                                         == whole.usage.model_dump(exclude={"prompt_tokens_details"}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > whole.usage.prompt_tokens_details.cached_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    counted = list(client.chat.completions.create(model="tiny-mixtral", messages=messages, stream=True,
                                                  stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True}, **GREEDY))
    so_far = [c.usage.completion_tokens for c in counted]  # vLLM's continuous_usage_stats: the usage in every chunk
    assert so_far == sorted(so_far) and so_far[-1] == whole.usage.completion_tokens
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in counted)


def test_chat_content_parts_and_roles(client):
    plain = client.chat.completions.create(
        model="tiny-mixtral", messages=[{"role": "system", "content": "Be brief.\nReally."},
                                        {"role": "user", "content": "Hi"}], **GREEDY)
    parts = client.chat.completions.create(
        model="tiny-mixtral", messages=[{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                                          {"type": "text", "text": "Really."}]},
                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        response_format={"type": "text"}, user="someone", **GREEDY)
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_completions_sync_and_async_all_prompt_forms(server, client):
    text = "The quick brown fox"
    whole = client.completions.create(model="tiny-mixtral", prompt=text, **GREEDY)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    token_ids = _tokenizer(server).encode(text)

    async def forms() -> list:
        async with async_client(server) as aclient:
            results = [await aclient.completions.create(model="tiny-mixtral", prompt=p, **GREEDY)
                       for p in ([text], token_ids, [token_ids])]
            stream = await aclient.completions.create(model="tiny-mixtral", prompt=text, stream=True, **GREEDY)
            chunks = [c async for c in stream]
        return results, chunks

    results, chunks = asyncio.run(forms())
    assert [r.choices[0].text for r in results] == [whole.choices[0].text] * 3
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def _tokenizer(server: LiveServer):
    return server.app[STATE].engine.tokenizer


def engine_token_ids(server: LiveServer, prompt: str, **params: Any) -> list[int]:
    """The token ids the server's engine generates for `prompt`, asked directly (no HTTP)."""
    async def go() -> list[int]:
        ids = []
        async for out in server.app[STATE].engine.generate(prompt, SamplingParams(**params)):
            ids += out.token_ids
        return ids

    return server.call(go())


def test_max_tokens_forms(client):
    default = client.completions.create(model="tiny-mixtral", prompt="Hi", temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the completions default
    unlimited = client.chat.completions.create(model="tiny-mixtral", messages=chat("Hi"), temperature=0,
                                               max_tokens=None, extra_body={"ignore_eos": True})
    assert unlimited.choices[0].finish_reason == "length"
    assert unlimited.usage.total_tokens == 1024  # up to the context
    unlimited = client.completions.create(model="tiny-mixtral", prompt="Hi", temperature=0, max_tokens=None,
                                          extra_body={"ignore_eos": True})
    assert unlimited.choices[0].finish_reason == "length" and unlimited.usage.total_tokens == 1024
    both = client.chat.completions.create(model="tiny-mixtral", messages=chat("Hi"), temperature=0, max_tokens=9,
                                          max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 3


def test_stop_string_split_across_tokens(client):
    options = dict(model="tiny-mixtral", prompt="Streaming tokens", temperature=1.0, seed=0, max_tokens=24,
                   extra_body={"ignore_eos": True})
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **options)]
    text = "".join(deltas)
    # The last character of one delta and the first of the next: a stop string that spans two tokens.
    ends = [len("".join(deltas[:i])) for i in range(1, len(deltas)) if deltas[i - 1] and deltas[i]]
    stop = next(text[b - 1:b + 1] for b in ends if text.find(text[b - 1:b + 1]) == b - 1
                and "\ufffd" not in text[b - 1:b + 1])
    expected = text[:text.find(stop)]
    stopped = client.completions.create(stop=[stop, "never appears"], **options)
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **options))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(server, client):
    ids = engine_token_ids(server, "Hello", max_tokens=8, temperature=0, ignore_eos=True)
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token the output first makes there
    stopped = client.completions.create(model="tiny-mixtral", prompt="Hello", temperature=0, max_tokens=8,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [ids[at]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == at + 1
    assert stopped.choices[0].model_extra["stop_reason"] == ids[at]


def test_seeds_reproduce(client):
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = client.completions.create(model="tiny-mixtral", prompt="Once upon a time", temperature=1.0,
                                          max_tokens=12, seed=seed, n=n, extra_body={"ignore_eos": True})
        return [c.text for c in reply.choices]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7, n=3) == sample(7, n=3)


def test_n_choices(server, client):
    reply = client.chat.completions.create(model="tiny-mixtral", messages=chat("Pick"), n=3, temperature=1.0,
                                           seed=1, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 18
    assert len({c.message.content for c in reply.choices}) > 1
    chunks = list(client.chat.completions.create(model="tiny-mixtral", messages=chat("Pick"), n=3,
                                                 temperature=1.0, seed=1, max_tokens=6, stream=True,
                                                 extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(3)}
    roles = set()
    for chunk in chunks:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.add(choice.index)
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in reply.choices]


def test_sampling_parameters(client):
    def complete(**options: Any) -> str:
        reply = client.completions.create(model="tiny-mixtral", prompt="Parameters", max_tokens=8,
                                          **{"extra_body": {"ignore_eos": True}, **options})
        return reply.choices[0].text

    greedy = complete(temperature=0)
    assert complete(temperature=1.0, seed=3, extra_body={"top_k": 1, "ignore_eos": True}) == greedy
    assert complete(temperature=1.0, seed=3, top_p=1e-6) == greedy
    assert complete(temperature=1.0, seed=3, top_p=0) == greedy  # OpenAI takes 0: the most likely token alone
    assert complete(temperature=1.0, seed=3, extra_body={"min_p": 1.0, "ignore_eos": True}) == greedy
    # The penalties are accepted and change what a greedy decode repeats.
    penalised = [complete(temperature=0, presence_penalty=2.0), complete(temperature=0, frequency_penalty=2.0),
                 complete(temperature=0, extra_body={"repetition_penalty": 3.0, "ignore_eos": True})]
    assert any(text != greedy for text in penalised)


def test_chat_logprobs(client):
    options = dict(model="tiny-mixtral", messages=chat("Logprobs"), temperature=0, max_tokens=6, logprobs=True,
                   top_logprobs=3, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**options)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the best
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    streamed = [e for c in client.chat.completions.create(stream=True, **options)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The second request takes the first's prompt blocks from the prefix cache and computes only the rest: OpenBLAS
    # rounds a matrix product's rows differently with the row count, so logprobs agree to float32 rounding only.
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-5)
    plain = client.chat.completions.create(**{**options, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client):
    reply = client.completions.create(model="tiny-mixtral", prompt="Offsets", temperature=0, max_tokens=6,
                                      logprobs=2, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(lp)


# ------------------------------------------------------------------------------------------------------- errors

def _error(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS = [
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": 101}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": -0.5}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "x", "n": True}, "n"),
    (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "user": 5}, "user"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "x", "suffix": "end"}, "suffix"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"prompt": [1, 100000]}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", [3]]}, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, "prompt"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    (CHAT, {"max_tokens": 3}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    (CHAT, {"messages": chat("hi"), "tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    (CHAT, {"messages": chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"messages": chat("hi"), "tool_choice": "required"}, "tools"),
    (CHAT, {"messages": chat("hi"), "response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"messages": chat("hi"), "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    (CHAT, {"messages": chat("hi"), "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    (CHAT, {"messages": chat("hi"), "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"messages": chat("hi"), "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name"),
    (CHAT, {"messages": chat("hi"), "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": chat("hi"), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": chat("hi"), "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_bad_fields_are_400_naming_the_field(server, path, body, param):
    status, reply = post(server, path, body)
    assert status == 400, reply
    assert _error(reply)["param"] == param and _error(reply)["type"] == "invalid_request_error"


@pytest.mark.parametrize("data", [b"", b"{not json", b"[1, 2]", b'"text"'])
def test_body_not_a_json_object_is_400(server, data):
    status, _, raw = request(server, "POST", COMPLETIONS, data=data, headers={"Content-Type": "application/json"})
    assert status == 400 and _error(orjson.loads(raw))["message"]


def test_unknown_fields_are_ignored(server):
    status, reply = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2, "made_up": {"a": 1},
                                               "metadata": {"k": "v"}, "service_tier": "auto"})
    assert status == 200 and reply["object"] == "text_completion"


def test_api_key(server, client):
    for key in (None, "wrong"):
        status, _, raw = request(server, "GET", "/v1/models", key=key)
        assert status == 401 and _error(orjson.loads(raw))["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny-mixtral", messages=chat("hi"), max_tokens=2)
    assert request(server, "GET", "/health", key=None)[0] == 200  # probes need no key


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"), max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_400_with_the_numbers(server, client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-mixtral", prompt="Hello there", max_tokens=2000, stream=stream)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "2000" in error["message"] and "1024" in error["message"]
    status, headers, raw = request(server, "POST", CHAT, {"messages": chat("x " * 1200), "stream": True})
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert _error(orjson.loads(raw))["param"] == "messages"


def test_body_over_the_limit_is_413(server):
    status, reply = post(server, COMPLETIONS, {"prompt": "x" * (70 << 10)})
    assert status == 413 and _error(reply)["code"] == "request_too_large"


def test_unknown_route_and_wrong_method(server):
    """... counted by /metrics: a 405 under the route it was sent to, a 404 as unmatched."""
    before = requests_counted(server, COMPLETIONS, 405), requests_counted(server, "unmatched", 404)
    status, _, raw = request(server, "GET", "/v1/nothing")
    assert status == 404 and _error(orjson.loads(raw))
    status, headers, raw = request(server, "GET", COMPLETIONS)
    assert status == 405 and headers["Allow"] == "POST" and _error(orjson.loads(raw))
    after = requests_counted(server, COMPLETIONS, 405), requests_counted(server, "unmatched", 404)
    assert after == (before[0] + 1, before[1] + 1)
    status, _, raw = request(server, "DELETE", "/health", key=None)
    assert status == 405 and _error(orjson.loads(raw))


def test_cors(server):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = request(server, "OPTIONS", CHAT, headers=preflight, key=None)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, headers, _ = request(server, "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 1, "stream": True},
                                 headers={"Origin": "http://app.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://app.example"
    status, headers, _ = request(server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


# ------------------------------------------------------------------------------------------ streams under load

def test_64_concurrent_streams_each_equal_their_single_request_output(server, client):
    singles = [client.completions.create(model="tiny-mixtral", prompt=p, **GREEDY).choices[0].text
               for p in PROMPTS]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await aclient.completions.create(model="tiny-mixtral", prompt=prompt, stream=True, **GREEDY)
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def all_at_once() -> list:
        async with async_client(server) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    results = asyncio.run(all_at_once())
    assert [text for text, _ in results] == singles
    assert all(reason in ("stop", "length") for _, reason in results)


def test_client_disconnect_aborts_and_frees_blocks(server):
    idle_free = metric(server, "colibri_kv_blocks_free")
    generated_before = metric(server, "colibri_engine_generated_tokens_total")

    async def read_a_little_then_leave() -> None:
        body = {"prompt": "A long answer", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            response = await session.post(server.url + COMPLETIONS, json=body)
            assert response.status == 200
            data_events = 0
            async for line in response.content:
                data_events += line.startswith(b"data: ")
                if data_events == 3:
                    break
            assert await asyncio.to_thread(metric, server, "colibri_kv_blocks_free") < idle_free
            response.close()  # drop the connection mid-stream

    asyncio.run(read_a_little_then_leave())
    deadline = time.monotonic() + 5
    while metric(server, "colibri_kv_blocks_free") != idle_free:
        assert time.monotonic() < deadline, "the aborted stream's KV blocks were not freed"
        time.sleep(0.01)
    assert metric(server, "colibri_num_requests_running") == 0
    assert metric(server, "colibri_engine_generated_tokens_total") - generated_before < 500  # not run to the end


def test_emoji_and_cjk_arrive_intact_through_streaming(server, client):
    seeds = range(16)
    options = dict(model="tiny-mixtral", prompt="你好 🙂", temperature=1.0, max_tokens=64,
                   extra_body={"ignore_eos": True})
    whole = [client.completions.create(seed=s, **options).choices[0].text for s in seeds]

    async def streamed(seed: int) -> str:
        async with async_client(server) as aclient:
            stream = await aclient.completions.create(seed=seed, stream=True, **options)
            return "".join([c.choices[0].text async for c in stream])

    async def all_streams() -> list[str]:
        return await asyncio.gather(*(streamed(s) for s in seeds))

    assert asyncio.run(all_streams()) == whole
    wide = "".join(ch for text in whole for ch in text if ord(ch) >= 0x2E80 and ch != "\ufffd")
    assert re.search("[\u4e00-\u9fff\u3040-\u30ff]", wide), wide  # CJK
    assert re.search("[\U0001F300-\U0001FAFF]", wide), wide  # emoji


def test_queue_full_is_429(small_server):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            long = {"prompt": "Busy", "max_tokens": 1500, "stream": True, "ignore_eos": True}
            running = await session.post(small_server.url + COMPLETIONS, json=long)
            async for line in running.content:  # wait for its first token: it has left the queue
                if line.startswith(b"data: "):
                    break
            waiting = asyncio.ensure_future(session.post(small_server.url + COMPLETIONS,
                                                         json={"prompt": "Next", "max_tokens": 2}))
            while await asyncio.to_thread(metric, small_server, "colibri_num_requests_waiting") < 1:
                await asyncio.sleep(0.005)
            refused = await session.post(small_server.url + COMPLETIONS, json={"prompt": "Third", "max_tokens": 2})
            assert refused.status == 429
            assert _error(await refused.json())["code"] == "queue_full"
            running.close()
            assert (await waiting).status == 200

    asyncio.run(scenario())


def test_a_batch_larger_than_the_server_can_ever_hold_is_400_not_429(small_server):
    status, body = post(small_server, COMPLETIONS, {"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert status == 400, body
    assert _error(body)["param"] == "prompt" and "never be admitted" in _error(body)["message"]
    status, body = post(small_server, COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 2


def test_keepalive_comments_during_a_long_prefill(small_server, tiny_model_dir):
    prompt = [5 + i % 300 for i in range(1800)]  # 225 prefill steps of 8 tokens before the first token
    status, headers, raw = request(small_server, "POST", COMPLETIONS,
                                   {"prompt": prompt, "max_tokens": 2, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.startswith(b": keep-alive\n\n")
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------------- SSE framing

def test_raw_sse_framing(server):
    status, headers, raw = request(server, "POST", CHAT, {"messages": chat("frames"), "max_tokens": 4,
                                                          "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8" and headers["Cache-Control"] == "no-cache"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 1
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


# ---------------------------------------------------------------------------------------- process and examples

def test_sigterm_drains_then_exits(tiny_model_dir):
    script = ("from colibri_stream.server import run_server; "
              f"run_server({{'path': {str(tiny_model_dir)!r}, 'device': 'cpu'}}, host='0.0.0.0', port=0)")
    process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        log = ""
        while not (match := re.search(r"on http://0\.0\.0\.0:(\d+)/v1", log)):
            line = process.stderr.readline()
            assert line, log
            log += line
        assert "without --api-key" in log  # a non-loopback address without a key
        url = f"http://127.0.0.1:{match.group(1)}"

        async def scenario() -> tuple[list, int, int]:
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "Drain me", "max_tokens": 1500, "stream": True, "ignore_eos": True}
                running = await session.post(url + COMPLETIONS, json=body)
                await running.content.readuntil(b"\n\n")  # its first event
                process.send_signal(signal.SIGTERM)
                while (await session.get(url + "/health")).status != 503:
                    await asyncio.sleep(0.005)
                refused = await session.post(url + COMPLETIONS, json={"prompt": "late", "max_tokens": 2})
                return sse_events(await running.read()), refused.status, (await refused.json())["error"]["code"]

        events, status, code = asyncio.run(scenario())
        assert (status, code) == (503, "shutting_down")
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.stderr.close()


def test_examples_run_against_the_server(server):
    env = dict(os.environ, COLIBRI_API_KEY=API_KEY)
    result = subprocess.run([sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", server.url + "/v1",
                             "--max-tokens", "8"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "[tiny-mixtral]" in result.stdout and "[streamed " in result.stdout
    if shutil.which("curl"):
        result = subprocess.run(["bash", str(EXAMPLES / "curl_stream.sh"), server.url, "hello"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert sse_events(result.stdout.encode())[-1] == "[DONE]"


def test_a_failed_model_step_is_a_500_the_health_check_sees_and_the_server_goes_on(tiny_model_dir):
    live = LiveServer(tiny_model_dir, {"max_batch_size": 4, "engine_process": False})
    try:
        runner = live.app[STATE].engine._core.runner
        execute = runner.execute

        def broken(step):
            raise RuntimeError("device lost")

        runner.execute = broken
        body = {"model": "tiny-mixtral", "prompt": "Hello", "max_tokens": 4}
        status, _, reply = request(live, "POST", "/v1/completions", body, key=None)
        error = orjson.loads(reply)["error"]
        assert status == 500 and "device lost" in error["message"] and error["type"] == "server_error"
        status, _, reply = request(live, "GET", "/health", key=None)
        assert status == 503 and orjson.loads(reply) == {"status": "unhealthy"}
        runner.execute = execute
        status, _, reply = request(live, "POST", "/v1/completions", body, key=None)
        assert status == 200 and orjson.loads(reply)["usage"]["completion_tokens"] >= 1
        assert request(live, "GET", "/health", key=None)[0] == 200
    finally:
        live.close()


# ------------------------------------------------------------------------------------------------ prefix caching

def test_cached_tokens_in_usage_and_metrics(server, client):
    """usage.prompt_tokens_details.cached_tokens (where the openai client reads it) is 0 for a new conversation and
    covers its earlier turns when the client resends it, in both endpoints and the streams' usage chunks; /metrics
    counts the prefill tokens the cache served against those computed."""
    cached_before = metric(server, 'colibri_prefill_tokens_total{source="cached"}')
    computed_before = metric(server, 'colibri_prefill_tokens_total{source="computed"}')
    messages = chat("Prefix caching test: tell me a long story about a fox, a dog and a tortoise in a forest.")
    first = client.chat.completions.create(model="tiny-mixtral", messages=messages, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, *chat("And then?")]
    chunks = list(client.chat.completions.create(model="tiny-mixtral", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usage = chunks[-1].usage
    block = 16  # the engine's default block size
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // block * block - block
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    again = client.chat.completions.create(model="tiny-mixtral", messages=messages, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // block * block

    prompt = "Prefix caching test for completions: " + "the quick brown fox jumps over the lazy dog " * 3
    fresh = client.completions.create(model="tiny-mixtral", prompt=prompt, **GREEDY)
    resent = client.completions.create(model="tiny-mixtral", prompt=prompt, **GREEDY)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert resent.usage.prompt_tokens_details.cached_tokens == (resent.usage.prompt_tokens - 1) // block * block > 0

    served = metric(server, 'colibri_prefill_tokens_total{source="cached"}') - cached_before
    computed = metric(server, 'colibri_prefill_tokens_total{source="computed"}') - computed_before
    assert served >= usage.prompt_tokens_details.cached_tokens + resent.usage.prompt_tokens_details.cached_tokens
    assert computed > 0
    assert metric(server, "colibri_kv_blocks_cached") > 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens only; -1 keeps up to the context (all of these)."""
    prompt = list(range(10, 60))  # 50 token ids
    cut = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=3, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 12})
    tail = client.completions.create(model="tiny-mixtral", prompt=prompt[-12:], max_tokens=3, temperature=0)
    assert cut.usage.prompt_tokens == 12 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 50
    chat = client.chat.completions.create(model="tiny-mixtral", messages=[{"role": "user", "content": "hello " * 30}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7


def test_version_is_open_like_health(server):
    import colibri_stream

    status, _, raw = request(server, "GET", "/version", key=None)
    assert status == 200 and orjson.loads(raw) == {"version": colibri_stream.__version__}
