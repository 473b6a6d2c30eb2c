"""gpt-oss's replies in the harmony format, read by channel: `analysis` is the reasoning, `final` the answer, a
`commentary` message addressed `to=functions.NAME` a tool call.

The prompt (the model's chat template) ends with `<|start|>assistant`, so a reply is a run of messages: a header
(`<|channel|>CHANNEL`, optionally ` to=functions.NAME` before or after the channel and `<|constrain|>json`), then
`<|message|>`, the body, and `<|end|>` (more messages follow, each after `<|start|>assistant`), or the reply's last
token: `<|return|>` after the final answer, `<|call|>` after a tool call (both end the generation and are left
out of the text, as every reply's last token is). These are special tokens, so a harmony model's requests keep
special tokens in their text (`keeps_special_tokens`).

`HarmonyStream` splits the text as it comes, as reasoning.py's ThinkingStream does for `<think>` (the same
interface, so reply_text.py uses either): analysis bodies go out as reasoning, final bodies and commentary without
a recipient as content, and a tool call's message as content in one canonical form, `to=functions.NAME<|message|>`
ARGS `<|call|>`, which `HarmonyToolSyntax` (a tool syntax as tool_syntax.py's) reads as calls once the text is
whole. A reply that does not open with a header, or whose structure breaks, goes out as it is written, as
content: nothing is lost and nothing raises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .json_depth import json_text
from .text_tags import held_prefix
from .tool_streams import HeldCalls
from .tool_syntax import calls_in, tool_call_entry

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
ENDINGS = (END, "<|return|>", "<|call|>")  # what ends a message's body (the last two only as written out)
CALL_OPENING = "to=functions."
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
MAX_HEADER = 256  # characters a message's header may take before its <|message|>: past this it is not harmony
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def harmony_in(chat_templates: Mapping[str, str]) -> bool:
    """Whether the model's chat template writes harmony messages (gpt-oss's)."""
    template = chat_templates.get("default") or chat_templates.get("tool_use") or ""
    return CHANNEL in template and MESSAGE in template


class HarmonyStream:
    """One harmony reply's text, fed as it comes, split into (reasoning, content) pieces that may go out now."""

    def __init__(self):
        self._mode = "header"  # header | body | between | raw (the structure broke: the rest as written)
        self._route: str | None = "content"  # where the current body goes: reasoning | content | call
        self._ending = ""  # the token that ended the last body (written back if what follows breaks the format)
        self._held = ""
        self.thought = False  # the reply has written an analysis message
        self.reasoning_tokens = 0  # tokens of the pieces fed while in an analysis body
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece of the reply, of `tokens` tokens) lets go
        out."""
        counted = self._mode == "body" and self._route == "reasoning"
        held, reasoning, content = self._held + text, "", ""
        while held:
            if self._mode == "raw":
                content, held = content + held, ""
            elif self._mode == "between":  # after <|end|>: the next message's <|start|>assistant
                stripped = held.lstrip()
                if stripped.startswith(START):
                    role_end = stripped.find(CHANNEL), stripped.find(CALL_OPENING), stripped.find(MESSAGE)
                    found = [i for i in role_end if i >= 0]
                    if not found:
                        break  # the role's name is still coming
                    held, self._mode = stripped[min(found):], "header"
                elif START.startswith(stripped):
                    break
                else:  # not a next message: the rest as written, from the token that ended the last one
                    self._mode, held = "raw", self._ending + held
            elif self._mode == "header":  # held: the message's header so far
                end = held.find(MESSAGE)
                if end < 0:
                    if len(held) > MAX_HEADER or not _may_open(held):
                        self._mode = "raw"
                        continue
                    break
                header, held = held[:end], held[end + len(MESSAGE):]
                self._route, piece = self._open(header)
                content += piece
                self._mode = "body" if self._route else "raw"
                if not self._route:
                    content += header + MESSAGE
            else:  # body
                ends = [(held.find(e), e) for e in ENDINGS if held.find(e) >= 0]
                if ends:
                    at, self._ending = min(ends)
                    piece, held = held[:at], held[at + len(self._ending):]
                    reasoning, content = self._add(piece, reasoning, content)
                    if self._route == "call":
                        content += "<|call|>"
                    self._mode = "between"
                    continue
                keep = max(held_prefix(held, e) for e in ENDINGS)
                piece, held = held[:len(held) - keep], held[len(held) - keep:]
                reasoning, content = self._add(piece, reasoning, content)
                break
        self._held = held
        if counted or (self._mode == "body" and self._route == "reasoning"):
            self.reasoning_tokens += tokens
        return self._record(reasoning, content)

    def _open(self, header: str) -> tuple[str | None, str]:
        """(where a message of `header` goes, the content it starts with): a call's canonical opening; None where
        the header names no channel (the structure broke)."""
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if channel is None:
            return None, ""
        if recipient is not None:
            return "call", f"{CALL_OPENING}{recipient.group(1)}{MESSAGE}"
        if channel.group(1) == "analysis":
            self.thought = True
            return "reasoning", ""
        return "content", ""

    def _add(self, piece: str, reasoning: str, content: str) -> tuple[str, str]:
        if self._route == "reasoning":
            return reasoning + piece, content
        return reasoning, content + piece

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the reply (nothing when called again)."""
        held, self._held = self._held, ""
        if self._mode == "body":
            reasoning, content = self._add(held, "", "")
            return self._record(reasoning, content + ("<|call|>" if self._route == "call" else ""))
        return self._record("", held if self._mode in ("header", "raw") else "")

    def _record(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content


def _may_open(text: str) -> bool:
    """Whether a message's header so far may be a harmony header: one that opens with a channel or a recipient (or
    the start of one)."""
    stripped = text.lstrip()
    return any(stripped.startswith(tag) or tag.startswith(stripped) for tag in (CHANNEL, CALL_OPENING))


class HarmonyToolSyntax:
    """The tool calls HarmonyStream leaves in the content: `to=functions.NAME<|message|>ARGS<|call|>` each, after
    the answer's text; ARGS a JSON object of the request's tool's arguments."""

    name = "harmony"
    opening = CALL_OPENING
    keeps_special_tokens = True
    _call = re.compile(r"to=functions\.(\S+?)<\|message\|>(.*?)<\|call\|>", re.DOTALL)

    def stream_reader(self, tools: Mapping[str, Any]) -> HeldCalls:
        return HeldCalls(self, tools)

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None:
        """(the text before the calls, the calls) of a whole content; None where a call is not one of `tools` with
        an object of arguments, or other text follows the calls."""
        start = text.find(self.opening)
        calls = None if start < 0 else calls_in(text[start:], self._call, lambda match: _read_call(match, tools))
        return None if calls is None else (text[:start], calls)


def _read_call(match: re.Match, tools: Mapping[str, Any]) -> dict | None:
    """A tool_calls entry from a call's (name, arguments' JSON) match; None if it is not a call of `tools`."""
    try:
        arguments = json_text(match.group(2))
    except ValueError:
        return None
    return tool_call_entry({"name": match.group(1), "arguments": arguments}, tools)


HARMONY_TOOL_SYNTAX = HarmonyToolSyntax()
