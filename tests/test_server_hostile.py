"""The server against hostile clients and raw HTTP, third audit (the first two: test_server_edge_cases.py,
test_server_api_compat.py): bodies over the limit refused before they are read, `Expect: 100-continue`, HTTP that
aiohttp's parser refuses, keep-alive connections reused after errors, a client that stops reading a stream, many
idle or half-sent connections, every field of both endpoints given values of every JSON type, and the fields of
one endpoint sent to the other. The shipped default model serves; every refusal is an OpenAI error body, and a
good request is answered after each family of bad ones."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time

import aiohttp
import openai
import orjson
import pytest
from test_server import (
    API_KEY,
    CHAT,
    COMPLETIONS,
    LiveServer,
    _error,
    metric,
    post,
    request,
    sse_events,
)

from colibri_stream.checkpoint import default_model_path
from colibri_stream.errors import APIError
from colibri_stream.server.generate_request import GenerateRequest
from colibri_stream.server.parse_openai import parse_chat, parse_completion
from colibri_stream.server.state import STATE

MODEL = "default_model"
SEND_TIMEOUT = 0.5
MAX_BODY = 4 << 20  # the server's default limit


@pytest.fixture(scope="module")
def server():
    """The default model and body limit; streams whose client takes nothing for half a second are dropped."""
    live = LiveServer(default_model_path(), dict(max_batch_size=8, max_seq_len=512, max_queue=64),
                      api_key=API_KEY, send_timeout=SEND_TIMEOUT)
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def port(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def head(method: str, path: str, length: int | None = None, *extra: bytes, key: str | None = API_KEY) -> bytes:
    """A request's head, byte for byte."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Content-Type: application/json", *extra]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}".encode())
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def good_body(path: str = COMPLETIONS) -> bytes:
    body = {"prompt": "def add(a, b):"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps({**body, "max_tokens": 2})


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict, bytes]:
    """One response (Content-Length framed) from `sock`; bytes past it stay in `buffer`."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {bytes(buffer)[:200]!r}"
        buffer += chunk
    raw_head, _, _ = bytes(buffer).partition(b"\r\n\r\n")
    del buffer[:len(raw_head) + 4]
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    length = int(headers.get("content-length", 0))
    while len(buffer) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a body"
        buffer += chunk
    body = bytes(buffer[:length])
    del buffer[:length]
    return int(status_line.split()[1]), headers, body


def connect(server: LiveServer, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port(server)), timeout=timeout)


def assert_error(status: int, headers: dict, body: bytes, expected: int, code: str | None = None) -> dict:
    assert status == expected, body[:300]
    assert headers["content-type"].startswith("application/json"), headers
    error = _error(orjson.loads(body))
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serving(server: LiveServer, path: str = COMPLETIONS) -> None:
    status, reply = post(server, path, orjson.loads(good_body(path)))
    assert status == 200, reply


# ------------------------------------------------------------------------------------------- bodies over the limit

def test_a_body_announced_over_the_limit_is_refused_before_it_is_read(server):
    """The 413 comes back while 49 of the 50 MB are still unsent: it used to come after 4 MiB had been read."""
    with connect(server, timeout=5) as sock:
        sock.sendall(head("POST", COMPLETIONS, 50 << 20) + b'{"prompt": "' + b"x" * (1 << 20))
        status, headers, body = read_response(sock, bytearray())
    error = assert_error(status, headers, body, 413, "request_too_large")
    assert str(MAX_BODY) in error["message"]
    assert_serving(server)


def test_a_50_mb_body_is_413_and_the_connection_serves_the_next_request(server):
    """The whole body sent, as the openai client does before it reads: the client gets the 413 (not a reset
    connection) and the same keep-alive connection answers the next request."""
    chunk = b"x" * (1 << 20)
    with connect(server, timeout=20) as sock:
        sock.sendall(head("POST", COMPLETIONS, 50 * len(chunk) + 14) + b'{"prompt": "')
        for _ in range(50):
            sock.sendall(chunk)
        sock.sendall(b'"}')
        sock.sendall(head("POST", COMPLETIONS, len(good_body())) + good_body())
        buffer = bytearray()
        assert_error(*read_response(sock, buffer), 413, "request_too_large")
        status, _, body = read_response(sock, buffer)
        assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 2


def test_expect_100_continue(server):
    """curl sends `Expect: 100-continue` with bodies over 1 MiB: one over the limit gets its 413 instead of
    "100 Continue" (the body is never sent); a small one gets 100 Continue, then its answer; an expectation this
    server does not know is a 417 in OpenAI's shape."""
    with connect(server, timeout=5) as sock:
        sock.sendall(head("POST", CHAT, 50 << 20, b"Expect: 100-continue"))
        status, headers, body = read_response(sock, bytearray())
        assert_error(status, headers, body, 413, "request_too_large")
        assert headers["connection"].lower() == "close"  # the client need not send the body to reuse it
    body = good_body(CHAT)
    with connect(server, timeout=5) as sock:
        sock.sendall(head("POST", CHAT, len(body), b"Expect: 100-continue"))
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            buffer += sock.recv(1024)
        assert bytes(buffer).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del buffer[:len(b"HTTP/1.1 100 Continue\r\n\r\n")]
        sock.sendall(body)
        status, _, reply = read_response(sock, buffer)
        assert status == 200 and orjson.loads(reply)["object"] == "chat.completion"
    with connect(server, timeout=5) as sock:
        sock.sendall(head("POST", CHAT, len(body), b"Expect: 200-ok") + body)
        assert_error(*read_response(sock, bytearray()), 417, "expectation_failed")
    assert_serving(server, CHAT)


