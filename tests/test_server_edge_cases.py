"""The server against hostile or just unusual input, as users of vLLM's or llama.cpp's OpenAI servers and of the
official openai client send it: every refusal is an OpenAI error body with the right status, and the server keeps
serving afterwards (each bad request below is followed by a good one)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import zlib
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from conftest import MAX_POSITIONS
from test_server import API_KEY, CHAT, COMPLETIONS, LiveServer, _error, metric, request, requests_counted, sse_events

from colibri_stream.errors import APIError, InvalidParameterError
from colibri_stream.request import SamplingParams
from colibri_stream.sampling import SamplingState
from colibri_stream.server.parse_openai import parse_chat
from colibri_stream.server.state import STATE

MODEL = "colibri/tiny-mixtral"  # a served name with a slash, as Hugging Face names have
MAX_SEQ_LEN = 256
ENDPOINTS = [(COMPLETIONS, False), (COMPLETIONS, True), (CHAT, False), (CHAT, True)]
ENDPOINT_IDS = ["completions", "completions-stream", "chat", "chat-stream"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A key, a served name with a slash, 64 KiB bodies, a context of 256 tokens."""
    live = LiveServer(tiny_model_dir, dict(max_batch_size=8, max_seq_len=MAX_SEQ_LEN), api_key=API_KEY,
                      served_model_name=MODEL, max_body_bytes=64 << 10)
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def body_for(path: str, stream: bool, **fields: Any) -> dict:
    """A good request for `path`, with `fields` added (None removes a field)."""
    body: dict[str, Any] = {"prompt": "Hello"} if path == COMPLETIONS else {"messages": [{"role": "user",
                                                                                          "content": "Hello"}]}
    body.update(max_tokens=2, stream=stream)
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


def send(server: LiveServer, path: str, body: Any = None, *, data: bytes | None = None,
         headers: dict | None = None) -> tuple[int, Any, Any]:
    """POST `body` (through the standard json module: orjson writes no integer past 64 bits) or `data`; returns
    the status, the headers and the reply parsed: an error body as JSON, a stream as its events, else the JSON."""
    if body is not None:
        data, headers = json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    status, headers, raw = request(server, "POST", path, data=data, headers=headers)
    if headers["Content-Type"].startswith("text/event-stream"):
        return status, headers, sse_events(raw)
    return status, headers, orjson.loads(raw)


def assert_serving(server: LiveServer, path: str = COMPLETIONS, stream: bool = False) -> None:
    """A good request right after a bad one is answered."""
    status, _, reply = send(server, path, body_for(path, stream))
    assert status == 200, reply
    if stream:
        assert reply[-1] == "[DONE]" and "error" not in reply[-2]


def assert_refused(server: LiveServer, path: str, body: Any, status: int, param: str | None = None,
                   stream: bool = False, **kwargs: Any) -> dict:
    """`body` (or kwargs' data) gets an OpenAI error, JSON even when it asked for a stream, and the server
    serves the next request; returns the error."""
    got, headers, reply = send(server, path, body, **kwargs)
    assert got == status, reply
    assert headers["Content-Type"].startswith("application/json")
    error = _error(reply)
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert_serving(server, path, stream)
    return error


# --------------------------------------------------------------------------------------------- malformed bodies

MALFORMED = {
    "empty": b"",
    "not-json": b"{prompt: hello}",
    "array": b"[1, 2]",
    "string": b'"hello"',
    "null": b"null",
    "number": b"42",
    "nan": b'{"prompt": "x", "temperature": NaN}',
    "infinity": b'{"prompt": "x", "temperature": Infinity}',
    "overflow": b'{"prompt": "x", "temperature": 1e400}',
    "bad-utf8": b'{"prompt": "\xff\xfe"}',
    "lone-surrogate": b'{"prompt": "\\ud800"}',
    "bom": b'\xef\xbb\xbf{"prompt": "x"}',
    "utf16": '{"prompt": "x"}'.encode("utf-16"),
    "trailing": b'{"prompt": "x"} {}',
    "deep": b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
}


