"""The Responses API (`POST /v1/responses`), the OpenAI SDK's newer endpoint for text generation, over the same
engine requests as chat completions.

`input` (a string, or message items whose content is a string or input_text / output_text parts) and
`instructions` (a system message first) go through the model's chat template; `max_output_tokens`, `temperature`,
`top_p`, `stream` and the vLLM extensions of chat (`top_k`, `min_p`, `seed`, `stop`, penalties,
`structured_outputs`, ...) are read as chat reads them; `text.format` json_object or json_schema constrains the
text as chat's response_format does; function tools with tool_choice "required" or a named function force a call
as chat does (server/tools.py), answered as function_call items; with tool_choice "auto" (the default with tools)
the calls the model writes in its chat template's syntax (tool_syntax.py) become function_call items after the
message of the text before them (a model whose template teaches no syntax answers with the message alone).
function_call / function_call_output items in `input` carry earlier calls and their results back.
A thinking model's <think> text is a reasoning item before the message (its reasoning_text streamed with
response.reasoning_text.delta events), and reasoning items in `input` go back to the template as the next
assistant turn's reasoning.
Responses are not stored: `previous_response_id` is refused, and `store` is accepted and changes nothing (as where
a server keeps no state). As in chat, what this server does not do is a 400 naming the field rather than something
silently dropped: tools other than functions, images and files, reasoning settings,
logprobs (`top_logprobs`, `include`), truncation "auto".

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

from .protocol import (Fields, GenerateRequest, bad_request, body_object, chat_messages, json_type, output_grammar,
                       sampling_params, unsupported)
from .reasoning import ThinkingStream
from .tool_syntax import HeldText, ToolSyntax
from .tools import AutoCalls, ForcedCall, tool_calls, tool_use, with_call_tokens

INPUT_TEXT_PARTS = ("input_text", "output_text", "text")  # text content parts of an input message
# include values already met: reasoning items carry their text in the clear (there is nothing encrypted), which
# the client sends back as it would the encrypted content (the Agents SDK asks for it when nothing is stored)
INCLUDED_ANYWAY = ("reasoning.encrypted_content",)


def parse_response(body: Any, tool_syntax: ToolSyntax | None = None, split_reasoning: bool = False
                   ) -> GenerateRequest:
    """Validate a /v1/responses body."""
    fields = Fields(body_object(body))
    _reject_unsupported(fields)
    fields.string("user")  # accepted for compatibility; only the types are checked
    fields.boolean("store", True)
    fields.get("metadata", (dict,), "an object")
    messages = chat_messages(_input_messages(body.get("input")), "input")
    instructions = fields.string("instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    stream = fields.boolean("stream")
    text = fields.get("text", (dict,), "an object", {})
    asked = output_grammar(body, text.get("format"), "text.format")
    tools = _chat_tools(fields.get("tools", (list,), "an array"))
    use = tool_use(tools, _chat_tool_choice(body.get("tool_choice")),
                   lambda message, param: bad_request(message, param=param),
                   fields.boolean("parallel_tool_calls", True), tool_syntax)
    call = use if isinstance(use, ForcedCall) else None
    if call is not None and asked is not None:
        raise bad_request(f"a forced tool call and {asked[0]} cannot be asked together", param=asked[0])
    grammar = asked[1] if asked is not None else None
    params = with_call_tokens(use, sampling_params(fields, fields.integer("max_output_tokens"), "max_output_tokens",
                                                   None, 1, call.grammar if call is not None else grammar))
    return GenerateRequest(chat=True, model=fields.string("model"), prompts=(messages,), params=params,
                           stream=stream, prompt_param="input", forced_call=call,
                           auto_calls=use if isinstance(use, AutoCalls) else None,
                           split_reasoning=split_reasoning and call is None,
                           grammar_param="tools" if call is not None else asked[0] if asked is not None else None)


def _chat_tools(tools: list | None) -> list | None:
    """The Responses API's function tools ({"type": "function", "name", "parameters", ...}) in chat's form; other
    tool types (web search, files, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else json_type(tool)
            raise unsupported(f"tools[{i}]: only function tools are supported by this server, got {kind!r}",
                              f"tools[{i}]")
        out.append(tool if "function" in tool else
                   {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """The Responses API's tool_choice ({"type": "function", "name"} for a named function) in chat's form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _reject_unsupported(fields: Fields) -> None:
    body = fields.body
    if body.get("previous_response_id") is not None:
        raise unsupported("previous_response_id is not supported: this server does not store responses; send the "
                          "conversation in input", "previous_response_id")
    if body.get("conversation") is not None:
        raise unsupported("conversation is not supported: this server does not store conversations", "conversation")
    reasoning = fields.get("reasoning", (dict,), "an object", {})
    if any(value is not None for value in reasoning.values()):  # {"effort": null, ...} asks nothing
        raise unsupported("reasoning settings are not supported by this server", "reasoning")
    if body.get("prompt") is not None:
        raise unsupported("prompt is not supported by this server", "prompt")
    if fields.integer("top_logprobs"):
        raise unsupported("top_logprobs is not supported in /v1/responses (it is in chat completions)",
                          "top_logprobs")
    asked = [item for item in fields.get("include", (list,), "an array", ()) if item not in INCLUDED_ANYWAY]
    if asked:
        raise unsupported(f"include {asked[0]!r:.80} is not supported by this server", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported('truncation is not supported; only "disabled" is accepted (a prompt over the context '
                          'is refused)', "truncation")
    if body.get("background"):
        raise unsupported("background is not supported by this server", "background")


def _input_messages(value: Any) -> list[dict]:
    """`input` as chat messages with string or text-part content (checked again by protocol.chat_messages)."""
    if value is None:
        raise bad_request("input is required", param="input")
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request(f"input must be a string or a non-empty array of items, got {json_type(value)}",
                          param="input")
    messages, reasoning = [], None  # reasoning: an earlier reasoning item's text, for the assistant turn after it
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object, got {json_type(item)}", param=param)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, param)
            continue
        if kind in ("function_call", "function_call_output"):  # an earlier call and its result
            message = _call_message(item, kind, param, messages)
            if message is not None:
                messages.append(message)
            if reasoning is not None and kind == "function_call":
                messages[-1]["reasoning_content"], reasoning = reasoning, None
            continue
        if kind != "message":
            raise unsupported(f"{param}: items of type {kind!r} are not supported by this server (messages, "
                              f"function calls and their outputs are)", param)
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind not in INPUT_TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise unsupported(f"{param}.content[{j}]: only text parts are supported by this server, got "
                                      f"{part_kind!r}", f"{param}.content")
                parts.append({"type": "text", "text": part["text"]})
            content = parts
        messages.append({"role": item.get("role"), "content": content})
        if reasoning is not None and item.get("role") == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _reasoning_text(item: dict, param: str) -> str:
    """The text of a reasoning input item: its reasoning_text content, else its summary."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise bad_request(f'{param}.{field} must be an array of {{"type": ..., "text": ...}} parts',
                                  param=f"{param}.{field}")
            return "".join(p["text"] for p in parts)
    return ""


def _call_message(item: dict, kind: str, param: str, messages: list) -> dict | None:
    """A function_call item as an assistant message's tool call (joined to the one before when that holds calls
    only: None then), or a function_call_output item as a tool message."""
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{param}.call_id must be a string", param=f"{param}.call_id")
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output")}
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
    previous = messages[-1] if messages else None
    if previous is not None and previous.get("role") == "assistant" and previous.get("tool_calls") \
            and not previous.get("content"):
        previous["tool_calls"].append(call)
        return None
    return {"role": "assistant", "content": None, "tool_calls": [call]}


class ResponsesResponder:
    """Turns one /v1/responses request's RequestOutputs into the response object or its stream events.

    The output is, in order: a reasoning item (a thinking model's <think> text, where there is any), the message
    (unless the reply is only calls), then function_call items. Streamed, the reasoning item opens with its first
    text and closes before the message opens; the message opens with its first text (at once where nothing may
    hold it back); calls go out at the end, once the text is whole.
    """

    def __init__(self, request: GenerateRequest, model: str):
        self.request = request
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex
        self._message_id = "msg_" + uuid.uuid4().hex
        self._reasoning_id = "rs_" + uuid.uuid4().hex
        self._created = int(time.time())
        self._texts: list[str] = []  # the reply as generated
        self._input_tokens = self._cached_tokens = self._output_tokens = 0
        self._finish_reason: str | None = None
        self._sequence = 0
        self._output: list[dict] | None = None  # the output items, once the reply is whole
        self._status = "completed"  # and the response's status then
        self.thinking_started = False  # with split_reasoning: the prompt leaves the reply inside the thinking tag
        self._thinking: ThinkingStream | None = None  # with split_reasoning: the reply's split so far
        auto = request.auto_calls
        # "auto", streaming: the content, and what of it went out
        self._held = HeldText(auto.syntax.opening) if auto is not None and request.stream else None
        self._reasoning_state = "none"  # streaming: none | open | done
        self._opened = False  # streaming: the message item has opened

    def admitted(self, prompt_tokens: list[int]) -> None:
        """The input's token count, known once the engine has admitted it (before any output)."""
        self._input_tokens = prompt_tokens[0]

    def add(self, output: Any, prompt_index: int = 0) -> tuple[str, str]:
        """Record one RequestOutput; returns the reasoning and the content of its text that may go out now."""
        self._input_tokens, self._cached_tokens = output.prompt_tokens, output.cached_tokens
        self._output_tokens = output.completion_tokens
        self._finish_reason = output.finish_reason
        if output.text:
            self._texts.append(output.text)
        return self._split_piece(output.text, tokens=len(output.token_ids))

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the stream events it makes: reasoning and text deltas of what may go out
        now (a forced call's text is its calls, sent whole at the end)."""
        reasoning, content = self.add(output, prompt_index)
        return self._reasoning_delta(reasoning) + self._content_delta(content)

    def _split_piece(self, text: str, last: bool = False, tokens: int = 0) -> tuple[str, str]:
        """(reasoning, content) of the next piece of the reply, of `tokens` tokens (`last`: and what was held back
        at its end)."""
        if not self.request.split_reasoning:
            return "", text
        self._thinking = self._thinking or ThinkingStream(self.thinking_started)
        reasoning, content = self._thinking.feed(text, tokens)
        if last:
            more_reasoning, more_content = self._thinking.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

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
        text = "".join(self._thinking.reasoning)
        return [self._event("response.reasoning_text.done", item_id=self._reasoning_id, output_index=0,
                            content_index=0, text=text),
                self._event("response.content_part.done", item_id=self._reasoning_id, output_index=0,
                            content_index=0, part=self._reasoning_part(text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._reasoning_item("completed", [self._reasoning_part(text)]))]

    def _content_delta(self, text: str) -> list[dict]:
        """The events of content that may go out now ("auto": what cannot be part of a call)."""
        if self._held is not None:
            text = self._held.feed(text)
        if not text or self.request.forced_call is not None:
            return []
        return self._text_delta(text)

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
        held = self.request.forced_call is not None or self._held is not None or self.request.split_reasoning
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
        """The events after the last text: what was held back, the reasoning and the message done, each call's
        item (added, its arguments, done), then the whole response (response.completed, or response.incomplete
        where the length limit ended it)."""
        reasoning, content = self._split_piece("", last=True)
        events = self._reasoning_delta(reasoning)
        response = self.response()
        output = response["output"]
        message = next((i for i, item in enumerate(output) if item["type"] == "message"), None)
        calls_made = any(item["type"] == "function_call" for item in output)
        if message is not None:
            unsent = content  # what the reasoning split held back
            if self._held is not None:  # "auto": and the text that might have begun a call
                unsent = self._held.feed(content) + ("" if calls_made else self._held.rest())
            elif self.request.forced_call is not None:  # a forced call cut short: its text, whole
                unsent = output[message]["content"][0]["text"]
            events += self._message_opening() + (self._text_delta(unsent) if unsent else [])
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

    def response(self) -> dict:
        """The response object, once generation has ended: the reasoning item (where the reply thought), the
        message (unless the reply is only calls: a forced call's, or "auto" calls with no text before them), the
        function_call items."""
        if self._output is None:
            reasoning, content = None, "".join(self._texts)
            if self.request.split_reasoning:  # the split `add` made as the reply came (finish: once, in effect)
                self._split_piece("", last=True)
                reasoning = "".join(self._thinking.reasoning) if self._thinking.thought else None
                content = "".join(self._thinking.content)
            found = None
            if self.request.forced_call is not None:
                found = "", tool_calls(self.request.forced_call, content)
            elif self.request.auto_calls is not None:
                found = self.request.auto_calls.syntax.split(content, self.request.auto_calls.schemas)
            before, calls = found if found is not None and found[1] else (content, [])
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
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict:
        return {"input_tokens": self._input_tokens, "input_tokens_details": {"cached_tokens": self._cached_tokens},
                "output_tokens": self._output_tokens,
                "output_tokens_details": {"reasoning_tokens": self._thinking.reasoning_tokens if self._thinking
                                          else 0},
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
