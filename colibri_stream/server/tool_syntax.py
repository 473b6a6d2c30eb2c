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

- GLM-4.5's blocks (its template shows `<arg_key>`): `<tool_call>get_weather` then `<arg_key>city</arg_key>`
  `<arg_value>Paris</arg_value>` pairs, `</tool_call>`; values typed as Qwen3-Coder's.

- MiniMax-M2's `<minimax:tool_call>` blocks of `<invoke name="get_weather"><parameter name="city">Paris
  </parameter></invoke>` elements (several calls a block); values typed as Qwen3-Coder's.

- DeepSeek-V3's special tokens: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather`,
  a fenced ```json block of the arguments, `<｜tool▁call▁end｜>` per call, `<｜tool▁calls▁end｜>` (R1 the same;
  V3.1 writes the name before the separator and the bare JSON after it).

- Kimi K2's special tokens: `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0`
  `<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>` per call, `<|tool_calls_section_end|>`.

- Mistral's `[TOOL_CALLS]` followed by a JSON array of calls (or one call), as Mixtral-8x22B-Instruct's
  template asks for: `[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]`. The tag is a
  special token that detokenization would drop, so such requests keep special tokens in their text
  (`keeps_special_tokens`; the token that ends the reply is left out all the same).

A template that teaches none of these (`NO_TOOL_SYNTAX`) still shows the model the tools; its reply is text.

Once the text is whole (`split`), a text whose calls are not all JSON objects naming one of the request's tools,
with an object of arguments, or that has text between or after them, stays text: nothing the model wrote is lost.
While streaming (`stream_reader`), Hermes blocks are read as vLLM's hermes parser streams them (`StreamedCalls`):
text outside the blocks goes out as content as it comes, and a block that opens with one of the tools' names and
an arguments object goes out as a call at once, its name first, then its arguments' text piece by piece as the
model writes it. The other syntaxes hold the text from the opening tag to the end (`HeldCalls`), then send it as
tool_calls (or, if it is not well-formed calls, as content). The tags of the syntaxes that mark
`keeps_special_tokens` are special tokens of their models' tokenizers, so such requests keep special tokens in their
text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .text_tags import held_prefix


class HermesToolSyntax:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the last one may lack its closing tag)."""

    name = "hermes"
    opening = "<tool_call>"
    closing = "</tool_call>"
    template_marker = "<tool_call>"  # a template that shows this teaches the syntax
    keeps_special_tokens = False
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedCalls | HeldCalls:
        """The reader of one streamed choice's text (`tools`: name -> parameters schema)."""
        return StreamedCalls(self, tools)

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls as a message's tool_calls) of a whole text; None where it holds no
        block, a block that is not a call of one of `tools` (name -> parameters schema), or text between or after
        the blocks."""
        start = text.find(self.opening)
        if start < 0:
            return None
        calls, end = [], start
        for match in self._block.finditer(text, start):
            block = self._parse_calls(match.group(1) if match.group(1) is not None else match.group(2), tools)
            if block is None or text[end:match.start()].strip():  # a bad block, or text between blocks
                return None
            calls += block
            end = match.end()
        if text[end:].strip():  # text after the calls
            return None
        return text[:start], calls

    def _parse_calls(self, block: str, tools: Mapping[str, Any]) -> list[dict] | None:
        """The calls of one block (one call a block, except where a syntax holds several); None if it is not
        calls of `tools`."""
        call = self._parse_block(block, tools)
        return None if call is None else [call]

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        """A tool_calls entry from one block's JSON {"name", "arguments"}; None if it is not a call of `tools`."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        return tool_call_entry(call, tools)


class QwenXmlToolSyntax(HermesToolSyntax):
    """Qwen3-Coder's blocks: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
    each value raw text (a newline after its opening tag and before its closing one dropped), typed by the
    parameter's schema: integer, number, boolean and null as JSON reads them, object and array as JSON, anything
    else (and a value that does not read as its type) as the string."""

    name = "qwen3_xml"
    template_marker = "<function="

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        function = self._function.match(block)
        if function is None or function.group(1).strip() not in tools:
            return None
        name, body = function.group(1).strip(), function.group(2)
        pairs, end = [], 0
        for parameter in self._parameter.finditer(body):
            if body[end:parameter.start()].strip():  # text between the parameters
                return None
            pairs.append((parameter.group(1).strip(), parameter.group(2).removeprefix("\n").removesuffix("\n")))
            end = parameter.end()
        if body[end:].strip():
            return None
        return tool_call_entry({"name": name, "arguments": _typed_arguments(pairs, tools[name])}, tools)


class GlmToolSyntax(HermesToolSyntax):
    """GLM-4.5's blocks: `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs (whitespace
    between them), `</tool_call>`; each value raw text typed by the parameter's schema as Qwen3-Coder's are."""

    name = "glm45"
    template_marker = "<arg_key>"
    keeps_special_tokens = True  # GLM-4.5's tokenizer holds its tool tags as special tokens
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        first = block.find("<arg_key>")
        name = (block if first < 0 else block[:first]).strip()
        if name not in tools:
            return None
        pairs = [(key.strip(), value) for key, value in self._pair.findall(block)]
        if first >= 0 and self._pair.sub("", block[first:]).strip():  # text between or after the pairs
            return None
        return tool_call_entry({"name": name, "arguments": _typed_arguments(pairs, tools[name])}, tools)


class MiniMaxToolSyntax(HermesToolSyntax):
    """MiniMax-M2's blocks: `<minimax:tool_call>` holding one or more `<invoke name="NAME">` elements of
    `<parameter name="KEY">value</parameter>` (values typed by the parameter's schema), `</minimax:tool_call>`."""

    name = "minimax_m2"
    opening = "<minimax:tool_call>"
    closing = "</minimax:tool_call>"
    template_marker = "<minimax:tool_call>"
    keeps_special_tokens = True  # MiniMax-M2's tokenizer holds its tool tags as special tokens
    _block = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>|<minimax:tool_call>(.*)\Z", re.DOTALL)
    _invoke = re.compile(r'<invoke\s+name="([^"]*)"\s*>(.*?)</invoke>', re.DOTALL)
    _parameter = re.compile(r'<parameter\s+name="([^"]*)"\s*>(.*?)</parameter>', re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)

    def _parse_calls(self, block: str, tools: Mapping[str, Any]) -> list[dict] | None:
        """The calls of one block; None if it holds none, text outside its invokes, or a call that is not one of
        `tools`."""
        calls = []
        for name, body in self._invoke.findall(block):
            if name not in tools or self._parameter.sub("", body).strip():
                return None
            pairs = [(key, value.removeprefix("\n").removesuffix("\n")) for key, value in self._parameter.findall(body)]
            calls.append(tool_call_entry({"name": name, "arguments": _typed_arguments(pairs, tools[name])}, tools))
        if not calls or self._invoke.sub("", block).strip():
            return None
        return calls


class DeepSeekToolSyntax:
    """DeepSeek-V3's tool-call special tokens, after optional text: `<｜tool▁calls▁begin｜>`, then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments as a fenced JSON block (V3, R1; "```json",
    the object, "```") or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>` and the JSON object (V3.1), then
    `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>` last (the reply may stop before it)."""

    name = "deepseek_v3"
    opening = "<｜tool▁calls▁begin｜>"
    closing = "<｜tool▁calls▁end｜>"
    template_marker = "<｜tool▁calls▁begin｜>"
    keeps_special_tokens = True
    _call_block = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _fenced = re.compile(r"([^\n]*)\n```json\n(.*)\n```\s*\Z", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls as a message's tool_calls) of a whole text; None where it holds no
        opening token, a call that is not one of `tools` with an object of arguments, or other text among the
        calls or after them."""
        body = _section(text, self.opening, self.closing)
        calls = None if body is None else calls_in(body, self._call_block,
                                                   lambda match: self._parse_call(match.group(1), tools))
        return None if calls is None else (text[:text.find(self.opening)], calls)

    def _parse_call(self, inner: str, tools: Mapping[str, Any]) -> dict | None:
        head, separator, rest = inner.partition("<｜tool▁sep｜>")
        if not separator:
            return None
        fenced = self._fenced.match(rest) if head.strip() == "function" else None
        name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        return tool_call_entry({"name": name.strip(), "arguments": value}, tools)


class KimiToolSyntax(DeepSeekToolSyntax):
    """Kimi K2's tool-call special tokens, after optional text: `<|tool_calls_section_begin|>`, then per call
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>` and the JSON object of its arguments,
    `<|tool_call_end|>`; `<|tool_calls_section_end|>` last (the reply may stop before it). The call id's form
    (`functions.NAME:INDEX`) is the model's; the calls get ids of our own, as every syntax's do."""

    name = "kimi_k2"
    opening = "<|tool_calls_section_begin|>"
    closing = "<|tool_calls_section_end|>"
    template_marker = "<|tool_calls_section_begin|>"
    _call_block = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
    _call_id = re.compile(r"\s*(?:functions\.)?([^\s:]+)(?::\d+)?\s*\Z")

    def _parse_call(self, inner: str, tools: Mapping[str, Any]) -> dict | None:
        call_id, separator, arguments = inner.partition("<|tool_call_argument_begin|>")
        name = self._call_id.match(call_id)
        if not separator or name is None:
            return None
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        return tool_call_entry({"name": name.group(1), "arguments": value}, tools)


def calls_in(body: str, block: re.Pattern, parse: Callable[[re.Match], dict | None]) -> list[dict] | None:
    """The calls `parse` reads from each match of `block` in `body`, with only whitespace between and after them;
    None where one does not read as a call, other text is there, or there is none."""
    calls, end = [], 0
    for match in block.finditer(body):
        call = parse(match)
        if call is None or body[end:match.start()].strip():
            return None
        calls.append(call)
        end = match.end()
    if not calls or body[end:].strip():
        return None
    return calls


def _section(text: str, opening: str, closing: str) -> str | None:
    """The text between `opening` and `closing` (or the end, where the reply stopped before it); None where the
    text holds no opening, or something other than whitespace follows the closing."""
    start = text.find(opening)
    if start < 0:
        return None
    body = text[start + len(opening):]
    closed = body.find(closing)
    if closed >= 0:
        if body[closed + len(closing):].strip():
            return None
        body = body[:closed]
    return body


def _typed_arguments(pairs: list[tuple[str, str]], schema: Any) -> dict:
    """Raw (key, value) pairs as arguments, each value typed by its parameter's schema in `schema` (`_typed`)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}  # parameter -> its schema
    return {key: _typed(value, properties.get(key)) for key, value in pairs}


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

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        """The reader of one streamed choice's text (`tools`: name -> parameters schema)."""
        return HeldCalls(self, tools)

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
        calls = [tool_call_entry(item, tools) for item in items]
        if not calls or None in calls:
            return None
        return text[:start], calls


def tool_call_entry(call: object, tools: Mapping[str, Any]) -> dict | None:
    """A tool_calls entry from a decoded {"name", "arguments"} object; None if it is not a call of `tools`."""
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class NoToolSyntax:
    """A template that teaches no tool-call syntax this server reads: under tool_choice "auto" the model is shown
    the tools and its reply is text, as OpenAI answers "auto" when the model calls nothing."""

    name = "none"
    opening = None  # nothing opens a call: no text is held back
    keeps_special_tokens = False

    def split(self, text: str, tools: Mapping[str, Any]) -> None:
        """No calls in any text."""
        return None

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)


NO_TOOL_SYNTAX = NoToolSyntax()
# (QwenXmlToolSyntax, GlmToolSyntax and MiniMaxToolSyntax are HermesToolSyntax; KimiToolSyntax a DeepSeekToolSyntax)
ToolSyntax = HermesToolSyntax | DeepSeekToolSyntax | MistralToolSyntax | NoToolSyntax
# the most specific marker first: GLM-4.5's and Qwen3-Coder's templates show "<tool_call>" too
SYNTAXES = (QwenXmlToolSyntax(), GlmToolSyntax(), MiniMaxToolSyntax(), DeepSeekToolSyntax(), KimiToolSyntax(),
            HermesToolSyntax(), MistralToolSyntax())


def tool_syntax_of(chat_templates: Mapping[str, str]) -> ToolSyntax | None:
    """The tool-call syntax the chat template used with tools teaches the model (its "tool_use" template, else its
    default one); None where it shows none this server reads."""
    template = chat_templates.get("tool_use") or chat_templates.get("default") or ""
    return next((syntax for syntax in SYNTAXES if syntax.template_marker in template), None)


def _call_delta(index: int, call: dict) -> dict:
    """A whole tool_calls entry as a stream delta's."""
    return dict(call, index=index)


def _merged(deltas: list[dict]) -> list[dict]:
    """Stream deltas with each run of pieces of one call's arguments joined into one (a call's first delta, its
    name's, stays apart)."""
    out: list[dict] = []
    for delta in deltas:
        if out and out[-1]["index"] == delta["index"] and _is_piece(out[-1]) and _is_piece(delta):
            out[-1] = {"index": delta["index"],
                       "function": {"arguments": out[-1]["function"]["arguments"] + delta["function"]["arguments"]}}
        else:
            out.append(delta)
    return out


def _is_piece(delta: dict) -> bool:
    """Whether a stream delta is a piece of a call's arguments (not a call's first delta)."""
    return "id" not in delta


class StreamedCalls:
    """One streamed choice's text in Hermes blocks, read as vLLM's hermes parser streams it: `feed` and `finish`
    return (content to send now, tool_calls deltas).

    Text outside the blocks goes out as content as it comes, holding back only an end that may begin the opening
    tag, and whitespace after a call (dropped where another block or the end follows). A block that opens with
    `{"name": <one of the tools>, "arguments": {` goes out as a call at once: its id, type and name, then its
    arguments object's text piece by piece as the model writes it, up to the brace that closes it (the rest of
    the block, up to its closing tag, is syntax). Any other block is held until its closing tag (or the end of the
    text) and goes out then, whole: as a call where it reads as one (`HermesToolSyntax._parse_block`), else as
    content. What went out as a call stays one: a reply that breaks the syntax later (text after the calls, a
    call cut short) is not taken back, as vLLM streams it; the non-streamed answer, read once whole, keeps such
    text as content (`HermesToolSyntax.split`)."""

    _head = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')

    def __init__(self, syntax: HermesToolSyntax, tools: Mapping[str, Any]):
        self._syntax = syntax
        self._tools = tools
        self._state = "text"  # text | block (a block's start, or a held block) | arguments | tail (after them)
        self._buffer = ""  # the text read but not sent: an end that may begin a tag, a block, a block's tail
        self._after_call = False  # in "text": only whitespace since the last call
        self._depth = 0  # in "arguments": brackets open
        self._in_string = self._escaped = False  # in "arguments": inside a JSON string, after its backslash
        self.calls = 0  # calls sent so far
        self.whole = True  # every call sent was closed (its arguments object ended)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content: list[str] = []
        deltas: list[dict] = []
        while text:
            text = getattr(self, "_read_" + self._state)(text, content, deltas)
        return "".join(content), _merged(deltas)

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the text is whole."""
        rest, self._buffer = self._buffer, ""
        if self._state == "text":
            return ("" if self._after_call and not rest.strip() else rest), []
        if self._state == "block":  # the last block may lack its closing tag, as in `split`
            return self._held_block(rest)
        if self._state == "arguments":  # cut short
            self.whole = False
            return "", []
        leftover = re.sub(r"\A\s*\}?\s*", "", rest)  # "tail": the end of the call object and its closing tag
        return leftover, []

    def _read_text(self, text: str, content: list[str], deltas: list[dict]) -> str:
        pending = self._buffer + text
        start = pending.find(self._syntax.opening)
        before = pending if start < 0 else pending[:start]
        keep = held_prefix(before, self._syntax.opening) if start < 0 else 0
        out = before[:len(before) - keep]
        if self._after_call and not out.strip():  # whitespace after a call: held until something follows it
            self._buffer = before
        else:
            content.append(out)
            self._after_call = False
            self._buffer = before[len(out):]
        if start < 0:
            return ""
        self._state, self._buffer, self._after_call = "block", "", False
        return pending[start + len(self._syntax.opening):]

    def _read_block(self, text: str, content: list[str], deltas: list[dict]) -> str:
        searched = max(0, len(self._buffer) - len(self._syntax.closing) + 1)  # (the buffer holds no closing tag)
        pending = self._buffer + text
        end = pending.find(self._syntax.closing, searched)
        block = pending if end < 0 else pending[:end]
        head = self._head.match(block)
        name = _json_string(head.group(1)) if head is not None else None
        if name in self._tools:
            self._state, self._buffer = "arguments", ""
            self._depth, self._in_string, self._escaped = 0, False, False
            deltas.append({"index": self.calls, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                           "function": {"name": name, "arguments": ""}})
            self.calls += 1
            return pending[head.end() - 1:]  # from the arguments' opening brace
        if end < 0:  # a start that may still become a call's, or a block held until it closes
            self._buffer = pending
            return ""
        more_content, calls = self._held_block(block, closed=True)
        content.append(more_content)
        deltas += calls
        self._state, self._buffer = "text", ""
        return pending[end + len(self._syntax.closing):]

    def _held_block(self, block: str, closed: bool = False) -> tuple[str, list[dict]]:
        """A block that did not open as a streamed call, once it is whole (`closed`: by its closing tag, else by
        the end of the text): a call, or content (with its tags)."""
        call = self._syntax._parse_block(block, self._tools)
        if call is None:
            return self._syntax.opening + block + (self._syntax.closing if closed else ""), []
        self._after_call = True
        self.calls += 1
        return "", [_call_delta(self.calls - 1, call)]

    def _read_arguments(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """The arguments object's text, sent as it comes, up to the brace that closes it (a `<` outside a string,
        which JSON cannot hold, ends it too: the model went on to a tag)."""
        end = None
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif char == "<":
                self.whole = False
                end = i
                break
        piece = text if end is None else text[:end]
        if piece:
            deltas.append({"index": self.calls - 1, "function": {"arguments": piece}})
        if end is None:
            return ""
        self._state = "tail"
        return text[end:]

    def _read_tail(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """After a streamed call's arguments: the rest of its block, up to the closing tag, is syntax."""
        searched = max(0, len(self._buffer) - len(self._syntax.closing) + 1)
        pending = self._buffer + text
        end = pending.find(self._syntax.closing, searched)
        if end < 0:
            self._buffer = pending
            return ""
        self._state, self._buffer, self._after_call = "text", "", True
        return pending[end + len(self._syntax.closing):]


def _json_string(literal: str) -> str | None:
    """The value of a JSON string literal; None where it is not one."""
    try:
        return json.loads(literal)
    except ValueError:
        return None


class HeldCalls:
    """One streamed choice's text in a syntax read only once whole (every syntax but Hermes'): `feed`
    and `finish` return (content to send now, tool_calls deltas). The text from the syntax's opening tag on is held
    (`HeldText`); at the end it goes out as calls where it reads as calls, else as content."""

    def __init__(self, syntax: ToolSyntax, tools: Mapping[str, Any]):
        self._syntax = syntax
        self._tools = tools
        self._held = HeldText(syntax.opening)
        self.calls = 0  # calls sent
        self.whole = True  # (calls go out whole)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return self._held.feed(text), []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the text is whole: the calls (the text before them went out already), else the text
        held back."""
        split = self._syntax.split(self._held.text, self._tools)
        if split is None:
            return self._held.rest(), []
        self.calls = len(split[1])
        return "", [_call_delta(i, call) for i, call in enumerate(split[1])]


class HeldText:
    """One streamed choice's text under tool_choice "auto": what `feed` returns may go out as content now; the
    text from the syntax's `opening` tag on (and any end of the text that could be the start of that tag) is held;
    with no opening tag (None), nothing is. Each piece costs its own length (a long reply is not joined again at
    every piece)."""

    def __init__(self, opening: str | None):
        self.opening = opening
        self.parts: list[str] = []  # the whole text so far
        self.sent = 0  # characters of it already sent as content
        self.in_calls = False  # the opening tag has been seen
        self._pending = ""  # the text after `sent`, before the tag is seen: an end that may begin it

    def feed(self, text: str) -> str:
        self.parts.append(text)
        if self.in_calls:
            return ""
        if self.opening is None:
            self.sent += len(text)
            return text
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
