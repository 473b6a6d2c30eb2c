"""Tool calls a model writes in its own syntax, for tool_choice "auto": found in the text once it is whole.

A model's chat template shows it how to call tools; the server reads the syntax off the template
(`tool_syntax_of`). Supported:

- Hermes-style blocks, as the Qwen2.5, Qwen3 and Qwen3-MoE templates ask for, one block per call, after
  optional text (the message's content), separated by whitespace only:

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- Qwen3-Coder's XML inside the same blocks (its template shows `<function=`), values typed by the tool's
  parameter schema:

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- Mistral's `[TOOL_CALLS]` followed by a JSON array of calls (or one call), as Mixtral-8x22B-Instruct's
  template asks for: `[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]`. The tag is a
  special token that detokenization would drop, so such requests keep special tokens in their text
  (`keeps_special_tokens`; the token that ends the reply is left out all the same).

A text whose calls are not all JSON objects naming one of the request's tools, with an object of arguments, or
that has text between or after them, stays text: nothing the model wrote is lost.
While streaming, text before the first block goes out as it comes; from the block's opening tag on, the text is
held until the end (`HeldText`), then sent as tool_calls (or, if it is not well-formed calls, as content).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from .text_tags import held_prefix


class HermesToolSyntax:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the last one may lack its closing tag)."""

    name = "hermes"
    opening = "<tool_call>"
    template_marker = "<tool_call>"  # a template that shows this teaches the syntax
    keeps_special_tokens = False
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls as a message's tool_calls) of a whole text; None where it holds no
        block, a block that is not a call of one of `tools` (name -> parameters schema), or text between or after
        the blocks."""
        start = text.find(self.opening)
        if start < 0:
            return None
        calls, end = [], start
        for match in self._block.finditer(text, start):
            call = self._parse_block(match.group(1) if match.group(1) is not None else match.group(2), tools)
            if call is None or text[end:match.start()].strip():  # a bad block, or text between blocks
                return None
            calls.append(call)
            end = match.end()
        if text[end:].strip():  # text after the calls
            return None
        return text[:start], calls

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        """A tool_calls entry from one block's JSON {"name", "arguments"}; None if it is not a call of `tools`."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        return _call(call, tools)


class QwenXmlToolSyntax(HermesToolSyntax):
    """Qwen3-Coder's blocks: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
    each value raw text (a newline after its opening tag and before its closing one dropped), typed by the
    parameter's schema: integer, number, boolean and null as JSON reads them, object and array as JSON, anything
    else (and a value that does not read as its type) as the string."""

    name = "qwen3_xml"
    template_marker = "<function="
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        function = self._function.match(block)
        if function is None or function.group(1).strip() not in tools:
            return None
        name, body = function.group(1).strip(), function.group(2)
        properties = tools[name].get("properties") if isinstance(tools[name], dict) else None
        properties = properties if isinstance(properties, dict) else {}  # parameter -> its schema
        arguments, end = {}, 0
        for parameter in self._parameter.finditer(body):
            if body[end:parameter.start()].strip():  # text between the parameters
                return None
            value = parameter.group(2).removeprefix("\n").removesuffix("\n")
            key = parameter.group(1).strip()
            arguments[key] = _typed(value, properties.get(key))
            end = parameter.end()
        if body[end:].strip():
            return None
        return _call({"name": name, "arguments": arguments}, tools)


def _typed(value: str, schema: Any) -> Any:
    """A raw parameter value as its schema's type asks (the string where it does not read as that type)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if not any(k in ("integer", "number", "boolean", "null", "object", "array") for k in kinds):
        return value
    try:
        typed = json.loads(value)
    except ValueError:
        return value
    matches = {"integer": isinstance(typed, int) and not isinstance(typed, bool),
               "number": isinstance(typed, (int, float)) and not isinstance(typed, bool),
               "boolean": isinstance(typed, bool), "null": typed is None, "object": isinstance(typed, dict),
               "array": isinstance(typed, list)}
    return typed if any(matches.get(k, False) for k in kinds) else value


class MistralToolSyntax:
    """`[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects (or one object)."""

    name = "mistral"
    opening = "[TOOL_CALLS]"
    template_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls as a message's tool_calls) of a whole text; None where it holds no
        tag, or what follows the tag is not JSON calls of `tools` (name -> parameters schema; whitespace aside)."""
        start = text.find(self.opening)
        if start < 0:
            return None
        try:
            document = json.loads(text[start + len(self.opening):])
        except ValueError:
            return None
        items = document if isinstance(document, list) else [document]
        calls = [_call(item, tools) for item in items]
        if not calls or None in calls:
            return None
        return text[:start], calls


def _call(call: object, tools: Mapping[str, Any]) -> dict | None:
    """A tool_calls entry from a decoded {"name", "arguments"} object; None if it is not a call of `tools`."""
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


ToolSyntax = HermesToolSyntax | MistralToolSyntax  # (QwenXmlToolSyntax is a HermesToolSyntax)
SYNTAXES = (QwenXmlToolSyntax(), HermesToolSyntax(), MistralToolSyntax())  # the most specific marker first


def tool_syntax_of(chat_templates: Mapping[str, str]) -> ToolSyntax | None:
    """The tool-call syntax the chat template used with tools teaches the model (its "tool_use" template, else its
    default one); None where it shows none this server reads."""
    template = chat_templates.get("tool_use") or chat_templates.get("default") or ""
    return next((syntax for syntax in SYNTAXES if syntax.template_marker in template), None)


class HeldText:
    """One streamed choice's text under tool_choice "auto": what `feed` returns may go out as content now; the
    text from the syntax's opening tag on (and any end of the text that could be the start of that tag) is held.
    Each piece costs its own length (a long reply is not joined again at every piece)."""

    def __init__(self, opening: str):
        self.opening = opening
        self.parts: list[str] = []  # the whole text so far
        self.sent = 0  # characters of it already sent as content
        self.in_calls = False  # the opening tag has been seen
        self._pending = ""  # the text after `sent`, before the tag is seen: an end that may begin it

    def feed(self, text: str) -> str:
        self.parts.append(text)
        if self.in_calls:
            return ""
        pending = self._pending + text
        start = pending.find(self.opening)
        if start >= 0:
            self.in_calls, end = True, start
        else:
            end = len(pending) - held_prefix(pending, self.opening)
        self._pending = "" if self.in_calls else pending[end:]
        self.sent += end
        return pending[:end]

    def rest(self) -> str:
        """The text not sent yet."""
        return self.text[self.sent:]

    @property
    def text(self) -> str:
        return "".join(self.parts)