# ----------------------------------------------------------------------------------- HTTP the parser refuses

MALFORMED_HTTP = {
    "header-line-over-8k": head("GET", "/v1/models", None, b"X-Big: " + b"a" * 9000),
    "200-headers": head("GET", "/v1/models", None, *(b"X-H%d: v" % i for i in range(200))),
    "request-line-over-8k": head("GET", "/v1/models?" + "a" * 9000, None),
    "unknown-method": head("FROB", "/v1/models", None),
    "length-and-chunked": head("POST", COMPLETIONS, 5, b"Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "bad-content-length": head("POST", COMPLETIONS, None, b"Content-Length: -5"),
    "header-without-colon": head("GET", "/v1/models", None, b"NoColonHere"),
}


@pytest.mark.parametrize("name", list(MALFORMED_HTTP))
def test_http_the_parser_refuses_is_an_openai_error_logged_quietly(server, name, caplog):
    """These never reach a route: aiohttp answered them with text/plain and logged a traceback at ERROR level for
    each (a log any client could flood)."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    with connect(server, timeout=5) as sock:
        sock.sendall(MALFORMED_HTTP[name])
        status, headers, body = read_response(sock, bytearray())
        assert sock.recv(100) == b""  # closed after it, as aiohttp does: the connection's state is unknown
    error = assert_error(status, headers, body, 400, "bad_http_request")
    assert error["message"].startswith("malformed HTTP request") and len(error["message"]) < 400
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("aiohttp")]
    assert_serving(server)


def test_openai_client_with_a_header_over_8k(server):
    """An api key or default header too long for the parser reaches the openai client as a BadRequestError that
    says why, as any other 400."""
    big = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                        default_headers={"X-Trace": "t" * 9000})
    with pytest.raises(openai.BadRequestError) as info:
        big.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert info.value.body["code"] == "bad_http_request" and "8190" in info.value.message
    assert_serving(server)


# --------------------------------------------------------------------------------- keep-alive, HEAD, OPTIONS

def test_one_keep_alive_connection_answers_after_each_error(server):
    """A 400, 401, 404, 405 and a 413 (body announced over the limit but short) on one connection, each followed
    by requests that succeed, answered in order."""
    good = head("POST", COMPLETIONS, len(good_body())) + good_body()
    bad_json = b'{"prompt": "x", "max_tokens": 0}'
    requests = [
        (head("POST", COMPLETIONS, len(bad_json)) + bad_json, 400),
        (good, 200),
        (head("POST", COMPLETIONS, len(good_body()), key="wrong") + good_body(), 401),
        (good, 200),
        (head("POST", "/v1/nothing", len(good_body())) + good_body(), 404),
        (head("GET", COMPLETIONS), 405),
        (good, 200),
        (head("POST", COMPLETIONS, MAX_BODY + 1) + b"x" * (MAX_BODY + 1), 413),
        (good, 200),
        (head("GET", "/v1/models"), 200),
    ]
    with connect(server) as sock:
        sock.sendall(b"".join(data for data, _ in requests))
        buffer = bytearray()
        for _, expected in requests:
            status, headers, body = read_response(sock, buffer)
            assert status == expected, body[:200]
            if status >= 400:
                assert_error(status, headers, body, expected)


def test_head_and_options(server):
    status, headers, body = request(server, "HEAD", "/v1/models")
    assert status == 200 and body == b"" and headers["Content-Type"] == "application/json"
    status, _, body = request(server, "HEAD", "/v1/models", key=None)
    assert status == 401 and body == b""
    status, headers, body = request(server, "HEAD", COMPLETIONS)
    assert status == 405 and headers["Allow"] == "POST" and body == b""
    for path in (COMPLETIONS, CHAT, "/v1/models"):  # no CORS configured: no preflight answers either
        status, headers, body = request(server, "OPTIONS", path)
        assert status == 405 and _error(orjson.loads(body))["code"] == "method_not_allowed", path
    status, _, body = request(server, "GET", "/")
    assert status == 404 and _error(orjson.loads(body))["code"] == "not_found"
    assert_serving(server)


# ------------------------------------------------------------------------------------- a client that stops reading

def test_a_stream_whose_client_stops_reading_is_aborted_and_others_are_served(server, client):
    """A client that opens a stream and reads nothing: once the buffers are full its handler waited for ever and
    the engine generated every token. Now the write times out: the request is aborted, its handler ends and the
    connection closes, while other clients are served meanwhile."""
    state = server.app[STATE]
    generated_before = metric(server, "colibri_engine_generated_tokens_total")
    connections_before = set(state_connections(server))
    body = orjson.dumps({"prompt": "import os", "max_tokens": 400, "n": 8, "logprobs": 20, "stream": True,
                         "ignore_eos": True, "temperature": 1.0})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port(server)))
    try:
        deadline = time.monotonic() + 5
        while not (mine := set(state_connections(server)) - connections_before):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for handler in mine:  # keep the server's kernel buffer small, so that ~100 KB fill every buffer
            handler.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.sendall(head("POST", COMPLETIONS, len(body)) + body)
        while not state.active:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=2)  # served meanwhile
        assert reply.usage.completion_tokens == 2
        deadline = time.monotonic() + 15
        while state.active or metric(server, "colibri_num_requests_running"):
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            time.sleep(0.02)
        generated = metric(server, "colibri_engine_generated_tokens_total") - generated_before
        assert generated < 8 * 400 / 2, generated  # stopped well before its end
        sock.settimeout(5)
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):  # closed, or reset: it aborted with bytes unsent
            while chunk := sock.recv(1 << 20):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK") and not received.endswith(b"data: [DONE]\n\n")
    finally:
        sock.close()
    assert_serving(server)


def state_connections(server: LiveServer) -> list:
    return server._runner.server.connections


# -------------------------------------------------------------------------------------------- many connections

def test_many_idle_and_half_sent_connections_do_not_stop_the_server(server):
    """200 connections that send nothing and 50 that send a head and part of the body: a stream and a request
    with the openai client's async API are still answered at once; every socket is closed afterwards."""
    idle = [connect(server) for _ in range(200)]
    half = []
    for _ in range(50):
        sock = connect(server)
        sock.sendall(head("POST", COMPLETIONS, 100) + b'{"prompt": ')
        half.append(sock)
    try:
        async def served() -> list[str]:
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                          timeout=10) as aclient:
                async def stream(i: int) -> str:
                    chunks = await aclient.completions.create(model=MODEL, prompt=f"x = {i}", max_tokens=3,
                                                              stream=True, extra_body={"ignore_eos": True})
                    return "".join([c.choices[0].text async for c in chunks])

                return await asyncio.gather(*(stream(i) for i in range(16)))

        start = time.monotonic()
        assert len(asyncio.run(served())) == 16
        assert time.monotonic() - start < 10
    finally:
        for sock in idle + half:
            sock.close()
    assert_serving(server)