@pytest.mark.parametrize("path, stream", ENDPOINTS, ids=ENDPOINT_IDS)
@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_bodies_are_400(server, path, stream, name):
    assert_refused(server, path, None, 400, data=MALFORMED[name], stream=stream,
                   headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("data", "named"), [(b"null", "null"), (b"[]", "an array"), (b"true", "a boolean")])
def test_a_body_that_is_not_an_object_is_named_in_json_terms(server, data, named):
    error = assert_refused(server, CHAT, None, 400, data=data, headers={"Content-Type": "application/json"})
    assert error["message"] == f"the request body must be a JSON object, got {named}"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_that_does_not_decode_is_400(server, encoding, caplog):
    """... and is not logged with a traceback (aiohttp raised its error again as it drained the body)."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    data = orjson.dumps(body_for(COMPLETIONS, False))
    error = assert_refused(server, COMPLETIONS, None, 400, data=data,
                           headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert "could not be read" in error["message"]
    compressed = zlib.compress(data)  # a real deflate body is read
    status, _, reply = send(server, COMPLETIONS, data=compressed,
                            headers={"Content-Type": "application/json", "Content-Encoding": "deflate"})
    assert status == 200, reply
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("aiohttp")]


@pytest.mark.parametrize("encoding", ["br", "zstd", "x-unknown", "gzip, deflate"])
def test_a_content_encoding_the_server_cannot_read_is_415(server, encoding):
    """... and counted once by /metrics (aiohttp's parser refuses br and zstd before any route: as unmatched)."""
    def counted() -> float:
        return requests_counted(server, "unmatched", 415) + requests_counted(server, COMPLETIONS, 415)

    before = counted()
    data = orjson.dumps(body_for(COMPLETIONS, False))
    error = assert_refused(server, COMPLETIONS, None, 415, data=data,
                           headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert error["code"] == "unsupported_content_encoding" and "send the body as identity" in error["message"]
    assert counted() == before + 1
    status, _, reply = send(server, COMPLETIONS, data=data,
                            headers={"Content-Type": "application/json", "Content-Encoding": "Identity"})
    assert status == 200, reply


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=utf-8"])
def test_any_content_type_is_read_as_json(server, content_type):
    """A decision: curl -d sends a form type, and scripts leave it out; the body is JSON or a 400 either way."""
    headers = {"Content-Type": content_type} if content_type else {}
    status, _, reply = send(server, COMPLETIONS, data=orjson.dumps(body_for(COMPLETIONS, False)), headers=headers)
    assert status == 200 and reply["object"] == "text_completion"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_bodies_over_the_limit_are_413_even_chunked(server, path):
    big = body_for(path, True, user="x" * (70 << 10))
    error = assert_refused(server, path, big, 413, stream=True)
    assert error["code"] == "request_too_large" and str(64 << 10) in error["message"]

    async def chunked() -> tuple[int, dict]:
        async def parts():
            yield b'{"prompt": "'
            for _ in range(80):
                yield b"x" * 1024
            yield b'"}'

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            async with session.post(server.url + path, data=parts()) as response:  # no Content-Length
                return response.status, await response.json()

    status, reply = asyncio.run(chunked())
    assert status == 413 and _error(reply)["code"] == "request_too_large"
    assert_serving(server, path)


# ------------------------------------------------------------------------------------------ numeric parameters

# A few of the wrong values test_server_parse.py gives every field at the parsers, sent to the real server.
BAD_NUMBER_CASES = [("max_tokens", 0), ("n", 17), ("temperature", "0.5"), ("top_p", True), ("seed", 10**30),
                    ("stop_token_ids", [1.5])]


@pytest.mark.parametrize("path, stream", ENDPOINTS, ids=ENDPOINT_IDS)
def test_bad_numeric_values_are_400_naming_the_field(server, path, stream):
    for name, value in BAD_NUMBER_CASES:
        status, _, reply = send(server, path, body_for(path, stream, **{name: value}))
        assert status == 400, (name, value, reply)
        assert _error(reply)["param"] == name, (name, value, reply)
    assert_serving(server, path, stream)


@pytest.mark.parametrize("path, stream", ENDPOINTS, ids=ENDPOINT_IDS)
def test_seeds_fill_64_bits_signed_or_unsigned(server, path, stream):
    """vLLM and OpenAI take any int64 seed, negative ones too; those used to stop the engine for good."""
    def sample(seed: int) -> list:
        status, _, reply = send(server, path, body_for(path, stream, seed=seed, n=2, temperature=1.0,
                                                       max_tokens=6, ignore_eos=True))
        assert status == 200, (seed, reply)
        return reply

    for seed in (-1, -(2**63), 2**63, 2**64 - 1):
        if not stream:
            assert sample(seed)["choices"] == sample(seed)["choices"]  # reproducible
        else:
            assert sample(seed)[-1] == "[DONE]"
    assert_serving(server, path, stream)
    status, _, reply = send(server, path, body_for(path, stream, seed=2**64))
    assert status == 400 and "64 bits" in _error(reply)["message"] and _error(reply)["param"] == "seed"


def test_sampling_params_seed_range():
    for seed in (-1, -(2**63), 2**64 - 1):
        state = SamplingState.from_params(SamplingParams(seed=seed, n=2), [], index=1)
        assert 0 <= state.generator.random() < 1
    first = SamplingState.from_params(SamplingParams(seed=-5), []).generator.random()
    assert first == SamplingState.from_params(SamplingParams(seed=-5), []).generator.random()
    for seed in (2**64, -(2**63) - 1, 1.5):
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(seed=seed)
        assert info.value.param == "seed"


def test_huge_in_range_values_are_handled(server):
    """Values as large as JSON integers go: top_k past the vocabulary is off, max_tokens past the context is the
    context-length error, not a crash."""
    status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, top_k=2**62, temperature=1.0))
    assert status == 200, reply
    for max_tokens in (2**62, 2**64 - 1):
        status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, max_tokens=max_tokens))
        assert status == 400 and _error(reply)["code"] == "context_length_exceeded"
    status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, stop_token_ids=[2**64 - 1, -1]))
    assert status == 200, reply  # ids the model never makes never stop it
    assert_serving(server)


