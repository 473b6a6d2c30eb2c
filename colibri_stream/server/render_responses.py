"""Replies of the Responses API (`POST /v1/responses`, parse_responses.py): the response object, or its stream of
events.

A response has one output item, an assistant message with one output_text part (a forced call: one function_call
item per call, whose stream events come at the end: the item added, its arguments, the item done; "auto" calls:
the message, if any text came before them, then the calls' items, at the end too; the message opens with its
first text). A stream sends
OpenAI's event sequence: response.created, response.in_progress, response.output_item.added,
response.content_part.added, then response.output_text.delta per new text, response.output_text.done,
response.content_part.done, response.output_item.done and response.completed, each event numbered by
sequence_number. A response the length limit ended has status "incomplete" and incomplete_details.reason
"max_output_tokens", and its stream ends with response.incomplete instead, as OpenAI's does (the SDK's stream
helper yields it with the response; its get_final_response() waits for response.completed alone, against OpenAI
as here).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..errors import APIError
from .admission import Admission
from .generate_request import GenerateRequest
from .reply_text import ReplyText
from .sse import NamedEventStream


class ResponsesResponder:
    """Turns one /v1/responses request's RequestOutputs into the response object or its stream events.

    The output is, in order: a reasoning item (a thinking model's <think> text, where there is any), the message
    (unless the reply is only calls), then function_call items. Streamed, the reasoning item opens with its first
    text and closes before the message opens; the message opens with its first text (at once where nothing may
    hold it back); calls go out at the end, once the text is whole.
    """

    framing = NamedEventStream  # its stream's SSE framing

    def __init__(self, request: GenerateRequest, model: str):
        self.request = request
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex
        self._message_id = "msg_" + uuid.uuid4().hex
        self._reasoning_id = "rs_" + uuid.uuid4().hex
        self._created = int(time.time())
        self._reply: ReplyText | None = None  # the reply's text, once admitted
        self._input_tokens = self._cached_tokens = self._output_tokens = 0
        self._finish_reason: str | None = None
        self._sequence = 0
        self._output: list[dict] | None = None  # the output items, once the reply is whole
        self._status = "completed"  # and the response's status then
        self._reasoning_state = "none"  # streaming: none | open | done
        self._opened = False  # streaming: the message item has opened

    def admitted(self, admission: Admission) -> None:
        """The input as admitted (before any output): its token count, whether the reply starts thinking."""
        self._input_tokens = admission.prompt_tokens[0]
        # "auto" calls go out as function_call items once the text is whole: streamed, the text they may begin
        # is held back until then
        self._reply = ReplyText(self.request, admission.thinking_started, calls_whole=True)

    def add(self, output: Any, prompt_index: int = 0) -> tuple[str, str]:
        """Record one RequestOutput; returns the reasoning and the content of its text that may go out now (a
        forced call's text is its calls: none, unless the end shows it cut short)."""
        self._input_tokens, self._cached_tokens = output.prompt_tokens, output.cached_tokens
        self._output_tokens = output.completion_tokens
        self._finish_reason = output.finish_reason
        piece = self._reply.feed(output.text, len(output.token_ids), output.finished)
        return piece.reasoning, piece.content

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the stream events it makes: reasoning and text deltas of what may go out
        now."""
        reasoning, content = self.add(output, prompt_index)
        return self._reasoning_delta(reasoning) + (self._text_delta(content) if content else [])

    def _reasoning_delta(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self._reasoning_state == "none":
            self._reasoning_state = "open"
            events = [self._event("response.output_item.added", output_index=0,
                                  item=self._reasoning_item("in_progress", [])),
                      self._event("response.content_part.added", item_id=self._reasoning_id, output_index=0,
                                  content_index=0, part=self._reasoning_part(""))]
        return events + [self._event("response.reasoning_text.delta", item_id=self._reasoning_id, output_index=0,
                                     content_index=0, delta=text)]

    def _reasoning_done(self) -> list[dict]:
        """The reasoning item's closing events, once (where it opened)."""
        if self._reasoning_state != "open":
            return []
        self._reasoning_state = "done"
        text = self._reply.reasoning
        return [self._event("response.reasoning_text.done", item_id=self._reasoning_id, output_index=0,
                            content_index=0, text=text),
                self._event("response.content_part.done", item_id=self._reasoning_id, output_index=0,
                            content_index=0, part=self._reasoning_part(text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._reasoning_item("completed", [self._reasoning_part(text)]))]

    def _text_delta(self, text: str) -> list[dict]:
        """The events of text going out (closing the reasoning and opening the message first where needed)."""
        events = self._message_opening()
        return events + [self._event("response.output_text.delta", item_id=self._message_id,
                                     output_index=self._message_index, content_index=0, delta=text, logprobs=[])]

    @property
    def _message_index(self) -> int:
        return 1 if self._reasoning_state != "none" else 0

    def opening(self) -> list[dict]:
        """The events before any text (the message opens at once where nothing may come before it or hold its
        text back)."""
        events = [self._event("response.created", response=self._response("in_progress", [])),
                  self._event("response.in_progress", response=self._response("in_progress", []))]
        request = self.request
        held = request.forced_call is not None or request.split_reasoning or (request.auto_calls is not None
                                                                            and request.stream)
        return events if held else events + self._message_opening()

    def _message_opening(self) -> list[dict]:
        """The message item's opening events, once (after the reasoning's closing ones)."""
        if self._opened:
            return []
        self._opened = True
        index = self._message_index
        return self._reasoning_done() + [
            self._event("response.output_item.added", output_index=index, item=self._message("in_progress", [])),
            self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                        content_index=0, part=self._part(""))]

    def closing(self) -> list[dict]:
        """The events after the last text: the reasoning and the message done, each call's item (added, its
        arguments, done), then the whole response (response.completed, or response.incomplete where the length
        limit ended it)."""
        events: list[dict] = []
        response = self.response()
        output = response["output"]
        message = next((i for i, item in enumerate(output) if item["type"] == "message"), None)
        if message is not None:
            events += self._message_opening()
            text = output[message]["content"][0]["text"]
            events += [self._event("response.output_text.done", item_id=self._message_id, output_index=message,
                                   content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=self._message_id, output_index=message,
                                   content_index=0, part=self._part(text)),
                       self._event("response.output_item.done", output_index=message, item=output[message])]
        events += self._reasoning_done()
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                events += [self._event("response.output_item.added", output_index=index,
                                       item=dict(item, arguments="", status="in_progress")),
                           self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=item["arguments"]),
                           self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]),
                           self._event("response.output_item.done", output_index=index, item=item)]
        end = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self._event(end, response=response)]

    def stream_error(self, error: APIError) -> list[dict]:
        """The events that end a stream on an error once its 200 has gone out, as OpenAI sends them: an `error`
        event, then `response.failed` with the response's error."""
        code = error.code or error.type
        failed = dict(self._response("failed", []), error={"code": code, "message": error.message})
        return [self._event("error", code=code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    def response(self) -> dict:
        """The response object, once generation has ended: the reasoning item (where the reply thought), the
        message (unless the reply is only calls: a forced call's, or "auto" calls with no text before them), the
        function_call items."""
        if self._output is None:
            reply = self._reply.whole()
            reasoning, before, calls = reply.reasoning, reply.content, reply.calls or []
            self._status = "incomplete" if self._finish_reason == "length" and not calls else "completed"
            self._output = ([self._reasoning_item("completed", [self._reasoning_part(reasoning)])] if reasoning
                            else [])
            if before or not calls:
                self._output.append(self._message(self._status, [self._part(before)]))
            self._output += [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c["id"],
                              "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                              "status": "completed"} for c in calls]
        return self._response(self._status, self._output)

    def _response(self, status: str, output: list[dict]) -> dict:
        params = self.request.params
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self._created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None, "max_output_tokens": params.max_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": params.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": params.top_p, "truncation": "disabled", "metadata": {},
            **(self.request.settings or {}),  # the request's own settings, where it gave them
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict:
        return {"input_tokens": self._input_tokens, "input_tokens_details": {"cached_tokens": self._cached_tokens},
                "output_tokens": self._output_tokens,
                "output_tokens_details": {"reasoning_tokens": self._reply.reasoning_tokens},
                "total_tokens": self._input_tokens + self._output_tokens}

    def _message(self, status: str, content: list[dict]) -> dict:
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant",
                "content": content}

    def _reasoning_item(self, status: str, content: list[dict]) -> dict:
        return {"type": "reasoning", "id": self._reasoning_id, "status": status, "summary": [], "content": content}

    @staticmethod
    def _reasoning_part(text: str) -> dict:
        return {"type": "reasoning_text", "text": text}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _event(self, kind: str, **fields: Any) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}
