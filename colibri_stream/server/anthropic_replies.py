"""Replies of Anthropic's Messages API (`POST /v1/messages`, anthropic_messages.py): the message, or its stream of
named SSE events.

The reply is a message whose content blocks are, in order: thinking (where the reply thought), text (unless the
reply is only tool calls), tool_use per call; its stop_reason is tool_use, max_tokens, stop_sequence (naming the
stop_sequence) or end_turn. A stream sends Anthropic's named events: message_start, ping, then per block
content_block_start, content_block_delta (thinking_delta, text_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason, usage) and message_stop; a block opens with its first text, tool_use blocks come
at the end (each call's input in one input_json_delta), once the text is whole. An error after the stream has
opened goes out as an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .protocol import GenerateRequest
from .reasoning import ThinkingStream
from .sse import EventStream, encode_event
from .tool_syntax import HeldText
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

    The reasoning split (split_reasoning) and the hold-back of text that may begin an "auto" call run as the
    reply comes; the tool calls are read once it is whole.
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
        self._held = HeldText(auto.syntax.opening) if auto is not None and request.stream else None
        self._input_tokens = self._output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None
        self._reply: tuple[str, list[dict]] | None = None  # the text and the calls, once the reply is whole
        self._open: str | None = None  # streaming: the type of the content block open now
        self._blocks = 0  # streaming: content blocks opened
        self._text_opened = False  # streaming: a text block has opened

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
        """(the text, the tool_use blocks) of the whole reply: a forced call's text is its call (unless cut by
        max_tokens), "auto" calls follow the text before them."""
        if self._reply is None:
            text, calls = "".join(self._content), None
            if self.request.forced_call is not None:
                calls = tool_calls(self.request.forced_call, text)
                text = "" if calls is not None else text
            elif self.request.auto_calls is not None:
                split = self.request.auto_calls.syntax.split(text, self.request.auto_calls.schemas)
                text, calls = split if split is not None else (text, None)
            self._reply = text, [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                  "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
                                 for call in calls or ()]
        return self._reply

    @property
    def _thought(self) -> bool:
        return self._thinking is not None and self._thinking.thought

    def response(self) -> dict:
        """The message, once generation has ended."""
        text, calls = self._whole_reply()
        blocks = [_thinking_block("".join(self._reasoning))] if self._thought else []
        if text or not calls:
            blocks.append({"type": "text", "text": text})
        return self._message(blocks + calls, done=True)

    def _message(self, content: list[dict], done: bool) -> dict:
        stop_reason, stop_sequence = self._stop() if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage()}

    def _stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the whole reply."""
        if self._whole_reply()[1]:
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
        """Record one RequestOutput; the events of the reasoning and the text that may go out now (a forced call's
        text is its call, sent at the end)."""
        reasoning, content = self.add(output, prompt_index)
        if self.request.forced_call is not None:
            content = ""
        elif self._held is not None:
            content = self._held.feed(content)
        return self._delta("thinking", reasoning) + self._delta("text", content)

    def closing(self) -> list[dict]:
        """The events after the last output: the text held back (an "auto" text that made no calls, a forced call
        cut short), the open block's end, each call's tool_use block, message_delta and message_stop."""
        text, calls = self._whole_reply()
        unsent = ""
        if self.request.forced_call is not None:
            unsent = text
        elif self._held is not None and not calls:
            unsent = self._held.rest()
        events = self._delta("text", unsent)
        if not self._text_opened and not calls:  # (the message has a text block, empty if need be)
            events += self._start_block({"type": "text", "text": ""})
        events += self._stop_block()
        for call in calls:
            events += self._start_block(dict(call, input={}))
            events.append(self._block_event("content_block_delta", delta={"type": "input_json_delta",
                                                                          "partial_json": json.dumps(call["input"])}))
            events += self._stop_block()
        stop_reason, stop_sequence = self._stop()
        return events + [{"type": "message_delta", "usage": self._usage(),
                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}},
                         {"type": "message_stop"}]

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
        self._open, self._blocks = block["type"], self._blocks + 1
        self._text_opened |= block["type"] == "text"
        return [self._block_event("content_block_start", content_block=block)]

    def _stop_block(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [self._block_event("content_block_stop")]

    def _block_event(self, kind: str, **fields: Any) -> dict:
        """An event of the block opened last."""
        return {"type": kind, "index": self._blocks - 1, **fields}


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # (no signature: nothing is encrypted)
