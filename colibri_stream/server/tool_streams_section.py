"""Streamed tool calls of the syntaxes of special tokens around a section of calls (tool_syntax.py's DeepSeek-V3
and Kimi K2), read as vLLM's parsers of those models stream them: each call's id, type and name once its head is
written, then its JSON arguments' text piece by piece as the model writes it.

    DeepSeek-V3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
                  ... <｜tool▁calls▁end｜>   (V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>)
    Kimi K2:      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
                  <|tool_call_end|> ... <|tool_calls_section_end|>

The text before the section goes out as content as it comes (`HeldText`). A call goes out once its head names one
of the tools and its arguments open with `{`; the arguments end at the brace that closes them, and the rest of
the call up to its end token is syntax. Where the section stops being such calls (a head naming no tool, text
that is no call), the rest is content: with no call sent yet the whole text from the section's opening token on
(as the non-streamed answer has it), after calls the rest alone (a call once sent is not taken back). Whitespace
after the section is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

from .text_tags import held_prefix
from .tool_streams import CallsAfterTag, JsonArguments, JsonScan, call_header


class SectionSyntax(Protocol):
    """What StreamedSectionCalls asks of a syntax (tool_syntax.py's DeepSeek-V3 and Kimi K2): the section's tokens,
    each call's end token and the pattern of a call's head up to its arguments (group "name": the tool's name)."""

    opening: str
    closing: str
    call_opening: str
    call_closing: str
    call_head: re.Pattern


class StreamedSectionCalls(CallsAfterTag, JsonArguments):
    """One streamed choice's text in a section of calls (the module's docstring gives the deltas): `feed` and
    `finish` return (content to send now, tool_calls deltas)."""

    # states: text | section (between calls) | head (a call's head) | arguments | tail (after them, up to the
    # call's end token) | after (the section closed) | content

    def __init__(self, syntax: SectionSyntax, tools: Mapping[str, Any]):
        super().__init__(syntax, tools, "section")

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the text is whole."""
        if (unsent := self._unsent()) is not None:
            return unsent
        rest, self._buffer = self._buffer, ""
        if self._state == "arguments":  # cut short inside a call
            self.whole = False
            return "", []
        if self._state == "content":
            return rest, []
        return ("" if not rest.strip() or self._state == "tail" else rest), []

    def _give_up(self, pending: str) -> str:
        """The section is no longer calls: the rest is content (all of it from the opening, at the end, where no call
        went out)."""
        self._state = "content"
        return pending

    def _read_section(self, text: str, content: list[str], deltas: list[dict]) -> str:
        pending = (self._buffer + text).lstrip()
        self._buffer = ""
        for token, state in ((self._syntax.call_opening, "head"), (self._syntax.closing, "after")):
            if pending.startswith(token):
                self._state = state
                return pending[len(token):]
            if token.startswith(pending):  # a token not yet whole
                self._buffer = pending
                return ""
        return self._give_up(pending)

    def _read_head(self, text: str, content: list[str], deltas: list[dict]) -> str:
        pending = self._buffer + text
        head = self._syntax.call_head.match(pending)
        rest = pending[head.end():].lstrip() if head is not None else ""
        if head is None or not rest:  # the head, or the first character of the arguments, still to come
            if self._syntax.call_closing in pending or len(pending) > 4096:  # a call with no head this reads
                self._buffer = ""
                return self._give_up(pending)
            self._buffer = pending
            return ""
        self._buffer = ""
        if head.group("name").strip() not in self._tools or not rest.startswith("{"):
            return self._give_up(pending)
        deltas.append(call_header(self.calls, head.group("name").strip()))
        self.calls += 1
        self._state, self._scan = "arguments", JsonScan()
        return rest

    def _read_tail(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """After a call's arguments, up to its end token (a fence's closing backticks are syntax)."""
        closing = self._syntax.call_closing
        pending = self._buffer + text
        end = pending.find(closing)
        if end < 0:
            self._buffer = pending[len(pending) - held_prefix(pending, closing):]  # an end that may begin the token
            return ""
        self._buffer, self._state = "", "section"
        return pending[end + len(closing):]

    def _read_after(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """After the section's closing token: whitespace is dropped, anything else is content."""
        pending = self._buffer + text
        if not pending.strip():
            self._buffer = pending
            return ""
        self._buffer = ""
        return self._give_up(pending)

    def _read_content(self, text: str, content: list[str], deltas: list[dict]) -> str:
        if self.calls == 0:  # held: `finish` sends the whole text from the section on
            return ""
        content.append(self._buffer + text)
        self._buffer = ""
        return ""
