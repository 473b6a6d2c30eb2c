"""Server-sent events framing: OpenAI's chat and completions streams (`data: <json>\\n\\n` events, `data: [DONE]` at
the end), and the streams whose events are named by their type, without `[DONE]` (OpenAI's Responses, Anthropic's
Messages: `NamedEventStream`); comment keep-alives in both."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # a comment line: clients skip it; proxies and client read timeouts see bytes


def encode_event(payload: dict) -> bytes:
    """One SSE event carrying `payload` as compact JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream:
    """An SSE response that sends a keep-alive comment whenever `keepalive_interval` seconds pass without an event.

    Writing to a client that went away raises ConnectionResetError; so does a write that waits more than
    `send_timeout` seconds for the client to take what was sent before (a client that stopped reading: the
    socket's and the transport's buffers are full), which also closes the connection.

    Writes are timed by one watchdog timer per stream rather than a timer per write: a write notes when it began,
    and the watchdog, armed by the first write after it last fired, checks the oldest write in progress (the
    handler's, or a keep-alive's beside it) when that one would time out (a write that does not wait, nearly every
    one, costs a clock read).
    """

    def __init__(self, request: web.Request, keepalive_interval: float, send_timeout: float | None = None):
        self._request = request
        self._interval = keepalive_interval
        self._send_timeout = send_timeout
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, once open
        self._last_write = 0.0
        self._write_starts: list[float] = []  # loop times the writes in progress began, oldest first
        self._watchdog: asyncio.TimerHandle | None = None
        self._timed_out = False
        self._keepalive: asyncio.Task | None = None
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
        })

    async def open(self) -> None:
        """Send the 200 and the headers, and start the keep-alives."""
        await self.response.prepare(self._request)
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()
        self._keepalive = asyncio.create_task(self._keep_alive())

    async def send(self, payload: dict) -> None:
        await self._write(encode_event(payload))

    async def close(self) -> None:
        """Stop the keep-alives, send `data: [DONE]` and end the body."""
        self.stop_keepalive()
        await self._write(DONE)
        await self._timed(self.response.write_eof())

    def stop_keepalive(self) -> None:
        """Stop the keep-alives and the watchdog (a later write arms it again)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def _write(self, data: bytes) -> None:
        self._last_write = self._loop.time()
        await self._timed(self.response.write(data))

    async def _timed(self, write: Any) -> None:
        """Await a write; past send_timeout, drop the connection (what is still buffered cannot be taken back)."""
        if self._send_timeout is None:
            await write
            return
        now = self._loop.time()
        self._write_starts.append(now)
        if self._watchdog is None:
            self._watchdog = self._loop.call_at(now + self._send_timeout, self._check_write)
        try:
            await write
        finally:
            self._write_starts.remove(now)
        if self._timed_out:  # the watchdog aborted the connection, which ended the wait
            raise ConnectionResetError(f"the client took nothing for {self._send_timeout:g} s")

    def _check_write(self) -> None:
        """The watchdog: drop the connection if the oldest write in progress has waited send_timeout seconds, else
        check again when it would have; with no write in progress, rest until the next write."""
        self._watchdog = None
        if not self._write_starts:
            return
        oldest = self._write_starts[0]
        if self._loop.time() - oldest < self._send_timeout:
            self._watchdog = self._loop.call_at(oldest + self._send_timeout, self._check_write)
            return
        self._timed_out = True
        if self._request.transport is not None:
            self._request.transport.abort()

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):  # the client left: the handler finds out on its next write
            while True:
                delay = self._last_write + self._interval - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await self._write(KEEPALIVE)


class NamedEventStream(EventStream):
    """The framing of OpenAI's Responses and Anthropic's Messages streams: each event named by its type
    (`event: response.created` ...), and no `[DONE]`."""

    async def send(self, payload: dict) -> None:
        await self._write(b"event: " + payload["type"].encode() + b"\n" + encode_event(payload))

    async def close(self) -> None:
        self.stop_keepalive()
        await self._timed(self.response.write_eof())