@pytest.mark.parametrize("path, stream", ENDPOINTS, ids=ENDPOINT_IDS)
def test_extreme_but_valid_sampling_values_keep_the_engine_up(server, path, stream):
    for fields in (dict(temperature=1e-300), dict(temperature=100.0, top_p=1e-300), dict(min_p=1e-300),
                   dict(repetition_penalty=0.01, temperature=1.0), dict(top_p=5e-324),
                   dict(presence_penalty=-2, frequency_penalty=2, repetition_penalty=10, top_k=1, min_p=1.0)):
        status, _, reply = send(server, path, body_for(path, stream, max_tokens=4, **fields))
        assert status == 200, (fields, reply)
    assert_serving(server, path, stream)


def test_logprobs_ranges(server):
    for value in (-1, 21, True, 2.0):
        assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, logprobs=value), 400, "logprobs")
    for fields, param in ((dict(logprobs=1), "logprobs"), (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
                          (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                          (dict(logprobs=True, top_logprobs=True), "top_logprobs"),
                          (dict(top_logprobs=3), "top_logprobs")):
        assert_refused(server, CHAT, body_for(CHAT, False, **fields), 400, param)


def test_completion_top_logprobs_hold_the_sampled_token(server):
    """OpenAI: the sampled token's logprob always comes back, so top_logprobs holds up to logprobs + 1 entries
    (logprobs: 0 gave empty dictionaries)."""
    for k in (0, 2):
        status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, logprobs=k, max_tokens=6,
                                                              temperature=1.0, seed=3, ignore_eos=True))
        assert status == 200
        logprobs = reply["choices"][0]["logprobs"]
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                  strict=True):
            assert top[token] >= lp - 1e-6 and 1 <= len(top) <= k + 1


# ---------------------------------------------------------------------------------------------- stop and prompt

