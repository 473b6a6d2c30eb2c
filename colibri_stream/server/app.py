"""The OpenAI-compatible HTTP server over an AsyncEngine: routes, authentication, CORS, startup, drain, shutdown.

`create_app(engine, ...)` builds the aiohttp application (the app starts the engine on startup and stops it on
cleanup); `serve(app, host, port)` listens; `run_server(...)` is the blocking entry point of `colibri serve`.

A generation request is validated and admitted by the engine before anything is sent, so every refusal (a bad
field, an over-long prompt, a full queue, a draining server) is a plain JSON error even with `stream: true`.
Handlers run with aiohttp's handler cancellation: a client that disconnects cancels its handler, which aborts
the engine request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from .. import __version__
from ..errors import ColibriError, RequestsAbortedError
from ..metrics import ServerMetrics
from ..request import (
    EngineStoppedError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)
from ..timing import ChromeTraceWriter
from ..tokenizer import ChatTemplateError
from .anthropic_messages import error_body, is_messages_path, parse_count_tokens, parse_messages, switches_thinking
from .anthropic_replies import MessagesEventStream, MessagesResponder
from .fill_in_middle import fim_tokens_of
from .generations import Generations, PromptRefused
from .protocol import (
    APIError,
    GenerateRequest,
    Responder,
    bad_request,
    parse_chat,
    parse_completion,
)
from .reasoning import opens_thinking, reasoning_tags_in
from .responses import ResponsesResponder, parse_response
from .sse import EventStream
from .tokenize import LONG_TOKEN_LIST, TokenizeRequest, parse_detokenize, parse_tokenize, tokenize_body
from .tool_syntax import ToolSyntax, tool_syntax_of

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_KEEPALIVE_SECONDS = 10.0
DEFAULT_SEND_TIMEOUT_SECONDS = 60.0  # a stream whose client reads nothing for this long is aborted
DEFAULT_REQUEST_HEAD_TIMEOUT_SECONDS = 60.0  # a connection waiting this long for a request's headers is closed
RETRY_AFTER_SECONDS = 1  # a full queue's 429 says when to try again; the openai client waits that long, then retries
READABLE_ENCODINGS = ("identity", "gzip", "deflate")  # request bodies aiohttp decodes without extra packages


@dataclass
class ServerState:
    """What the handlers share: the engine, the options, the metrics and the requests in flight."""

    engine: Any
    model_name: str
    api_key: str | None
    keepalive_interval: float
    max_body_bytes: int
    metrics: ServerMetrics
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT_SECONDS
    reasoning_parser: bool = True  # split <think> text into reasoning_content where the template knows the tags
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    active: int = 0  # generation requests in flight
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    @contextlib.contextmanager
    def in_flight(self) -> Any:
        self.active += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()

    def decode(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens included (an echoed prompt given as ids)."""
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    @property
    def chat_templates(self) -> dict[str, str]:
        """The model's chat templates by name (none for a tokenizer without them)."""
        return getattr(self.engine.tokenizer, "chat_templates", {})

    @functools.cached_property
    def tool_syntax(self) -> ToolSyntax | None:
        """The tool-call syntax the model's chat template teaches, which tool_choice "auto" reads; None: none."""
        return tool_syntax_of(self.chat_templates)

    @functools.cached_property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The model's fill-in-the-middle tokens, which completions with a suffix need; None: it has none."""
        return fim_tokens_of(self.engine.tokenizer.token_to_id)

    @functools.cached_property
    def split_reasoning(self) -> bool:
        """Whether chat replies' <think> text goes to reasoning_content (the option, and a template with the tags)."""
        return self.reasoning_parser and reasoning_tags_in(self.chat_templates)

    def opens_thinking(self, prompt_token_ids: list[int]) -> bool:
        """Whether the rendered prompt leaves the reply inside the thinking tag."""
        return opens_thinking(self.decode(prompt_token_ids[-8:]))

    @functools.cached_property
    def token_piece(self) -> Callable[[int], tuple[str, bytes]]:
        """A token id's text and bytes, for logprobs (memoised: a vocabulary is small)."""
        tokenizer = self.engine.tokenizer

        @functools.cache
        def piece(token_id: int) -> tuple[str, bytes]:
            return tokenizer.decode([token_id], skip_special_tokens=False), tokenizer.token_bytes(token_id)

        return piece


