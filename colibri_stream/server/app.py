"""The OpenAI-compatible HTTP server over an AsyncEngine: routes, authentication, CORS, startup, shutdown.

`create_app(engine, ...)` builds the aiohttp application (the app starts the engine on startup and stops it on
cleanup); serving.py listens, drains and runs `colibri serve`. A generation request goes parse -> admit -> engine
-> render (generate.py): each API's parser (parse_*.py) makes a GenerateRequest, admission.py tokenizes and
checks it once, reply_text.py splits the reply's text for every API's renderer (render_*.py).

A generation request is validated and admitted by the engine before anything is sent, so every refusal (a bad
field, an over-long prompt, a full queue, a draining server) is a plain JSON error even with `stream: true`.
Handlers run with aiohttp's handler cancellation: a client that disconnects cancels its handler, which aborts
the engine request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from .. import __version__
from ..errors import APIError
from ..metrics import ServerMetrics
from ..timing import ChromeTraceWriter
from .error_replies import error_response
from .generate import chat_completions, completions, messages, responses
from .read_body import expect_continue, too_large
from .render_anthropic import VERSION_HEADER, model_info
from .state import (DEFAULT_KEEPALIVE_SECONDS, DEFAULT_MAX_BODY_BYTES, DEFAULT_SEND_TIMEOUT_SECONDS, STATE, ServerState,
                    check_model, count_request, json_response)
from .tokenizer_routes import count_message_tokens, detokenize, tokenize, tokenizer_info

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # outside /v1/, behind the API key too
MAX_REQUEST_ID = 128  # characters of a client's own request id that are echoed back
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(engine: Any, *, api_key: str | None = None, served_model_name: str | None = None,
               cors_origins: tuple[str, ...] | list[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               keepalive_interval: float = DEFAULT_KEEPALIVE_SECONDS,
               send_timeout: float | None = DEFAULT_SEND_TIMEOUT_SECONDS,
               trace_file: str | None = None, reasoning_parser: bool = True) -> web.Application:
    """The server application for `engine` (not yet started: the app starts and stops it).

    api_key: required as `Authorization: Bearer <key>` on /v1/*; cors_origins: origins allowed to call from a
    browser ("*" for any); keepalive_interval: seconds of silence after which a stream sends an SSE comment;
    send_timeout: seconds a stream may wait for its client to take the bytes already sent before it is aborted
    (its engine request freed, the connection closed; None: wait for ever); trace_file: where to write every
    engine step's phases as a Chrome trace (closed when the app stops); reasoning_parser: a chat reply's
    <think> text goes to reasoning_content where the model's template knows the tags (server/reasoning.py).
    """
    middlewares: list[Any] = [_errors]
    if cors_origins:
        middlewares.append(_cors_preflight)
    middlewares.append(_authenticate)
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[STATE] = ServerState(engine=engine, model_name=served_model_name or engine.model_name, api_key=api_key,
                             keepalive_interval=keepalive_interval, max_body_bytes=max_body_bytes,
                             metrics=ServerMetrics(engine), send_timeout=send_timeout,
                             reasoning_parser=reasoning_parser)
    if cors_origins:
        app[_CORS_ORIGINS] = tuple(cors_origins)
        app.on_response_prepare.append(_cors_headers)
    app.on_response_prepare.append(_request_id_header)
    engine.add_step_sink(app[STATE].metrics.observe_step)
    if trace_file is not None:
        app.cleanup_ctx.append(functools.partial(_trace_lifetime, trace_file))
    app.cleanup_ctx.append(_engine_lifetime)
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions, expect_handler=expect_continue),
        web.post("/v1/completions", completions, expect_handler=expect_continue),
        web.post("/v1/responses", responses, expect_handler=expect_continue),
        web.post("/v1/messages", messages, expect_handler=expect_continue),
        web.post("/v1/messages/count_tokens", count_message_tokens),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/tokenizer_info", tokenizer_info),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", get_model),  # Hugging Face names hold a slash
        web.get("/health", health),
        web.get("/version", version),
        web.get("/metrics", metrics),
    ])
    return app


async def _trace_lifetime(path: str, app: web.Application) -> AsyncIterator[None]:
    """Trace the engine's steps while it runs (cleanups run in reverse order: the engine stops first)."""
    writer = ChromeTraceWriter(path)
    app[STATE].engine.add_step_sink(writer)
    yield
    writer.close()


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.engine.start()
    lag_watch = asyncio.create_task(state.metrics.watch_event_loop())
    yield
    lag_watch.cancel()
    await state.engine.close()


# ---------------------------------------------------------------------------------------------------- middlewares

@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape (Anthropic's on the Messages API's routes), and the request counter."""
    try:
        response = await handler(request)
    except APIError as e:
        response = error_response(e, e.headers, request.path)
    except web.HTTPException as e:  # routing (404, 405), body too large (413), ...
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}
        response = error_response(APIError(e.status, _http_message(e, request), code=_http_code(e.status)),
                                   headers, request.path)
    except asyncio.CancelledError:  # the client went away
        count_request(request, 499)
        raise
    except Exception:
        log.exception("error while serving %s %s", request.method, request.path)
        response = error_response(APIError(500, "internal server error", type="server_error"), path=request.path)
    count_request(request, response.status)
    return response


def _http_message(e: web.HTTPException, request: web.Request) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path} (allowed: {e.headers.get('Allow', '')})"
    if e.status == 413:
        return too_large(request.app[STATE]).message
    return e.reason


def _http_code(status: int) -> str | None:
    return {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)


@web.middleware
async def _authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The key on /v1/* and the tokenizer endpoints, as `Authorization: Bearer <key>` (OpenAI's clients) or
    `x-api-key: <key>` (Anthropic's); /health and /metrics stay open for probes and scrapers."""
    key = request.app[STATE].api_key
    if key is not None and (request.path.startswith("/v1/") or request.path in KEYED_PATHS):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and _is_key(token, key)
        if not (bearer or ("x-api-key" in request.headers and _is_key(request.headers["x-api-key"], key))):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'", code="invalid_api_key")
    return await handler(request)


def _is_key(given: str, key: str) -> bool:
    # aiohttp decodes header bytes that are not UTF-8 as surrogates: encode them back the same way
    return hmac.compare_digest(given.strip().encode(errors="surrogateescape"), key.encode())


_CORS_ORIGINS = web.AppKey("cors_origins", tuple)
_CORS_METHODS = "GET, POST, OPTIONS"


def _allowed_origin(request: web.Request) -> str | None:
    origin = request.headers.get("Origin")
    allowed = request.app[_CORS_ORIGINS]
    if origin is None:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


@web.middleware
async def _cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer browsers' preflight OPTIONS requests (before authentication: browsers send no key with them)."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        headers = {"Access-Control-Allow-Methods": _CORS_METHODS, "Access-Control-Max-Age": "600",
                   "Access-Control-Allow-Headers":
                       request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")}
        return web.Response(status=204, headers=headers)
    return await handler(request)


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer names its request in X-Request-Id, as OpenAI's and vLLM's do (the openai client reads it into
    `_request_id`): the client's own X-Request-Id when it sent a plain one, else a new id."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    plain = 0 < len(given) <= MAX_REQUEST_ID and all(c.isascii() and (c.isalnum() or c in "-_.:") for c in given)
    response.headers[REQUEST_ID_HEADER] = given if plain else uuid.uuid4().hex


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    origin = _allowed_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":
            response.headers.add("Vary", "Origin")


# ------------------------------------------------------------------------------------------------- small routes

async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: OpenAI's list, or Anthropic's page of models for Anthropic's clients (they send
    anthropic-version)."""
    state = request.app[STATE]
    if VERSION_HEADER in request.headers:
        return json_response({"data": [_model_card(request, state)], "has_more": False,
                              "first_id": state.model_name, "last_id": state.model_name})
    return json_response({"object": "list", "data": [_model_card(request, state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_model(state, request.match_info["model"])
    return json_response(_model_card(request, state))


def _model_card(request: web.Request, state: ServerState) -> dict:
    """The served model as OpenAI's (with vLLM's max_model_len) or, asked by Anthropic's clients, Anthropic's API
    describes a model."""
    if VERSION_HEADER in request.headers:
        return model_info(state.model_name, state.created)
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "colibri",
            "max_model_len": state.engine.max_seq_len}


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return json_response({"status": "draining"}, 503)
    if not state.engine.healthy:  # stopped after an error, or its last model step failed
        return json_response({"status": "unhealthy"}, 503)
    return json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    """GET /version, as vLLM's: the server's version."""
    return json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})
