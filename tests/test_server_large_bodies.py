"""A large request body is read as JSON and parsed off the event loop: a chat of 25 000 messages (0.8 MB, the
parse of which takes as long as its JSON reading and more) holds the server's loop up for less than its whole
parse does, and gets the same answer as a small body does. A body of more JSON values than the server reads at
once (read_body.MAX_JSON_WEIGHT) is a 413 before it is read, on every route that reads JSON, so it holds the
loop up for no longer than counting its bytes takes."""

from __future__ import annotations

import asyncio
import threading
import time

import orjson
import pytest
from test_server import CHAT, post, request

from colibri_stream.server.parse_openai import parse_chat
from colibri_stream.server.read_body import CONTAINER_WEIGHT, MAX_JSON_WEIGHT

LARGE_CHAT = {"messages": [{"role": "user", "content": "a"}] * 25_000, "max_tokens": 1}  # 0.8 MB of JSON
ATTEMPTS = 3  # a busy machine pauses at random: the measurement is tried up to this many times


async def _longest_pause(stop: threading.Event) -> float:
    """The longest a 1 ms sleep on this loop waits for the loop, until `stop` is set."""
    longest, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def _parse_seconds(raw: bytes) -> tuple[float, float]:
    """(reading the JSON, parsing the chat) of `raw`, as the server does them, timed here."""
    start = time.perf_counter()
    body = orjson.loads(raw)
    read = time.perf_counter()
    parse_chat(body)
    return read - start, time.perf_counter() - read


def test_a_large_chat_is_parsed_off_the_event_loop(tiny_server):
    raw = orjson.dumps(LARGE_CHAT)
    seen = []
    for _ in range(ATTEMPTS):
        reading, parsing = _parse_seconds(raw)
        stop = threading.Event()
        pause = asyncio.run_coroutine_threadsafe(_longest_pause(stop), tiny_server.loop)
        status, reply = post(tiny_server, CHAT, None, data=raw, headers={"Content-Type": "application/json"})
        stop.set()
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        longest = pause.result(10)
        # orjson keeps the GIL while it reads; building the chat's messages lets the loop run between its slices
        if longest < reading + parsing / 2:
            return
        seen.append((longest, reading, parsing))
    pytest.fail(f"(the loop's longest pause, reading the JSON, parsing it) in s: {seen}")


def test_a_large_body_gets_the_answer_a_small_one_does(tiny_server):
    """The same refusals whichever thread parses: a bad field deep in a large body names it."""
    messages = [{"role": "user", "content": "a"}] * 20_000 + [{"role": "robot", "content": "a"}]
    status, reply = post(tiny_server, CHAT, {"messages": messages, "max_tokens": 1})
    assert status == 400 and reply["error"]["param"] == "messages[20000].role", reply
    status, reply = post(tiny_server, CHAT, {"messages": messages[-1:], "max_tokens": 1})
    assert status == 400 and reply["error"]["param"] == "messages[0].role", reply


def _arrays(count: int) -> bytes:
    """A chat body whose field the server ignores holds `count` empty arrays."""
    return b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "x": [' + b"[]," * (count - 1) + b"[]]}"


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/tokenize"])
def test_a_body_of_too_many_json_values_is_a_413_before_it_is_read(tiny_server, path):
    """4 MB of empty arrays: reading them would hold the GIL, and so every other stream, for the whole reading."""
    raw = _arrays(1_300_000)
    start = time.perf_counter()
    orjson.loads(raw)
    reading = time.perf_counter() - start
    seen = []
    for _ in range(ATTEMPTS):
        stop = threading.Event()
        pause = asyncio.run_coroutine_threadsafe(_longest_pause(stop), tiny_server.loop)
        status, _, body = request(tiny_server, "POST", path, data=raw, headers={"Content-Type": "application/json"})
        stop.set()
        reply = orjson.loads(body)
        assert status == 413 and "too many JSON values" in reply["error"]["message"], reply
        # Anthropic's error shape on the Messages API, OpenAI's elsewhere
        kind = reply["error"]["type"] if path == "/v1/messages" else reply["error"]["code"]
        assert kind == "request_too_large", reply
        longest = pause.result(10)
        if longest < reading / 2:
            break
        seen.append((longest, reading))
    else:
        pytest.fail(f"(the loop's longest pause, reading the JSON) in s: {seen}")
    status, reply = post(tiny_server, CHAT, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1})
    assert status == 200, reply


def test_a_body_within_the_json_values_limit_is_read(tiny_server):
    status, reply = post(tiny_server, CHAT, None, data=_arrays(MAX_JSON_WEIGHT // CONTAINER_WEIGHT - 10),
                         headers={"Content-Type": "application/json"})
    assert status == 200, reply