# Fields from which a request's parse builds a grammar (llguidance: 0.2 s for a 3000-property schema, 0.9 s for 50000
# choices), so the parse runs on a worker thread
GRAMMAR_FIELDS = ("response_format", "text", "tools", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar", "output_config")
REQUEST_ID_HEADER = "X-Request-Id"
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # outside /v1/, behind the API key too
MAX_REQUEST_ID = 128  # characters of a client's own request id that are echoed back

STATE = web.AppKey("state", ServerState)
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
        web.post("/v1/chat/completions", chat_completions, expect_handler=_expect),
        web.post("/v1/completions", completions, expect_handler=_expect),
        web.post("/v1/responses", responses, expect_handler=_expect),
        web.post("/v1/messages", messages, expect_handler=_expect),
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
        response = _error_response(e, e.headers, request.path)
    except web.HTTPException as e:  # routing (404, 405), body too large (413), ...
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}
        response = _error_response(APIError(e.status, _http_message(e, request), code=_http_code(e.status)),
                                   headers, request.path)
    except asyncio.CancelledError:  # the client went away
        _count(request, 499)
        raise
    except Exception:
        log.exception("error while serving %s %s", request.method, request.path)
        response = _error_response(APIError(500, "internal server error", type="server_error"), path=request.path)
    _count(request, response.status)
    return response


def _count(request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.requests.labels(route, str(status)).inc()


def _http_message(e: web.HTTPException, request: web.Request) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path} (allowed: {e.headers.get('Allow', '')})"
    if e.status == 413:
        return _too_large(request.app[STATE]).message
    return e.reason


def _too_large(state: ServerState) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {state.max_body_bytes} bytes",
                    code="request_too_large")


def _http_code(status: int) -> str | None:
    return {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)


def _error_response(error: APIError, headers: dict[str, str] | None = None, path: str = "") -> web.Response:
    return _json(_error_body(error, path), error.status, headers)


def _error_body(error: APIError, path: str) -> dict:
    """The error's body in the shape of the API that `path` belongs to (OpenAI's, or Anthropic's)."""
    return error_body(error) if is_messages_path(path) else error.body()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


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
    return _json({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_model(state, request.match_info["model"])
    return _json(_model_card(state))


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "colibri",
            "max_model_len": state.engine.max_seq_len}


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return _json({"status": "draining"}, 503)
    if not state.engine.healthy:  # stopped after an error, or its last model step failed
        return _json({"status": "unhealthy"}, 503)
    return _json({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    """GET /version, as vLLM's: the server's version."""
    return _json({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


# --------------------------------------------------------------------------------------------------- generation

async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_chat, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning), _choices_responder)


async def completions(request: web.Request) -> web.StreamResponse:
    fim_tokens = request.app[STATE].fim_tokens
    return await _generate(request, functools.partial(parse_completion, fim_tokens=fim_tokens), _choices_responder)


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_response, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning),
                           lambda req, state: ResponsesResponder(req, state.model_name))


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages, Anthropic's Messages API (server/anthropic_messages.py)."""
    state = request.app[STATE]
    return await _generate(request, functools.partial(parse_messages, tool_syntax=state.tool_syntax,
                                                      split_reasoning=state.split_reasoning,
                                                      thinking_switch=switches_thinking(state.chat_templates)),
                           lambda req, state: MessagesResponder(req, state.model_name))


async def count_message_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens a /v1/messages request of the same fields would use."""
    state = request.app[STATE]
    req = parse_count_tokens(await _read_json(request), state.tool_syntax, switches_thinking(state.chat_templates))
    _check_model(state, req.model)
    return _json({"input_tokens": len(await _encode(state, req))})


def _choices_responder(req: GenerateRequest, state: ServerState) -> Responder:
    """The responder of chat and completions: choices of chunks or of a whole completion."""
    return Responder(req, state.model_name, state.token_piece, state.decode)


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (server/tokenize.py)."""
    state = request.app[STATE]
    req = parse_tokenize(await _read_json(request))
    _check_model(state, req.model)
    ids = await _encode(state, req)
    token_text = (lambda token_id: state.token_piece(token_id)[0]) if req.return_token_strs else None
    write = functools.partial(tokenize_body, ids, state.engine.max_seq_len, token_text)
    body = await _on_worker(write) if len(ids) > LONG_TOKEN_LIST else write()
    return web.Response(body=body, content_type="application/json")


async def _encode(state: ServerState, req: TokenizeRequest) -> list[int]:
    """The token ids of a tokenizer request's prompt, counted whatever its length (as vLLM's /tokenize: the
    answer says max_model_len); what the engine refuses is a 400."""
    try:
        return await state.engine.encode(req.prompt, req.add_special_tokens, req.tools, req.template_kwargs,
                                         fit_context=False)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from e
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (server/tokenize.py)."""
    state = request.app[STATE]
    body = await _read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    long = isinstance(tokens, list) and len(tokens) > LONG_TOKEN_LIST
    parse = functools.partial(parse_detokenize, body, state.engine.model_config.vocab_size)
    model, ids = await _on_worker(parse) if long else parse()
    _check_model(state, model)
    decode = functools.partial(state.decode, ids)
    return _json({"prompt": await _on_worker(decode) if long else decode()})


async def _on_worker(work: Callable[[], Any]) -> Any:
    """work() on a worker thread: checks and texts of millions of tokens, which would stall the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, work)


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info, as vLLM's: the tokenizer's class, its tokenizer_config.json fields, special tokens and
    chat template (what lm-evaluation-harness reads to tokenize through /tokenize instead of a download)."""
    return _json(request.app[STATE].engine.tokenizer.info())


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (curl sends it with bodies over 1 MiB): a body announced over the limit is refused
    before the client sends it; aiohttp's default answers "100 Continue" to anything. Runs before the middlewares,
    so it answers in OpenAI's shape itself."""
    state = request.app[STATE]
    if request.headers.get("Expect", "").lower() != "100-continue":
        error = APIError(417, f"unsupported Expect: {request.headers.get('Expect', '')[:64]!r}",
                         code="expectation_failed")
    elif request.content_length is not None and request.content_length > state.max_body_bytes:
        error = _too_large(state)
    else:
        if request.version >= (1, 1):  # as aiohttp's default handler
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response proper has not started
        return None
    response = _error_response(error, path=request.path)
    response.force_close()  # Connection: close: the client need not send the body to keep the connection
    _count(request, error.status)
    return response


