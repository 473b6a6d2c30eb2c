"""Serving the app: aiohttp's connection handling with malformed HTTP answered in OpenAI's shape and slow request
heads timed out, the drain, and `run_server`, the blocking entry point of `colibri serve`."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from ..errors import APIError, RequestsAbortedError
from .app import create_app
from .error_replies import error_response
from .read_body import unreadable_encoding
from .state import (DEFAULT_KEEPALIVE_SECONDS, DEFAULT_MAX_BODY_BYTES, DEFAULT_SEND_TIMEOUT_SECONDS, STATE,
                    count_status)

log = logging.getLogger(__name__)

DEFAULT_REQUEST_HEAD_TIMEOUT_SECONDS = 60.0  # a connection waiting this long for a request's headers is closed


class _RequestHandler(web.RequestHandler):
    """aiohttp's connection protocol, answering what its HTTP parser refuses before any route runs (a header line
    over 8190 bytes, more than 128 headers, an unknown method, Content-Length with chunked, TLS on this port) in
    OpenAI's error shape rather than text/plain, and logging it on one debug line rather than as an error with a
    traceback: any client can send those, so they must not fill the log (nor can a body whose coding does not
    decode)."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for an error response
            raise ConnectionError("the response had started; no error can be sent")
        if status >= 500:  # a bug, not the client: logged with the traceback
            self.log_exception("error handling a request from %s", request.remote, exc_info=exc)
            error = APIError(status, "internal server error", type="server_error")
        elif isinstance(exc, ContentEncodingError):  # a coding the parser has no decoder for (br, zstd)
            self.logger.debug("refused a body coding from %s: %s", request.remote, exc)
            error = unreadable_encoding(None)  # the parser kept no headers
        else:
            self.logger.debug("refused a malformed HTTP request from %s: %s", request.remote, exc)
            reason = getattr(exc, "message", None) or message or "malformed HTTP request"
            error = APIError(status, f"malformed HTTP request: {str(reason)[:300]}", code="bad_http_request")
        app = getattr(self._manager, "app", None)  # (the _Server's: see _AppRunner)
        if app is not None:  # refused before any route: counted as a request no route took
            count_status(app, "unmatched", error.status)
        response = error_response(error)
        response.force_close()  # as aiohttp: the connection's state is unknown
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A body that did not decode (read_body answered it with a 400) raises again when aiohttp reads the rest of
        # it after the answer: one debug line, not a traceback per request that any client could send.
        if isinstance(kw.get("exc_info"), web.RequestPayloadError):
            self.logger.debug("dropped the rest of a body that could not be read: %s", kw["exc_info"])
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    """aiohttp's connection manager, whose connections answer malformed HTTP in OpenAI's shape (`_RequestHandler`)
    and are closed once they have waited `request_head_timeout` seconds for a request's line and headers: from the
    connection's start, or from its last answer, however the bytes trickle in (a client that sends its headers
    slowly, slowloris, holds a socket that long at most; an idle keep-alive connection is closed after it too).
    A connection is checked every `request_head_timeout` seconds while it waits, and every second while a request
    runs, so one that waits is closed between one and two timeouts after its wait began."""

    request_head_timeout: float | None = None  # set by _AppRunner; None: wait for ever
    app: web.Application | None = None  # the app its requests go to (its request counter), set by _AppRunner

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        handler.__class__ = _RequestHandler  # same slots: only handle_error differs
        return handler

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if self.request_head_timeout is not None:
            self._check_head(handler, None)

    def _check_head(self, handler: web.RequestHandler, heads_read: int | None) -> None:
        """Close `handler`'s connection if it has waited for a request's head since the last check, which saw
        `heads_read` heads read (None: the first check, or one while a request ran); else check again later."""
        if handler.transport is None:  # closed
            return
        heads = handler._request_count  # (aiohttp's count of the heads its parser has read on this connection)
        waiter = handler._waiter  # (set while the connection waits for a request)
        waiting = waiter is not None and not waiter.done()
        if waiting and heads == heads_read:
            handler.logger.debug("closed a connection that sent no whole request head in %.3g s",
                                 self.request_head_timeout)
            handler.force_close()
            return
        delay = self.request_head_timeout if waiting else min(1.0, self.request_head_timeout)
        asyncio.get_running_loop().call_later(delay, self._check_head, handler, heads if waiting else None)