def test_stop_forms(server):
    for stop in ("x", ["x", "y"], [], ["a"] * 16, None, ["🙂", "<|im_end|>", "\n", ".*"]):
        status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, stop=stop))
        assert status == 200, (stop, reply)
    for stop in ("", [""], ["a"] * 17, ["a", None], [1], {"x": 1}, 5):
        assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, stop=stop), 400, "stop")


def test_prompt_forms(server):
    tokenizer = server.app[STATE].engine.tokenizer
    ids = tokenizer.encode("Hello")
    texts = set()
    for prompt in ("Hello", ["Hello"], ids, [ids]):
        status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, prompt=prompt, temperature=0))
        assert status == 200, (prompt, reply)
        texts.add(reply["choices"][0]["text"])
    assert len(texts) == 1
    vocab = server.app[STATE].engine.model_config.vocab_size
    for prompt in ("", [""], [], [[]], [vocab], [[vocab]], [-1], [1, "a"], [True], [1.0], [2**70], [[[1]]],
                   [["Hello"]], {"text": "x"}, 5, True):
        error = assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, prompt=prompt), 400, "prompt")
        assert "batch" not in error["message"], prompt
    for prompt in (["a", [1]], [[1], "a"], ["a", None], [[1], []], [[1], [-1]], ["a", ""], ["a"] * 1025):
        assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, prompt=prompt), 400, "prompt")


def test_a_batch_of_prompts_gets_n_choices_per_prompt(server, client):
    """OpenAI and vLLM take several prompts in one /v1/completions request (lm-eval and benchmark scripts send
    them): prompt p's n choices are numbered p * n to p * n + n - 1, each equal to the prompt sent alone; usage
    counts every prompt once. A batch used to be refused."""
    tokenizer = server.app[STATE].engine.tokenizer
    prompts = ["Hello", "The quick brown fox", "Mixture of experts"]
    options = {"model": MODEL, "temperature": 0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **options) for p in prompts]
    for batch in (prompts, [tokenizer.encode(p) for p in prompts]):
        reply = client.completions.create(prompt=batch, n=2, **options)
        assert [c.index for c in reply.choices] == list(range(6))
        assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert reply.usage.completion_tokens == 6 * 4
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, logprobs=1,
                                            stream_options={"include_usage": True}, **options))
    texts, offsets = {}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
    assert [texts[i] for i in range(6)] == [a.choices[0].text for a in alone for _ in range(2)]
    assert all(offsets[i][0] == 0 for i in range(6))  # every choice's offsets start at its own text
    assert chunks[-1].usage.completion_tokens == 24


def test_a_bad_prompt_refuses_the_whole_batch_and_leaves_nothing_running(server):
    idle_free = metric(server, "colibri_kv_blocks_free")
    for prompt, code, index in ((["Hello", "x " * (MAX_SEQ_LEN + 10)], "context_length_exceeded", 1),
                                (["Hello", "Again", ""], None, 2)):
        for stream in (False, True):
            error = assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, stream, prompt=prompt), 400, "prompt",
                                   stream=stream)
            assert error["code"] == code, error
            assert error["message"].startswith(f"prompt {index}: "), error
    wait_for_idle(server, idle_free)


@pytest.fixture(scope="module")
def long_server(tiny_model_dir):
    """The tiny model with room for long generations: one that outlasts the time the server takes to see a client
    leave, however loaded the machine."""
    live = LiveServer(tiny_model_dir, dict(max_batch_size=8, max_seq_len=MAX_POSITIONS), api_key=API_KEY,
                      served_model_name=MODEL)
    yield live
    live.close()


def test_a_client_leaving_a_batch_stream_aborts_every_prompt(long_server):
    """All three prompts of the stream end as aborted, long before their max_tokens."""
    server = long_server
    idle_free = metric(server, "colibri_kv_blocks_free")
    generated_before = metric(server, "colibri_engine_generated_tokens_total")
    aborted_before = metric(server, "colibri_engine_aborted_sequences_total")

    async def read_a_little_then_leave() -> None:
        body = body_for(COMPLETIONS, True, prompt=["One", "Two", "Three"], max_tokens=MAX_POSITIONS - 16,
                        ignore_eos=True)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session, \
                session.post(server.url + COMPLETIONS, json=body) as response:
            assert response.status == 200
            for _ in range(6):
                await response.content.readuntil(b"\n\n")

    asyncio.run(read_a_little_then_leave())
    wait_for_idle(server, idle_free)
    assert metric(server, "colibri_engine_aborted_sequences_total") - aborted_before == 3
    assert metric(server, "colibri_engine_generated_tokens_total") - generated_before < 3 * (MAX_POSITIONS - 16)
    assert_serving(server)