# ---------------------------------------------------------------------------------- every field, every JSON type

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "echo", "suffix", "best_of", "tools",
          "tool_choice", "functions", "function_call", "response_format", "modalities", "audio",
          "continue_final_message", "stop_token_ids", "ignore_eos", "parallel_tool_calls", "metadata", "store",
          "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "min_tokens",
          "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "chat_template_kwargs",
          "add_generation_prompt", "chat_template", "prompt_logprobs"]
VALUES = [None, True, False, 0, -1, 1.5, "", "x", [], {}, [None], [[]], {"type": None}, 2**70, -1e308, [1, "a"],
          ["a"] * 20, "\u0000", {"": ""}, {"json": 5}, {"regex": "["}, {"choice": [""]}, {"grammar": "start:"},
          {"json_object": True, "regex": "a"}]


BASES = {COMPLETIONS: {"prompt": "x", "max_tokens": 1}, CHAT: {"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 1}}


def _parsed(server: LiveServer, path: str, body: dict) -> GenerateRequest | None:
    """The request the server's parser for `path`, set up as the server's, reads from `body` (from its JSON text,
    as the server reads it); None where it refuses it, which must be with a 4xx APIError (any other exception
    fails the test)."""
    state = server.app[STATE]
    parse = (functools.partial(parse_completion, fim_tokens=state.fim_tokens) if path == COMPLETIONS else
             functools.partial(parse_chat, tool_syntax=state.tool_syntax, split_reasoning=state.split_reasoning))
    try:
        return parse(orjson.loads(json.dumps(body)))
    except APIError as error:
        assert 400 <= error.status < 500, (path, body, error.status, error.message)
        return None


def test_no_value_of_any_field_is_a_500(server):
    """Each field of either endpoint set to values of every JSON type: an answer or a 4xx in OpenAI's shape,
    never a 500 or a dropped connection. Every body goes through the server's own parser; one body of each
    request it reads (those reach the engine: null, false and the like read as the field left out) and the first
    refused one of each field are sent to the server."""
    bodies, seen = [], set()  # seen: the requests read, and the fields a refused body was sent for
    for path, base in BASES.items():
        for field in FIELDS:
            for value in VALUES:
                body = {**base, field: value}
                req = _parsed(server, path, body)
                if req is not None and req.params.max_tokens is None:
                    continue  # up to the context: the default model's seconds (test_server.py's max_tokens forms)
                key = repr(req) if req is not None else (path, field)
                if key not in seen:
                    bodies.append((path, body))
                    seen.add(key)
    assert len(bodies) < len(BASES) * len(FIELDS) * len(VALUES) / 8  # most bodies are refused or read alike

    async def all_cases() -> list:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            limit = asyncio.Semaphore(8)

            async def one(path: str, body: dict) -> tuple[str, dict, int, bytes]:
                async with limit, session.post(server.url + path, data=json.dumps(body)) as response:
                    return path, body, response.status, await response.read()

            return await asyncio.gather(*(one(path, body) for path, body in bodies))

    answered = 0
    for path, body, status, raw in asyncio.run(all_cases()):
        assert status in (200, 400, 404), (path, body, status, raw[:200])
        if status == 200:
            answered += 1
            reply = sse_events(raw)[-1] if raw.startswith(b"data: ") else orjson.loads(raw)
            assert reply == "[DONE]" or reply["object"] in ("text_completion", "chat.completion"), (path, body)
        else:
            _error(orjson.loads(raw))
    assert answered > 50  # the values that mean "nothing" (null, false, ...) are answered
    assert_serving(server)
    assert_serving(server, CHAT)


# ------------------------------------------------------------------------------------------- request bodies

def test_duplicate_keys_the_last_one_wins(server):
    """As Python's json module and JavaScript's JSON.parse (and so the openai client's own parser) read them."""
    data = b'{"prompt": "x", "max_tokens": 50, "ignore_eos": true, "max_tokens": 3}'
    status, _, raw = request(server, "POST", COMPLETIONS, data=data)
    assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 3
    data = b'{"prompt": "x", "max_tokens": 3, "max_tokens": 0}'
    status, _, raw = request(server, "POST", COMPLETIONS, data=data)
    assert status == 400 and _error(orjson.loads(raw))["param"] == "max_tokens"


def test_fields_of_the_other_endpoint_are_refused(server, client):
    """Ignored like unknown fields, they changed the answer without a word: max_completion_tokens on
    /v1/completions gave 16 tokens, top_logprobs no logprobs, a prompt on chat was never read."""
    cases = [(COMPLETIONS, {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens"),
             (COMPLETIONS, {"prompt": "x", "logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
             (COMPLETIONS, {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
             (CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "prompt")]
    for path, body, param in cases:
        status, reply = post(server, path, body)
        assert status == 400 and _error(reply)["param"] == param, (body, reply)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", extra_body={"max_completion_tokens": 3})
    assert "max_tokens" in info.value.message
    for path, body in ((COMPLETIONS, {"prompt": "x", "max_completion_tokens": None, "top_logprobs": None,
                                      "messages": None, "max_tokens": 2}),
                       (CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt": None, "max_tokens": 2})):
        status, reply = post(server, path, body)  # null is the same as leaving the field out
        assert status == 200, reply


def test_function_calling_fields_refused_in_every_form(server):
    """The legacy function_call forcing a function, and tools/functions that are not arrays, were accepted and
    ignored (only non-empty arrays were refused)."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for fields, param, code in ((dict(function_call={"name": "f"}), "function_call", "unsupported_parameter"),
                                (dict(function_call="required"), "function_call", "unsupported_parameter"),
                                (dict(tools={"type": "function"}), "tools", None),
                                (dict(functions="f"), "functions", None),
                                (dict(tools=True), "tools", None)):
        status, reply = post(server, CHAT, {**base, **fields})
        assert status == 400, (fields, reply)
        assert _error(reply)["param"] == param and _error(reply)["code"] == code, (fields, reply)
    for fields in (dict(function_call="none"), dict(function_call="auto", functions=[]), dict(tools=None)):
        status, reply = post(server, CHAT, {**base, **fields})
        assert status == 200, (fields, reply)


def test_message_name_must_be_a_string(server):
    for name in (5, ["a"], {"a": 1}, True):
        status, reply = post(server, CHAT, {"messages": [{"role": "user", "content": "hi", "name": name}],
                                            "max_tokens": 2})
        assert status == 400 and _error(reply)["param"] == "messages[0].name", (name, reply)
    status, reply = post(server, CHAT, {"messages": [{"role": "user", "content": "hi", "name": "ann"},
                                                     {"role": "user", "content": "hi", "name": None}],
                                        "max_tokens": 2})
    assert status == 200, reply


@pytest.mark.parametrize(("flag", "expected"), [([], 60.0), (["--send-timeout", "2.5"], 2.5),
                                                (["--send-timeout", "0"], None)])
def test_serve_command_passes_the_send_timeout(flag, expected, monkeypatch):
    """`colibri serve --send-timeout` reaches the server (0: wait for ever); left out, the server's default."""
    from colibri_stream import cli
    from colibri_stream.server import serving

    given = {}
    monkeypatch.setattr(serving, "run_server", lambda *args, **kwargs: given.update(kwargs))
    args = cli.build_parser().parse_args(["serve", *flag])
    args.run(args)
    assert given.get("send_timeout", serving.DEFAULT_SEND_TIMEOUT_SECONDS) == expected
