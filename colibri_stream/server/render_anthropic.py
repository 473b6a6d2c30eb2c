"""Replies of Anthropic's Messages API (`POST /v1/messages`, parse_anthropic.py): the message, or its stream of
named SSE events.

The reply is a message whose content blocks are, in order: thinking (the reply's <think> text, where it has any),
text (unless the reply is only tool calls), tool_use per call; its stop_reason is tool_use, max_tokens,
stop_sequence (naming the stop_sequence) or end_turn. A stream sends Anthropic's named events: message_start,
ping, then per block content_block_start, content_block_delta (thinking_delta, text_delta, input_json_delta) and
content_block_stop, then message_delta (stop_reason, usage) and message_stop. A block opens with its first text;
an "auto" call's tool_use block opens as the model writes the call, its input following in input_json_delta
pieces (as tool_syntax's stream reader lets them out: Hermes, Qwen3-Coder and Mistral calls piece by piece, the
other syntaxes' whole once the text is), and what went out as a call stays one, as chat streams it; a forced
call's block comes at the end, once its text is whole. An error after the stream has opened goes out as an
`error` event.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

from ..errors import APIError
from .admission import Admission
from .generate_request import GenerateRequest
from .reply_text import ReplyPiece, ReplyText
from .sse import NamedEventStream

MESSAGES_PATH = "/v1/messages"
# Anthropic's error type for an HTTP status; other 4xx are invalid_request_error, other 5xx api_error
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}

# The server's error codes that Anthropic's API names too: sent as the error's details.error_code, on which its
# clients branch (the SDK's message threads go on without a thread after thread_unsupported_request).
THREAD_UNSUPPORTED = "thread_unsupported_request"
DETAILED_CODES = (THREAD_UNSUPPORTED,)

VERSION_HEADER = "anthropic-version"  # sent by Anthropic's clients with every request


def model_info(model_id: str, created: int) -> dict:
    """A model as Anthropic's Models API lists it (`ModelInfo`), `created` in seconds since the epoch."""
    created_at = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": created_at}


def is_messages_path(path: str) -> bool:
    """Whether `path` is one of the Messages API's (whose errors and streams are in Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(error: APIError) -> dict:
    """An error as Anthropic answers it: {"type": "error", "error": {"type", "message"}}, with "details":
    {"error_code"} where the error's code is one of Anthropic's (DETAILED_CODES)."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    body = {"type": kind, "message": error.message}
    if error.code in DETAILED_CODES:
        body["details"] = {"error_code": error.code}
    return {"type": "error", "error": body}


class MessagesResponder:
    """Turns one /v1/messages request's RequestOutputs into Anthropic's message or its stream events.

    The reply's text goes through reply_text.py's stage: the reasoning split runs as the reply comes, and so does
    the reading of "auto" calls when streaming; otherwise the calls are read once the reply is whole.
    """

    framing = NamedEventStream  # its stream's SSE framing

    def __init__(self, request: GenerateRequest, model: str):
        self.request = request
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex
        self._reply: ReplyText | None = None  # the reply's text, once admitted
        self._input_tokens = self._output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None
        self._open: str | None = None  # streaming: the type of the content block open now
        self._opened: list[str] = []  # streaming: the type of each content block opened so far

    def admitted(self, admission: Admission) -> None:
        """The prompt as admitted (before any output): its token count, whether the reply starts thinking."""
        self._input_tokens = admission.prompt_tokens[0]
        self._reply = ReplyText(self.request, admission.thinking_started)

    def response(self) -> dict:
        """The message, once generation has ended."""
        reply = self._reply.whole()
        calls = reply.calls or []
        blocks = [_thinking_block(reply.reasoning)] if reply.reasoning else []
        if reply.content or not calls:
            blocks.append({"type": "text", "text": reply.content})
        blocks += [dict(_tool_use_block(call), input=json.loads(call["function"]["arguments"])) for call in calls]
        return self._message(blocks, done=True)

    def _message(self, content: list[dict], done: bool) -> dict:
        stop_reason, stop_sequence = self._stop() if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage()}

    def _stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the whole reply."""
        if self._reply.called:
            return "tool_use", None
        if self._finish_reason == "length":
            return "max_tokens", None
        if isinstance(self._stop_reason, str):  # one of stop_sequences (a stop token has an int id)
            return "stop_sequence", self._stop_reason
        return "end_turn", None

    def _usage(self) -> dict:
        return {"input_tokens": self._input_tokens, "output_tokens": self._output_tokens}

    # streaming

    def opening(self) -> list[dict]:
        """The events before any text: message_start (no content yet) and a ping."""
        return [{"type": "message_start", "message": self._message([], done=False)}, {"type": "ping"}]

    def add(self, output: Any, prompt_index: int = 0) -> ReplyPiece:
        """Record one RequestOutput; returns what of its text may go out now."""
        self._input_tokens, self._output_tokens = output.prompt_tokens, output.completion_tokens
        self._finish_reason, self._stop_reason = output.finish_reason, output.stop_reason
        return self._reply.feed(output.text, len(output.token_ids), output.finished)

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the events of the reasoning, the text and the calls' pieces that may go out
        now ("auto" calls as they are written; a forced call's tool_use block, or its text where max_tokens cut it,
        with the last output)."""
        piece = self.add(output, prompt_index)
        return self._delta("thinking", piece.reasoning) + self._delta("text", piece.content) + \
            self._call_events(piece.calls)

    def closing(self) -> list[dict]:
        """The events after the last output: the empty text block of a reply that has no other, the open block's
        end, message_delta and message_stop."""
        events = []
        if not {"text", "tool_use"} & set(self._opened):  # (a message has a text block, empty if need be)
            events += self._stop_block() + self._start_block({"type": "text", "text": ""})
        stop_reason, stop_sequence = self._stop()
        return events + self._stop_block() + [{"type": "message_delta", "usage": self._usage(),
                                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}},
                                              {"type": "message_stop"}]

    @staticmethod
    def stream_error(error: APIError) -> list[dict]:
        """The events that end a stream on an error once its 200 has gone out: Anthropic's error event."""
        return [error_body(error)]

    def _call_events(self, calls: list[dict]) -> list[dict]:
        """The events of chat's tool_calls entries or of their stream pieces (tool_syntax's): an entry with an id
        opens that call's tool_use block, its arguments' text goes out as input_json_delta."""
        events = []
        for call in calls:
            if "id" in call:
                events += self._stop_block() + self._start_block(dict(_tool_use_block(call), input={}))
            if call["function"].get("arguments"):
                events.append(self._block_event("content_block_delta", delta={
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return events

    def _delta(self, kind: str, text: str) -> list[dict]:
        """The events of `text` going out in a block of `kind` ("thinking" or "text"), opening it where needed."""
        if not text:
            return []
        events = [] if self._open == kind else self._stop_block() + self._start_block(
            _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                           "text": text}
        return events + [self._block_event("content_block_delta", delta=delta)]

    def _start_block(self, block: dict) -> list[dict]:
        self._open = block["type"]
        self._opened.append(block["type"])
        return [self._block_event("content_block_start", content_block=block)]

    def _stop_block(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [self._block_event("content_block_stop")]

    def _block_event(self, kind: str, **fields: Any) -> dict:
        """An event of the block opened last."""
        return {"type": kind, "index": len(self._opened) - 1, **fields}


def _tool_use_block(call: dict) -> dict:
    """The tool_use block of a chat tool_calls entry (its input left to the caller)."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"]}


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # (no signature: nothing is encrypted)
