"""What the server's handlers share: the engine, the options, the metrics, the requests in flight, and the
answers every route gives alike (a JSON body, a model that is not served)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ..errors import APIError
from ..metrics import ServerMetrics
from .fill_in_middle import fim_tokens_of
from .harmony import HARMONY_TOOL_SYNTAX, HarmonyToolSyntax, harmony_in
from .reasoning import reasoning_tags_in
from .tool_syntax import ToolSyntax, tool_syntax_of

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_KEEPALIVE_SECONDS = 10.0
DEFAULT_SEND_TIMEOUT_SECONDS = 60.0  # a stream whose client reads nothing for this long is aborted


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
    def tool_syntax(self) -> ToolSyntax | HarmonyToolSyntax | None:
        """The tool-call syntax the model's chat template teaches, which tool_choice "auto" reads (harmony's for a
        gpt-oss template: it also tells the parsers to read replies by channel); None: none."""
        return HARMONY_TOOL_SYNTAX if harmony_in(self.chat_templates) else tool_syntax_of(self.chat_templates)

    @functools.cached_property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The model's fill-in-the-middle tokens, which completions with a suffix need; None: it has none."""
        return fim_tokens_of(self.engine.tokenizer.token_to_id)

    @functools.cached_property
    def split_reasoning(self) -> bool:
        """Whether chat replies' reasoning goes to reasoning_content: a template with the <think> tags unless the
        option is off; harmony's channels always, since a harmony reply is read by channel or not at all (its
        final answer and its tool calls are messages of their own)."""
        return harmony_in(self.chat_templates) or (self.reasoning_parser and reasoning_tags_in(self.chat_templates))

    @functools.cached_property
    def token_piece(self) -> Callable[[int], tuple[str, bytes]]:
        """A token id's text and bytes, for logprobs (memoised: a vocabulary is small)."""
        tokenizer = self.engine.tokenizer

        @functools.cache
        def piece(token_id: int) -> tuple[str, bytes]:
            return tokenizer.decode([token_id], skip_special_tokens=False), tokenizer.token_bytes(token_id)

        return piece


STATE = web.AppKey("state", ServerState)


def count_request(request: web.Request, status: int) -> None:
    """Count an answered request by route and status: its route's path, that of the route a method it does not
    take was sent to (a 405), else "unmatched"."""
    resource = request.match_info.route.resource
    if resource is not None:
        route = resource.canonical
    else:  # no route took it: a path no route has, or a method the path's routes do not take
        known = {r.canonical for r in request.app.router.resources()}
        route = request.path if request.path in known else "unmatched"
    count_status(request.app, route, status)


def count_status(app: web.Application, route: str, status: int) -> None:
    app[STATE].metrics.requests.labels(route, str(status)).inc()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


async def on_worker(work: Callable[[], Any]) -> Any:
    """work() on a worker thread: checks and texts of millions of tokens, which would stall the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, work)
