"""Streamed tool calls of the XML-like syntaxes (tool_syntax.py's), read as vLLM's parsers stream them: a call's id,
type and name once its head is written, then its arguments as JSON a parameter at a time, as each closes:
`{"KEY": value`, then `, "KEY": value`, each raw value typed by the tool's parameter schema as the non-streamed
answer types it, then `}` where the call closes.

- `StreamedXmlCalls`: Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>` (the call also closes at the block's tag where the model left `</function>` out).
- `StreamedGlmCalls`: GLM-4.5's `<tool_call>NAME` (up to a newline or the first `<arg_key>`), then
  `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs, `</tool_call>`.
- `StreamedInvokeCalls`: MiniMax-M2's `<minimax:tool_call>` blocks of one or more `<invoke name="NAME">` elements of
  `<parameter name="KEY">value</parameter>`, each `</invoke>` closing a call.

Text outside the blocks, and a block that does not open with one of the tools' names, is handled as
`StreamedCalls` handles Hermes blocks (content as it comes; a held block sent whole at its closing tag, as calls
where it reads as calls, else as content). Text between the parameters is syntax. In a MiniMax block, an element
after a streamed call that is not an invoke of one of the tools goes out as content with the rest of its block
(a call once sent is not taken back). A reply cut inside a call leaves that call not whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .tool_streams import BlockSyntax, StreamedCalls, arguments_piece, call_header, closing_in
from .tool_values import parameter_schema, typed_value


class StreamedXmlCalls(StreamedCalls):
    """One streamed choice's text in Qwen3-Coder's blocks, read as vLLM's qwen3_coder parser streams it (the module's
    docstring gives the deltas)."""

    _head = re.compile(r"\s*<function=([^>\n]+)>")  # a call's head: group 1 its tool's name
    _parameter_open = re.compile(r"\s*<parameter=([^>\n]+)>")  # group 1 the parameter's name
    _parameter_close = "</parameter>"
    _call_close: str | None = "</function>"  # None: the block's closing tag ends the call
    _after_call_state = "tail"  # what follows a call's closing tag: the rest of its block, up to the closing tag

    def __init__(self, syntax: BlockSyntax, tools: Mapping[str, Any]):
        super().__init__(syntax, tools)
        self._schema: Any = None  # in "parameters": the parameters schema of the call being read
        self._keys = 0  # in "parameters": the parameters sent so far

    def _call_name(self, head: re.Match) -> str | None:
        return head.group(1).strip()

    def _start_arguments(self, pending: str, head: re.Match) -> str:
        self._state, self._schema, self._keys = "parameters", self._tools[self._call_name(head)], 0
        return pending[head.end():]

    def _raw_value(self, text: str) -> str:
        """A parameter's raw value from the text between its tags: a newline after the opening tag and one before
        the closing tag are the syntax's."""
        return text.removeprefix("\n").removesuffix("\n")

    def _read_parameters(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """The call's parameters, each sent once its closing tag is written, up to the tag that closes the call."""
        searched = len(self._buffer)  # (the buffer holds no whole parameter)
        pending = self._buffer + text
        while True:
            opening = self._parameter_open.match(pending)
            if opening is None:
                break
            close = pending.find(self._parameter_close, max(opening.end(), searched - len(self._parameter_close) + 1))
            if close < 0:
                self._buffer = pending
                return ""
            key = opening.group(1).strip()
            value = typed_value(self._raw_value(pending[opening.end():close]), parameter_schema(self._schema, key))
            piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            deltas.append(arguments_piece(self.calls - 1, ("{" if self._keys == 0 else ", ") + piece))
            self._keys += 1
            pending, searched = pending[close + len(self._parameter_close):], 0
        found = [(at, closing) for closing in (self._call_close, self._syntax.closing) if closing
                 for at in [pending.find(closing)] if at >= 0]
        if not found:
            self._buffer = pending
            return ""
        at, closing = min(found)  # the first closing tag written
        deltas.append(arguments_piece(self.calls - 1, "{}" if self._keys == 0 else "}"))
        self._buffer = ""
        if closing == self._syntax.closing:
            self._state, self._after_call = "text", True
        else:
            self._state = self._after_call_state
        return pending[at + len(closing):]


class StreamedGlmCalls(StreamedXmlCalls):
    """One streamed choice's text in GLM-4.5's blocks (the module's docstring gives the deltas); values are the raw
    text between `<arg_value>` and `</arg_value>`, as `GlmToolSyntax` reads them."""

    _head = re.compile(r"\s*([^<\n]+?)[ \t]*(?:\n|(?=<arg_key>))")  # the name ends at a newline or the first key
    _parameter_open = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>")
    _parameter_close = "</arg_value>"
    _call_close = None

    def _raw_value(self, text: str) -> str:
        return text


class StreamedInvokeCalls(StreamedXmlCalls):
    """One streamed choice's text in MiniMax-M2's blocks (the module's docstring gives the deltas): after each
    `</invoke>` the block may hold another invoke (a call of its own) or close."""

    _head = re.compile(r'\s*<invoke\s+name="([^"]*)"\s*>')
    _parameter_open = re.compile(r'\s*<parameter\s+name="([^"]*)"\s*>')
    _parameter_close = "</parameter>"
    _call_close = "</invoke>"
    _after_call_state = "invokes"

    def finish(self) -> tuple[str, list[dict]]:
        if self._state in ("invokes", "foreign"):  # the block was not closed after a call
            rest, self._buffer = self._buffer, ""
            return ("" if self._state == "invokes" and not rest.strip() else rest), []
        return super().finish()

    def _read_invokes(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """Between a block's calls: the next invoke of one of the tools (a call sent as it streams), the block's
        closing tag, or anything else (the rest of the block, content)."""
        pending = (self._buffer + text).lstrip()
        self._buffer = ""
        if pending.startswith(self._syntax.closing):
            self._state, self._after_call = "text", True
            return pending[len(self._syntax.closing):]
        if ">" not in pending:  # an element's tag not yet whole
            self._buffer = pending
            return ""
        head = self._head.match(pending)
        if head is not None and self._call_name(head) in self._tools:
            deltas.append(call_header(self.calls, self._call_name(head)))
            self.calls += 1
            return self._start_arguments(pending, head)
        self._state = "foreign"
        return pending

    def _read_foreign(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """The rest of a block after an element that is not a call: content, up to and with the closing tag."""
        pending, end = closing_in(self._buffer, text, self._syntax.closing)
        if end < 0:
            self._buffer = pending
            return ""
        end += len(self._syntax.closing)
        content.append(pending[:end])
        self._state, self._buffer = "text", ""
        return pending[end:]
