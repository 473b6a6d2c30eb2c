"""Replies of Anthropic's Messages API (`POST /v1/messages`, anthropic_messages.py): the message, or its stream of
named SSE events.

The reply is a message whose content blocks are, in order: thinking (the reply's <think> text, where it has any),
text (unless the reply is only tool calls), tool_use per call; its stop_reason is tool_use, max_tokens, stop_sequence (naming the
stop_sequence) or end_turn. A stream sends Anthropic's named events: message_start, ping, then per block
content_block_start, content_block_delta (thinking_delta, text_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason, usage) and message_stop. A block opens with its first text; an "auto" call's
tool_use block opens as the model writes the call, its input following in input_json_delta pieces (as
tool_syntax's stream reader lets them out: Hermes calls piece by piece, the other syntaxes' whole once the text
is), and what went out as a call stays one, as chat streams it; a forced call's block comes at the end, once its
text is whole. An error after the stream has opened goes out as an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .protocol import GenerateRequest
from .reasoning import ThinkingStream
from .sse import EventStream, encode_event
from .tool_syntax import HeldCalls, StreamedCalls
from .tools import tool_calls


class MessagesEventStream(EventStream):
    """Anthropic's SSE framing: each event named by its type (`event: message_start` ...), and no `[DONE]`."""

    async def send(self, payload: dict) -> None:
        await self._write(b"event: " + payload["type"].encode() + b"\n" + encode_event(payload))

    async def close(self) -> None:
        self.stop_keepalive()
        await self._timed(self.response.write_eof())


class MessagesResponder:
    """Turns one /v1/messages request's RequestOutputs into Anthropic's message or its stream events.

    The reasoning split (split_reasoning) runs as the reply comes, and so does the reading of "auto" calls when
    streaming; otherwise the calls are read once the reply is whole.
    """

    def __init__(self, request: GenerateRequest, model: str):
        self.request = request
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex
        self.thinking_started = False  # with split_reasoning: the prompt leaves the reply inside the thinking tag
        self._thinking: ThinkingStream | None = None  # with split_reasoning: the reply's split so far
        self._reasoning: list[str] = []  # the reply's reasoning pieces
        self._content: list[str] = []  # and the rest
        auto = request.auto_calls
        # "auto", streaming: the calls read so far
        self._calls_read: StreamedCalls | HeldCalls | None = (auto.syntax.stream_reader(auto.schemas)
                                                              if auto is not None and request.stream else None)
        self._input_tokens = self._output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None
        self._reply: tuple[str, list[dict]] | None = None  # the text and its tool_calls, once the reply is whole
        self._open: str | None = None  # streaming: the type of the content block open now
        self._opened: list[str] = []  # streaming: the type of each content block opened so far

    def admitted(self, prompt_tokens: list[int]) -> None:
        """The prompt's token count, known once the engine has admitted it (before any output)."""
        self._input_tokens = prompt_tokens[0]

    def add(self, output: Any, prompt_index: int = 0) -> tuple[str, str]:
        """Record one RequestOutput; returns the reasoning and the content of its text that may go out now (the
        last output: with what the split held back)."""
        self._input_tokens, self._output_tokens = output.prompt_tokens, output.completion_tokens
        self._finish_reason, self._stop_reason = output.finish_reason, output.stop_reason
        reasoning, content = "", output.text
        if self.request.split_reasoning:
            self._thinking = self._thinking or ThinkingStream(self.thinking_started)
            reasoning, content = self._thinking.feed(output.text, len(output.token_ids))
            if output.finished:
                reasoning, content = (a + b for a, b in zip((reasoning, content), self._thinking.finish()))
        self._reasoning.append(reasoning)
        self._content.append(content)
        return reasoning, content

    def _whole_reply(self) -> tuple[str, list[dict]]:
        """(the text, its calls as chat's tool_calls entries) of the whole reply: a forced call's text is its call
        (unless cut by max_tokens), "auto" calls follow the text before them."""
        if self._reply is None:
            text, calls = "".join(self._content), None
            if self.request.forced_call is not None:
                calls = tool_calls(self.request.forced_call, text)
                text = "" if calls is not None else text
            elif self.request.auto_calls is not None:
                split = self.request.auto_calls.syntax.split(text, self.request.auto_calls.schemas)
                text, calls = split if split is not None else (text, None)
            self._reply = text, calls or []
        return self._reply

    def response(self) -> dict:
        """The message, once generation has ended."""
        text, calls = self._whole_reply()
        reasoning = "".join(self._reasoning)
        blocks = [_thinking_block(reasoning)] if reasoning else []
        if text or not calls:
            blocks.append({"type": "text", "text": text})
        blocks += [dict(_tool_use_block(call), input=json.loads(call["function"]["arguments"])) for call in calls]
        return self._message(blocks, done=True)

    def _message(self, content: list[dict], done: bool) -> dict:
        stop_reason, stop_sequence = self._stop() if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage()}

    def _stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the whole reply."""
        called = (self._calls_read.calls and self._calls_read.whole) if self._calls_read else self._whole_reply()[1]
        if called:
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

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the events of the reasoning, the text and the "auto" calls' pieces that may go
        out now (a forced call's text is its call, sent at the end)."""
        reasoning, content = self.add(output, prompt_index)
        events = self._delta("thinking", reasoning)
        if self.request.forced_call is not None:
            return events
        if self._calls_read is None:
            return events + self._delta("text", content)
        content, calls = self._calls_read.feed(content)
        if output.finished:
            rest, more_calls = self._calls_read.finish()
            content, calls = content + rest, calls + more_calls
        return events + self._delta("text", content) + self._call_events(calls)

    def closing(self) -> list[dict]:
        """The events after the last output: a forced call's tool_use block (its text where max_tokens cut it), the
        empty text block of a reply that has no other, the open block's end, message_delta and message_stop."""
        events = []
        if self.request.forced_call is not None:
            text, calls = self._whole_reply()
            events += self._delta("text", text) + self._call_events(calls)
        if not {"text", "tool_use"} & set(self._opened):  # (a message has a text block, empty if need be)
            events += self._stop_block() + self._start_block({"type": "text", "text": ""})
        stop_reason, stop_sequence = self._stop()
        return events + self._stop_block() + [{"type": "message_delta", "usage": self._usage(),
                                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}},
                                              {"type": "message_stop"}]

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
