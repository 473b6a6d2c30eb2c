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
model writes it. Qwen3-Coder's, GLM-4.5's and MiniMax-M2's blocks are streamed as vLLM's parsers of those models
do (tool_streams_xml.py: the name first, then the arguments as JSON a parameter at a time), and so is Mistral's
array of calls after its tag (`StreamedListCalls`: each call's name, then its arguments' text in pieces), and
DeepSeek-V3's and Kimi K2's sections of calls (tool_streams_section.py: the same). A syntax read only once whole
(harmony's) holds the text from the opening tag to the end (`HeldCalls`), then sends it as tool_calls (or, if it
is not well-formed calls, as content). The tags of the syntaxes that mark
`keeps_special_tokens` are special tokens of their models' tokenizers, so such requests keep special tokens in their
text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .json_depth import json_text
from .tool_streams import HeldCalls, StreamedCalls, StreamedListCalls
from .tool_streams_section import StreamedSectionCalls
from .tool_streams_xml import StreamedGlmCalls, StreamedInvokeCalls, StreamedXmlCalls
from .tool_values import json_call, tool_call_entry, typed_arguments


class HermesToolSyntax:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the last one may lack its closing tag)."""

    name = "hermes"
    opening = "<tool_call>"
    closing = "</tool_call>"
    template_marker = "<tool_call>"  # a template that shows this teaches the syntax
    keeps_special_tokens = False
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedCalls:
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
        return json_call(block, tools)


class QwenXmlToolSyntax(HermesToolSyntax):
    """Qwen3-Coder's blocks: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
    each value raw text (a newline after its opening tag and before its closing one dropped), typed by the
    parameter's schema: integer, number, boolean and null as JSON reads them, object and array as JSON, anything
    else (and a value that does not read as its type) as the string."""

    name = "qwen3_xml"
    template_marker = "<function="
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedXmlCalls:
        return StreamedXmlCalls(self, tools)

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
        return tool_call_entry({"name": name, "arguments": typed_arguments(pairs, tools[name])}, tools)


class GlmToolSyntax(HermesToolSyntax):
    """GLM-4.5's blocks: `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs (whitespace
    between them), `</tool_call>`; each value raw text typed by the parameter's schema as Qwen3-Coder's are."""

    name = "glm45"
    template_marker = "<arg_key>"
    keeps_special_tokens = True  # GLM-4.5's tokenizer holds its tool tags as special tokens
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedGlmCalls:
        return StreamedGlmCalls(self, tools)

    def _parse_block(self, block: str, tools: Mapping[str, Any]) -> dict | None:
        first = block.find("<arg_key>")
        name = (block if first < 0 else block[:first]).strip()
        if name not in tools:
            return None
        pairs = [(key.strip(), value) for key, value in self._pair.findall(block)]
        if first >= 0 and self._pair.sub("", block[first:]).strip():  # text between or after the pairs
            return None
        return tool_call_entry({"name": name, "arguments": typed_arguments(pairs, tools[name])}, tools)


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

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedInvokeCalls:
        return StreamedInvokeCalls(self, tools)

    def _parse_calls(self, block: str, tools: Mapping[str, Any]) -> list[dict] | None:
        """The calls of one block; None if it holds none, text outside its invokes, or a call that is not one of
        `tools`."""
        calls = []
        for name, body in self._invoke.findall(block):
            if name not in tools or self._parameter.sub("", body).strip():
                return None
            pairs = [(key, value.removeprefix("\n").removesuffix("\n")) for key, value in self._parameter.findall(body)]
            calls.append(tool_call_entry({"name": name, "arguments": typed_arguments(pairs, tools[name])}, tools))
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
    call_opening = "<｜tool▁call▁begin｜>"
    call_closing = "<｜tool▁call▁end｜>"
    # a call's head up to its arguments: V3's `function<｜tool▁sep｜>NAME` and the fence's opening, or V3.1's
    # `NAME<｜tool▁sep｜>` (never read off V3's `function<｜tool▁sep｜>` while its name is still being written)
    call_head = re.compile(r"\s*(?:function<｜tool▁sep｜>(?=[^\n<]*\n)|(?!function<｜tool▁sep｜>))"
                           r"(?P<name>[^\n<]*?)(?:\n```json\n|<｜tool▁sep｜>)")
    _call_block = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _fenced = re.compile(r"([^\n]*)\n```json\n(.*)\n```\s*\Z", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedSectionCalls:
        return StreamedSectionCalls(self, tools)

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
            value = json_text(arguments)
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
    call_opening = "<|tool_call_begin|>"
    call_closing = "<|tool_call_end|>"
    call_head = re.compile(r"\s*(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>")
    _call_block = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
    _call_id = re.compile(r"\s*(?:functions\.)?([^\s:]+)(?::\d+)?\s*\Z")

    def _parse_call(self, inner: str, tools: Mapping[str, Any]) -> dict | None:
        call_id, separator, arguments = inner.partition("<|tool_call_argument_begin|>")
        name = self._call_id.match(call_id)
        if not separator or name is None:
            return None
        try:
            value = json_text(arguments)
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


class MistralToolSyntax:
    """`[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects (or one object)."""

    name = "mistral"
    opening = "[TOOL_CALLS]"
    template_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def stream_reader(self, tools: Mapping[str, Any]) -> StreamedListCalls:
        """The reader of one streamed choice's text (`tools`: name -> parameters schema)."""
        return StreamedListCalls(self, tools)

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls as a message's tool_calls) of a whole text; None where it holds no
        tag, or what follows the tag is not JSON calls of `tools` (name -> parameters schema; whitespace aside)."""
        start = text.find(self.opening)
        if start < 0:
            return None
        try:
            document = json_text(text[start + len(self.opening):])
        except ValueError:
            return None
        items = document if isinstance(document, list) else [document]
        calls = [tool_call_entry(item, tools) for item in items]
        if not calls or None in calls:
            return None
        return text[:start], calls


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