async def _read_json(request: web.Request) -> Any:
    """The body as JSON whatever its Content-Type says (curl -d sends form-encoded); a body that cannot be read
    (a Content-Encoding it does not decode to) is a 400 like one that is not JSON. A Content-Length over the limit
    is a 413 before anything is read (aiohttp then reads and drops the body for up to 10 s, so that the client,
    which sends the whole body before it reads the answer, gets the 413 rather than a reset connection)."""
    state = request.app[STATE]
    if request.content_length is not None and request.content_length > state.max_body_bytes:
        raise _too_large(state)
    encoding = request.headers.get("Content-Encoding", "identity")
    if encoding.strip().lower() not in READABLE_ENCODINGS:
        raise _unreadable_encoding(encoding)
    try:
        raw = await request.read()
    except web.RequestPayloadError as e:
        raise bad_request(f"the request body could not be read: {_payload_error(e)}") from None
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _unreadable_encoding(encoding: str | None) -> APIError:
    """415 for a request body in a Content-Encoding (named when known) that this server does not decode."""
    named = "the request's Content-Encoding" if encoding is None else f"Content-Encoding {encoding.strip()[:100]!r}"
    return APIError(415, f"{named} is not supported: send the body as {', '.join(READABLE_ENCODINGS)}",
                    code="unsupported_content_encoding")


def _payload_error(error: web.RequestPayloadError) -> str:
    """What the body parser said, without aiohttp's "400, message:" prefix."""
    cause = error.__cause__
    return getattr(cause, "message", None) or str(cause or error)


async def _generate(request: web.Request, parse: Callable[[Any], GenerateRequest],
                    make_responder: Callable[[GenerateRequest, ServerState],
                                             Responder | ResponsesResponder | MessagesResponder]
                    ) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    body = await _read_json(request)
    if isinstance(body, dict) and any(body.get(name) for name in GRAMMAR_FIELDS):
        # building a grammar (a schema, a regex, thousands of choices) can take a second: off the event loop
        req = await asyncio.get_running_loop().run_in_executor(None, parse, body)
    else:
        req = parse(body)
    _check_model(state, req.model)
    responder = make_responder(req, state)
    generations = Generations(state.engine, responder.id)
    start = time.perf_counter()
    with state.in_flight():
        try:
            keep = req.truncate_prompt_tokens
            await generations.start(req.prompts, req.params, req.template_tools,
                                    state.engine.max_seq_len if keep == -1 else keep, req.template_kwargs)
            responder.admitted(generations.prompt_tokens)
            if req.split_reasoning:
                responder.thinking_started = state.opens_thinking(generations.prompt_token_ids[0])
            if req.stream:
                return await _stream(request, state, responder, generations)
            async for index, out in generations.outputs():
                state.metrics.observe(out)
                responder.add(out, index)
            return _json(responder.response())
        except ColibriError as e:
            raise _engine_error(e, req) from e
        finally:
            # Once the response is out the client may hang up and cancel this handler: aclose() does not wait then.
            state.metrics.e2e.observe(time.perf_counter() - start)
            await generations.aclose()