@pytest.mark.parametrize("path, stream", ENDPOINTS, ids=ENDPOINT_IDS)
def test_prompt_longer_than_the_context(server, path, stream):
    long = "x " * (MAX_SEQ_LEN + 10)
    prompt = {"prompt": long} if path == COMPLETIONS else {"messages": [{"role": "user", "content": long}]}
    error = assert_refused(server, path, body_for(path, stream, **prompt), 400, stream=stream,
                           param="prompt" if path == COMPLETIONS else "messages")
    assert error["code"] == "context_length_exceeded" and str(MAX_SEQ_LEN) in error["message"]
    status, _, reply = send(server, path, body_for(path, stream, max_tokens=MAX_SEQ_LEN))  # room for no prompt
    assert status == 400 and _error(reply)["code"] == "context_length_exceeded"


# ----------------------------------------------------------------------------------------------- chat messages

def user(content: Any) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_chat_messages_refused(server):
    cases = [
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": None, "content": "hi"}], "messages[0].role"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": 5, "content": "hi"}], "messages[0].role"),
        ([{"role": ["user"], "content": "hi"}], "messages[0].role"),  # was a 500: a list is not hashable
        ([{"role": {"name": "user"}, "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        (user(None), "messages[0].content"),
        (user({"text": "hi"}), "messages[0].content"),
        (user(["hi"]), "messages[0].content[0]"),
        (user([{"type": "text"}]), "messages[0].content[0]"),
        (user([{"text": "hi"}]), "messages[0].content[0]"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
        ([], "messages"),
        ({"role": "user", "content": "hi"}, "messages"),
        (None, "messages"),
    ]
    for messages, param in cases:
        assert_refused(server, CHAT, body_for(CHAT, False, messages=messages), 400, param, stream=False)


def test_chat_features_refused_clearly(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases = [
        (dict(messages=user([{"type": "text", "text": "What is this?"}, image])), "messages[0].content[1]"),
        (dict(messages=user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])),
         "messages[0].content[0]"),
        (dict(messages=[{"role": "function", "content": "42", "name": "f"}]), "messages[0]"),
        (dict(functions=[{"name": "f"}]), "functions"),
    ]
    for fields, param in cases:
        for stream in (False, True):
            error = assert_refused(server, CHAT, body_for(CHAT, stream, **fields), 400, param, stream=stream)
            assert error["code"] == "unsupported_parameter", error


@pytest.mark.parametrize("name, value", [("tool_choice", 5), ("tool_choice", "banana"), ("tool_choice", []),
                                         ("function_call", "banana"), ("function_call", True)])
def test_a_tool_choice_that_is_no_choice_is_an_invalid_value(server, name, value):
    error = assert_refused(server, CHAT, body_for(CHAT, False, **{name: value}), 400, name)
    assert error["code"] is None and "must be" in error["message"], error


def test_tools_are_ignored_with_tool_choice_none(server):
    """As vLLM without a tool parser: tools (or legacy functions) with tool_choice (function_call) "none" ask for a
    plain answer, which this server gives. Tools the model may choose to call (tool_choice "auto", the default)
    are shown to the template and, as this model's ChatML template teaches no tool-call syntax, answered in text
    (test_server_defects.py; test_server_auto_tools.py: a template that teaches one)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for fields in ({"tools": tools, "tool_choice": "none"}, {"functions": [{"name": "f"}], "function_call": "none"}):
        for stream in (False, True):
            status, _, reply = send(server, CHAT, body_for(CHAT, stream, **fields))
            assert status == 200, (fields, reply)
    error = assert_refused(server, CHAT, body_for(CHAT, False, functions=[{"name": "f"}], tool_choice="none"), 400,
                           "functions")
    assert error["code"] == "unsupported_parameter"


def test_chat_messages_accepted(server):
    cases = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}],
        [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *user("hi")],
        [*user("hi"), {"role": "assistant", "content": None}, *user("again")],
        [*user("hi"), {"role": "assistant", "content": "hello", "tool_calls": []}, *user("again")],
        user(""),
        user([{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {}}]),
        [*user("hi"), {"role": "assistant", "content": [], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
    ]
    for messages in cases:
        status, _, reply = send(server, CHAT, body_for(CHAT, False, messages=messages))
        assert status == 200, (messages, reply)


def test_chat_messages_openai_refuses_are_400_naming_the_field():
    """An empty array of parts, a tool message that answers no earlier call, a history call that is not
    {"id": str, "type": "function", "function": {"name": non-empty, ...}}, a tool's name with a control character,
    a description or strict of the wrong type: each a 400 naming the field, as OpenAI answers them."""
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        (dict(messages=user([])), "messages[0].content"),
        (dict(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "42"}]), "messages[0].role"),
        (dict(messages=[*user("hi"), called, {"role": "tool", "tool_call_id": "call_2", "content": "42"}]),
         "messages[2].tool_call_id"),
        (dict(messages=[*user("hi"), dict(called, tool_calls=[dict(called["tool_calls"][0], type="x")])]),
         "messages[1].tool_calls[0]"),
        (dict(messages=[*user("hi"), dict(called, tool_calls=[dict(called["tool_calls"][0], id={})])]),
         "messages[1].tool_calls[0]"),
        (dict(messages=[*user("hi"), dict(called, tool_calls=[{"id": "c", "type": "function",
                                                               "function": {"name": "", "arguments": "{}"}}])]),
         "messages[1].tool_calls[0]"),
        (dict(tools=[{"type": "function", "function": {"name": "f\u0000"}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "f" * 65}}]), "tools[0].function.name"),
        (dict(tools=[dict(tool, function=dict(tool["function"], strict="yes"))]), "tools[0].function.strict"),
        (dict(tools=[dict(tool, function=dict(tool["function"], description=5))]),
         "tools[0].function.description"),
    ]
    for fields, param in cases:
        messages = fields.pop("messages", user("hi"))
        with pytest.raises(APIError) as refused:
            parse_chat(dict(model=MODEL, messages=messages, **fields))
        assert refused.value.status == 400 and refused.value.param == param, (fields, refused.value.message)


def test_no_op_values_of_unsupported_features_are_accepted(server):
    for path in (COMPLETIONS, CHAT):
        fields = dict(tools=[], functions=[], tool_choice="none", logit_bias={}, response_format={"type": "text"},
                      echo=False, suffix="", best_of=1, user="someone", parallel_tool_calls=False,
                      metadata={"k": "v"}, store=False, service_tier="auto", made_up={"a": [1]})
        status, _, reply = send(server, path, body_for(path, False, **fields))
        assert status == 200, (path, reply)
    status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, n=2, best_of=2))
    assert status == 200 and len(reply["choices"]) == 2


def test_completion_features_refused_clearly(server):
    for fields, param in ((dict(suffix="end"), "suffix"), (dict(best_of=3), "best_of")):
        error = assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, **fields), 400, param)
        assert error["code"] == "unsupported_parameter"
    error = assert_refused(server, CHAT, body_for(CHAT, False, echo=True), 400, "echo")  # completions only
    assert error["code"] == "unsupported_parameter"
    for best_of in (0, -1):  # a bad value, not a feature: it said "best_of (0) other than n (1) is not supported"
        error = assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, best_of=best_of), 400, "best_of")
        assert error["code"] is None and "positive" in error["message"]
    for fields, param in ((dict(echo="yes"), "echo"), (dict(suffix=5), "suffix"), (dict(best_of=True), "best_of"),
                          (dict(user=5), "user"), (dict(model=5), "model"), (dict(stream="yes"), "stream")):
        assert_refused(server, COMPLETIONS, {**body_for(COMPLETIONS, False), **fields}, 400, param)


def test_chat_max_tokens_is_checked_when_max_completion_tokens_wins(server):
    assert_refused(server, CHAT, body_for(CHAT, False, max_completion_tokens=2, max_tokens="x"), 400, "max_tokens")
    assert_refused(server, CHAT, body_for(CHAT, False, max_completion_tokens=0), 400, "max_completion_tokens")
    status, _, reply = send(server, CHAT, body_for(CHAT, False, max_completion_tokens=3, max_tokens=9,
                                                   ignore_eos=True))
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------------------ streaming options

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stream_options_variants(server, path):
    for options, usage in (({}, False), ({"include_usage": False}, False), ({"include_usage": None}, False),
                           ({"include_usage": True}, True), ({"include_usage": True, "continuous_usage_stats": True},
                                                             True)):
        status, _, events = send(server, path, body_for(path, True, stream_options=options))
        assert status == 200 and events[-1] == "[DONE]"
        assert (events[-2]["choices"] == [] and events[-2]["usage"] is not None) == usage, options
    assert_refused(server, path, body_for(path, False, stream_options={"include_usage": True}), 400,
                   "stream_options")
    assert_refused(server, path, body_for(path, True, stream_options={"include_usage": 1}), 400,
                   "stream_options.include_usage", stream=True)
    assert_refused(server, path, body_for(path, True, stream_options=[]), 400, "stream_options", stream=True)
    status, _, reply = send(server, path, body_for(path, False, stream_options=None))
    assert status == 200, reply


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n_with_streaming(server, path):
    status, _, events = send(server, path, body_for(path, True, n=3, max_tokens=4, temperature=1.0, seed=5,
                                                    ignore_eos=True, stream_options={"include_usage": True}))
    assert status == 200 and events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    assert usage["usage"]["completion_tokens"] == 12


# ------------------------------------------------------------------------------------------- routes and auth

def test_routes_methods_and_keys(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("POST", "/v1/completions/", 404),
                                 ("GET", COMPLETIONS, 405), ("PUT", CHAT, 405), ("DELETE", "/v1/models", 405)):
        got, _, raw = request(server, method, path)
        assert got == status and _error(orjson.loads(raw)), (method, path)
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdC1rZXk="},
                    {"Authorization": API_KEY}, {"Authorization": "Bearer"}, {}):
        got, _, raw = request(server, "POST", COMPLETIONS, body_for(COMPLETIONS, False), headers=headers, key=None)
        assert got == 401 and _error(orjson.loads(raw))["code"] == "invalid_api_key", headers
    got, _, _ = request(server, "POST", COMPLETIONS, body_for(COMPLETIONS, False), key=None,
                        headers={"Authorization": f"bearer  {API_KEY} "})
    assert got == 200
    assert_serving(server)


def raw_http(server: LiveServer, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One request written byte for byte (headers aiohttp's client would not send); returns status and body."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def test_api_key_that_is_not_utf8_is_401(server):
    body = orjson.dumps(body_for(COMPLETIONS, False))
    for key in (b"\xd0\xba\xff", b"\xff" + API_KEY.encode(), "ключ".encode()):
        status, raw = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                       b"\r\nAuthorization: Bearer " + key + b"\r\n", body)
        assert status == 401 and _error(orjson.loads(raw))["code"] == "invalid_api_key", key
    assert_serving(server)


def test_served_name_with_a_slash(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, raw = request(server, "GET", "/v1/models/" + MODEL)  # the slash as it is
    assert status == 200 and orjson.loads(raw)["id"] == MODEL
    status, _, raw = request(server, "GET", "/v1/models/colibri/other")
    assert status == 404 and _error(orjson.loads(raw))["code"] == "model_not_found"
    status, _, reply = send(server, COMPLETIONS, body_for(COMPLETIONS, False, model=MODEL))
    assert status == 200 and reply["model"] == MODEL
    assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, model="tiny-mixtral"), 404, "model")
    assert_refused(server, COMPLETIONS, body_for(COMPLETIONS, False, model=""), 404, "model")


# ------------------------------------------------------------------------------------------ the openai client

def test_openai_client_calls(server, client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=user("hi"),
                                                           max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    assert raw.parse().usage.completion_tokens == 3
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=3, stream=True,
                                                      extra_body={"ignore_eos": True, "top_k": 5})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert [c.choices[0].finish_reason for c in raw.parse()][-1] == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), max_completion_tokens=3,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "stop_token_ids": [2]})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_openai_client_error_types(server, client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=user("hi"), temperature=-1, stream=stream)
        assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
        assert "temperature must be between 0 and 100" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=stream,
                                      extra_body={"seed": -(2**63) - 1})
        assert info.value.body["param"] == "seed"
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", stream=stream)
        assert "does not exist" in info.value.message and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert "API key" in info.value.message
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (70 << 10))
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------------------ disconnects and concurrency

def wait_for_idle(server: LiveServer, idle_free: float) -> None:
    deadline = time.monotonic() + 10
    while metric(server, "colibri_kv_blocks_free") != idle_free or metric(server, "colibri_num_requests_running"):
        assert time.monotonic() < deadline, "the abandoned request's KV blocks were not freed"
        time.sleep(0.01)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_client_leaving_a_non_streaming_request_aborts_it(server, path):
    idle_free = metric(server, "colibri_kv_blocks_free")
    generated_before = metric(server, "colibri_engine_generated_tokens_total")

    async def leave_while_it_runs() -> None:
        body = body_for(path, False, max_tokens=MAX_SEQ_LEN - 40, ignore_eos=True)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            pending = asyncio.ensure_future(session.post(server.url + path, json=body))
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(metric, server, "colibri_num_requests_running") < 1:
                assert time.monotonic() < deadline and not pending.done(), "the request did not start"
                await asyncio.sleep(0.005)
            pending.cancel()  # closes the connection before the response
            with pytest.raises(asyncio.CancelledError):
                await pending

    asyncio.run(leave_while_it_runs())
    wait_for_idle(server, idle_free)
    assert metric(server, "colibri_engine_generated_tokens_total") - generated_before < MAX_SEQ_LEN - 40
    assert_serving(server, path)


def test_concurrent_requests_with_some_failing(server):
    prompts = [f"Concurrent {i} fox" for i in range(6)]
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    singles = [send(server, COMPLETIONS, body_for(COMPLETIONS, False, prompt=p, **greedy))[2]["choices"][0]["text"]
               for p in prompts]
    bad_bodies = [body_for(COMPLETIONS, True, prompt="x " * (MAX_SEQ_LEN + 1)),
                  body_for(COMPLETIONS, True, top_p=-1), body_for(CHAT, True, messages=[{"role": 1}]),
                  body_for(COMPLETIONS, False, seed=-3, temperature=1.0, n=4)]

    async def one(session: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, bytes]:
        async with session.post(server.url + path, json=body) as response:
            return response.status, await response.read()

    async def leaver(session: aiohttp.ClientSession) -> None:
        body = body_for(COMPLETIONS, True, max_tokens=200, ignore_eos=True)
        async with session.post(server.url + COMPLETIONS, json=body) as response:
            await response.content.readuntil(b"\n\n")  # its first event, then away

    async def all_at_once() -> list:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            good = [one(session, COMPLETIONS, body_for(COMPLETIONS, True, prompt=p, **greedy)) for p in prompts]
            bad = [one(session, CHAT if "messages" in b else COMPLETIONS, b) for b in bad_bodies]
            return await asyncio.gather(*good, *bad, leaver(session))

    results = asyncio.run(all_at_once())
    streamed = [sse_events(raw) for _, raw in results[:len(prompts)]]
    assert ["".join(e["choices"][0]["text"] for e in events[:-1]) for events in streamed] == singles
    statuses = [status for status, _ in results[len(prompts):len(prompts) + len(bad_bodies)]]
    assert statuses == [400, 400, 400, 200]
    assert_serving(server)
