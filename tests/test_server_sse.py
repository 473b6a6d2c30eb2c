"""The SSE stream's send timeout (server/sse.py) on a real aiohttp server over loopback, against a client that stops
reading: its write waits, and keep-alives fall due beside that write."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from colibri_stream.server.sse import EventStream

SEND_TIMEOUT = 0.3
KEEPALIVE_INTERVAL = 0.05  # keep-alives fall due many times while a write waits


async def _stalled_stream() -> tuple[float, str, int]:
    """Serve one endless stream to a client that reads nothing; (seconds until the stream's write raised, the
    error's message, events sent)."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future = loop.create_future()

    async def endless(request: web.Request) -> web.StreamResponse:
        stream = EventStream(request, KEEPALIVE_INTERVAL, SEND_TIMEOUT)
        await stream.open()
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        start, sent = loop.time(), 0
        try:
            while loop.time() - start < 30:
                await stream.send({"text": "x" * 4000})
                sent += 1
        except ConnectionResetError as error:
            outcome.set_result((loop.time() - start, str(error), sent))
        finally:
            stream.stop_keepalive()
        return stream.response

    app = web.Application()
    app.router.add_get("/", endless)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    client = socket.socket()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(runner.addresses[0][:2])
        client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return await asyncio.wait_for(outcome, 10)
    finally:
        client.close()
        await runner.cleanup()


def test_a_write_that_waits_past_the_send_timeout_drops_the_stream_while_keepalives_are_due():
    """The watchdog times the oldest write in progress: keep-alives written beside a waiting write (they go into the
    buffer without waiting) neither end nor restart its timeout."""
    seconds, message, sent = asyncio.run(_stalled_stream())
    assert sent > 0  # the buffers filled first
    assert message == f"the client took nothing for {SEND_TIMEOUT:g} s"
    assert SEND_TIMEOUT <= seconds < SEND_TIMEOUT + 2