class _AppRunner(web.AppRunner):
    """The app's runner, whose connections answer malformed HTTP in OpenAI's shape and time out slow request heads
    (`_Server`)."""

    def __init__(self, app: web.Application, *, request_head_timeout: float | None, **options: Any):
        super().__init__(app, **options)
        self._request_head_timeout = request_head_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        with contextlib.suppress(TypeError):  # an aiohttp whose Server has a layout of its own: its text errors
            server.__class__ = _Server
            server.request_head_timeout = self._request_head_timeout
            server.app = self.app
        return server


async def serve(app: web.Application, host: str, port: int, shutdown_timeout: float = 5.0,
                request_head_timeout: float | None = DEFAULT_REQUEST_HEAD_TIMEOUT_SECONDS) -> tuple[web.AppRunner, int]:
    """Start the app (and so the engine) and listen on host:port (0: any free port); returns the runner and port.
    A connection that waits `request_head_timeout` seconds for a request's head is closed (`_Server`)."""
    runner = _AppRunner(app, request_head_timeout=request_head_timeout, handler_cancellation=True,
                        shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


async def drain(app: web.Application, timeout: float | None = None) -> bool:
    """Refuse new generation requests (503) and wait until those in flight have finished; False on timeout."""
    state = app[STATE]
    state.draining = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


def run_server(engine_config: dict[str, Any], host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               cors_origins: tuple[str, ...] | list[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               served_model_name: str | None = None, drain_timeout: float | None = 300.0,
               keepalive_interval: float = DEFAULT_KEEPALIVE_SECONDS, trace_file: str | None = None,
               send_timeout: float | None = DEFAULT_SEND_TIMEOUT_SECONDS, reasoning_parser: bool = True) -> None:
    """Load the engine and serve until SIGTERM or SIGINT (blocking; on uvloop when it is installed).

    engine_config: the keyword arguments of AsyncEngine.from_pretrained, the model folder as "path", and
    data_parallel (replicas.load_engine: that many engine replicas behind this server, default 1) and
    expert_parallel (the routed experts sharded over that many rank processes, expert_group.py). The first
    signal drains (running requests finish, new ones get 503, up to drain_timeout seconds, then the rest are
    aborted); a second one stops at once. Raises RequestsAbortedError (`colibri serve` exits non-zero) when it
    stopped with requests still running.
    """
    from ..async_engine import run
    from ..replicas import load_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if api_key is None and not _is_loopback(host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    engine = load_engine(**engine_config)
    app = create_app(engine, api_key=api_key, served_model_name=served_model_name, cors_origins=cors_origins,
                     max_body_bytes=max_body_bytes, keepalive_interval=keepalive_interval, trace_file=trace_file,
                     send_timeout=send_timeout, reasoning_parser=reasoning_parser)
    run(_serve_until_signal(app, host, port, drain_timeout))


async def _serve_until_signal(app: web.Application, host: str, port: int, drain_timeout: float | None) -> None:
    """Serve until a signal, drain (a second signal or `drain_timeout` ends the drain) and stop; raises
    RequestsAbortedError, once stopped, where requests were still running."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    runner, bound = await serve(app, host, port)
    log.info("serving %s on http://%s:%d/v1", app[STATE].model_name, host, bound)
    aborted, why = 0, ""
    try:
        await signalled.wait()
        signalled.clear()
        log.info("draining: %d requests in flight; new requests get 503", app[STATE].active)
        draining = asyncio.ensure_future(drain(app, drain_timeout))
        second = asyncio.ensure_future(signalled.wait())
        done, _ = await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
        drained = draining in done and draining.result()
        draining.cancel()
        second.cancel()
        if not drained:
            aborted = app[STATE].active
            why = "a second signal came" if second in done else f"the drain timeout ({drain_timeout:g} s) passed"
            log.warning("stopping with %d requests still in flight; they are aborted", aborted)
            await app[STATE].engine.stop(drain=False)
    finally:
        await runner.cleanup()
        log.info("stopped")
    if aborted:
        raise RequestsAbortedError(f"stopped with {aborted} request{'s' if aborted > 1 else ''} aborted: {why}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False