def _engine_error(error: BaseException, req: GenerateRequest) -> APIError:
    """The HTTP error for an engine refusal or failure (naming the prompt of a batch that it concerns)."""
    prompt_param = req.prompt_param or ("messages" if req.chat else "prompt")
    prompt = ""
    if isinstance(error, PromptRefused):
        prompt, error = f"prompt {error.index}: ", error.error
    if isinstance(error, PromptTooLongError):
        return bad_request(f"{prompt}this model's maximum context length is {error.max_seq_len} tokens: {error}",
                           param=prompt_param, code="context_length_exceeded")
    if isinstance(error, InvalidParameterError):  # SamplingParams' grammar: the field that asked for it
        param = req.grammar_param if error.param == "grammar" and req.grammar_param else error.param
        return bad_request(f"{prompt}{error}", param=param)
    if isinstance(error, ChatTemplateError):
        return bad_request(str(error), param=prompt_param)
    if isinstance(error, QueueFullError):
        return APIError(429, f"the server is busy: {error}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineStoppedError):
        return APIError(503, f"the engine is not accepting requests: {error}", type="server_error",
                        code="shutting_down")
    return APIError(500, f"generation failed: {error}", type="server_error")


async def _stream(request: web.Request, state: ServerState,
                  responder: Responder | ResponsesResponder | MessagesResponder,
                  generations: Generations) -> web.StreamResponse:
    """Send the request's outputs as SSE events (the responder's opening ones, one or none per output, its
    closing ones); keep-alive comments fill silences (a long prefill)."""
    framing = MessagesEventStream if is_messages_path(request.path) else EventStream
    stream = framing(request, state.keepalive_interval, state.send_timeout)
    try:
        await stream.open()
        for event in responder.opening():
            await stream.send(event)
        try:
            async for index, out in generations.outputs():
                state.metrics.observe(out)
                for event in responder.events(out, index):
                    await stream.send(event)
        except ColibriError as e:  # after the 200, an error travels in the stream
            await stream.send(_error_body(_engine_error(e, responder.request), request.path))
        else:
            for event in responder.closing():
                await stream.send(event)
        await stream.close()
    except ConnectionResetError as e:  # the client left or stopped reading; the caller aborts the request
        log.debug("client of %s disconnected: %s", responder.id, e)
    finally:
        stream.stop_keepalive()
    return stream.response


# --------------------------------------------------------------------------------------------- serving, drain

class _RequestHandler(web.RequestHandler):
    """aiohttp's connection protocol, answering what its HTTP parser refuses before any route runs (a header line
    over 8190 bytes, more than 128 headers, an unknown method, Content-Length with chunked, TLS on this port) in
    OpenAI's error shape rather than text/plain, and logging it on one debug line rather than as an error with a
    traceback: any client can send those, so they must not fill the log."""

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
            error = _unreadable_encoding(None)  # the parser kept no headers
        else:
            self.logger.debug("refused a malformed HTTP request from %s: %s", request.remote, exc)
            reason = getattr(exc, "message", None) or message or "malformed HTTP request"
            error = APIError(status, f"malformed HTTP request: {str(reason)[:300]}", code="bad_http_request")
        response = _error_response(error)
        response.force_close()  # as aiohttp: the connection's state is unknown
        return response


class _Server(web.Server):
    """aiohttp's connection manager, whose connections answer malformed HTTP in OpenAI's shape (`_RequestHandler`)
    and are closed once they have waited `request_head_timeout` seconds for a request's line and headers: from the
    connection's start, or from its last answer, however the bytes trickle in (a client that sends its headers
    slowly, slowloris, holds a socket that long at most; an idle keep-alive connection is closed after it too).
    A connection is checked every `request_head_timeout` seconds while it waits, and every second while a request
    runs, so one that waits is closed between one and two timeouts after its wait began."""

    request_head_timeout: float | None = None  # set by _AppRunner; None: wait for ever

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

    engine_config: the keyword arguments of AsyncEngine.from_pretrained, the model folder as "path". The first
    signal drains (running requests finish, new ones get 503, up to drain_timeout seconds, then the rest are
    aborted); a second one stops at once. Raises RequestsAbortedError (`colibri serve` exits non-zero) when it
    stopped with requests still running.
    """
    from ..engine import AsyncEngine, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if api_key is None and not _is_loopback(host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    engine = AsyncEngine.from_pretrained(**engine_config)
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
