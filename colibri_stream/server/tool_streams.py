"""Tool calls read from a reply while it streams, for tool_choice "auto" (the syntaxes are tool_syntax.py's), as
vLLM's parsers stream them: a call's id and name first, then its arguments' text in pieces. `StreamedCalls` reads
Hermes blocks (and is the base of tool_streams_xml.py's readers of XML-like blocks), `StreamedListCalls` Mistral's
JSON array after its tag; `HeldCalls` holds the text of a syntax read only once whole (`HeldText`) and sends its
calls at the end. Each returns (content to send now, tool_calls deltas) from `feed` and `finish`."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from .text_tags import held_prefix
from .tool_values import json_call

# The start of a call written as JSON, up to the brace that opens its arguments: {"name": "...", "arguments": {
JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


class WholeSyntax(Protocol):
    """What HeldCalls asks of a syntax (tool_syntax.py's): the tag that opens its calls (None: nothing does) and
    its reading of a whole text."""

    opening: str | None

    def split(self, text: str, tools: Mapping[str, Any]) -> tuple[str, list[dict]] | None: ...


class CallReader(Protocol):
    """What a streamed choice's reader of tool calls does (each reader of this module, tool_streams_xml.py and
    tool_streams_section.py): `feed` and `finish` give (content to send now, tool_calls deltas)."""

    calls: int  # calls sent so far
    whole: bool  # every call sent was closed

    def feed(self, text: str) -> tuple[str, list[dict]]: ...

    def finish(self) -> tuple[str, list[dict]]: ...


class BlockSyntax(Protocol):
    """What StreamedCalls asks of a syntax of blocks (Hermes', Qwen3-Coder's, GLM-4.5's, MiniMax-M2's): its tags and
    the reading of one block's calls."""

    opening: str
    closing: str

    def _parse_calls(self, block: str, tools: Mapping[str, Any]) -> list[dict] | None: ...


def _call_delta(index: int, call: dict) -> dict:
    """A whole tool_calls entry as a stream delta's."""
    return dict(call, index=index)


def call_header(index: int, name: str) -> dict:
    """A streamed call's first delta: its id, type and name (its arguments follow in pieces)."""
    return {"index": index, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": ""}}


def arguments_piece(index: int, text: str) -> dict:
    """A delta of the next piece of call `index`'s arguments."""
    return {"index": index, "function": {"arguments": text}}


class JsonScan:
    """Where a JSON value that opens with a bracket ends, read piece by piece: the brackets open outside strings
    (`depth`), and whether the scan is inside a string."""

    def __init__(self, depth: int = 0):
        self.depth = depth
        self._in_string = self._escaped = False
        self.stopped = False  # `end` stopped at one of its `stops` rather than at the closing bracket

    def end(self, text: str, stops: str = "") -> int | None:
        """The index in `text` just past the bracket that brings the depth back to 0, or that of the first of
        `stops` met outside a string (`stopped` then set); None where the value goes on after `text`."""
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
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif char in stops:
                self.stopped = True
                return i
        return None


def closing_in(buffer: str, text: str, closing: str) -> tuple[str, int]:
    """(buffer + text, where `closing` starts in it or -1): searched only from where it can start, the buffer
    holding none of it whole."""
    pending = buffer + text
    return pending, pending.find(closing, max(0, len(buffer) - len(closing) + 1))


class JsonArguments:
    """The reading of a streamed call's arguments written as a JSON object (Hermes blocks, DeepSeek-V3's and Kimi
    K2's sections): its text sent as it comes, up to the brace that closes it (a `<` outside a string, which JSON
    cannot hold, ends it too: the model went on to a tag), then state "tail". For readers that hold `_scan`,
    `_state`, `calls` and `whole`."""

    _scan: JsonScan
    _state: str
    calls: int
    whole: bool

    def _read_arguments(self, text: str, content: list[str], deltas: list[dict]) -> str:
        end = self._scan.end(text, stops="<")
        self.whole = self.whole and not self._scan.stopped
        piece = text if end is None else text[:end]
        if piece:
            deltas.append(arguments_piece(self.calls - 1, piece))
        if end is None:
            return ""
        self._state = "tail"
        return text[end:]


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


class StreamedCalls(JsonArguments):
    """One streamed choice's text in Hermes blocks, read as vLLM's hermes parser streams it: `feed` and `finish`
    return (content to send now, tool_calls deltas).

    Text outside the blocks goes out as content as it comes, holding back only an end that may begin the opening
    tag, and whitespace after a call (dropped where another block or the end follows). A block that opens with
    `{"name": <one of the tools>, "arguments": {` goes out as a call at once: its id, type and name, then its
    arguments object's text piece by piece as the model writes it, up to the brace that closes it (the rest of
    the block, up to its closing tag, is syntax). Any other block is held until its closing tag (or the end of the
    text) and goes out then, whole: as calls where it reads as such (`HermesToolSyntax._parse_calls`), else as
    content. What went out as a call stays one: a reply that breaks the syntax later (text after the calls, a
    call cut short) is not taken back, as vLLM streams it; the non-streamed answer, read once whole, keeps such
    text as content (`HermesToolSyntax.split`)."""

    _head = JSON_CALL_HEAD  # how a block that is a call starts (`_call_name` reads the name in it)

    def __init__(self, syntax: BlockSyntax, tools: Mapping[str, Any]):
        self._syntax = syntax
        self._tools = tools
        self._state = "text"  # text | block (a block's start, or a held block) | arguments | tail (after them)
        self._buffer = ""  # the text read but not sent: an end that may begin a tag, a block, a block's tail
        self._after_call = False  # in "text": only whitespace since the last call
        self._scan = JsonScan()  # in "arguments": where the arguments object ends
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
        if self._state != "tail":  # cut short inside a call's arguments
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
        pending, end = closing_in(self._buffer, text, self._syntax.closing)
        block = pending if end < 0 else pending[:end]
        head = self._head.match(block)
        name = self._call_name(head) if head is not None else None
        if name in self._tools:
            self._buffer = ""
            deltas.append(call_header(self.calls, name))
            self.calls += 1
            return self._start_arguments(pending, head)
        if end < 0:  # a start that may still become a call's, or a block held until it closes
            self._buffer = pending
            return ""
        more_content, calls = self._held_block(block, closed=True)
        content.append(more_content)
        deltas += calls
        self._state, self._buffer = "text", ""
        return pending[end + len(self._syntax.closing):]

    def _call_name(self, head: re.Match) -> str | None:
        """The tool's name in a block's head (`_head`'s match)."""
        return _json_string(head.group(1))

    def _start_arguments(self, pending: str, head: re.Match) -> str:
        """Begin reading a streamed call's arguments after its head; the text left to read."""
        self._state, self._scan = "arguments", JsonScan()
        return pending[head.end() - 1:]  # from the arguments' opening brace

    def _held_block(self, block: str, closed: bool = False) -> tuple[str, list[dict]]:
        """A block that did not open as a streamed call, once it is whole (`closed`: by its closing tag, else by
        the end of the text): its calls, or content (with its tags)."""
        calls = self._syntax._parse_calls(block, self._tools)
        if calls is None:
            return self._syntax.opening + block + (self._syntax.closing if closed else ""), []
        self._after_call = True
        self.calls += len(calls)
        return "", [_call_delta(self.calls - len(calls) + i, call) for i, call in enumerate(calls)]

    def _read_tail(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """After a streamed call's arguments: the rest of its block, up to the closing tag, is syntax."""
        pending, end = closing_in(self._buffer, text, self._syntax.closing)
        if end < 0:
            self._buffer = pending
            return ""
        self._state, self._buffer, self._after_call = "text", "", True
        return pending[end + len(self._syntax.closing):]


class CallsAfterTag:
    """A reader whose calls follow one opening tag (Mistral's `[TOOL_CALLS]`, DeepSeek-V3's and Kimi K2's sections):
    the text before the tag goes out as content as it comes (`_before`, a `HeldText`); from the tag on each piece is
    kept in `_since_tag` and read by the `_read_<state>` method of the reader's state, from `first_state` on."""

    def __init__(self, syntax: WholeSyntax, tools: Mapping[str, Any], first_state: str):
        self._syntax = syntax
        self._tools = tools
        self._before = HeldText(syntax.opening)  # the text up to the tag
        self._state = "text"
        self._first_state = first_state
        self._since_tag: list[str] = []  # the text after the tag
        self._buffer = ""  # the text read but not yet placed (what each state holds: the reader's)
        self._scan = JsonScan()  # where the JSON value being read ends
        self.calls = 0  # calls sent so far
        self.whole = True  # every call sent was closed (its arguments object ended)

    def _unsent(self) -> tuple[str, list[dict]] | None:
        """`finish`'s answer while no call went out: the text before the tag, or (after it) the whole text from the
        tag on as content, as the non-streamed answer has it; None once calls went out."""
        if self._state == "text":
            return self._before.rest(), []
        if self.calls == 0:
            return self._syntax.opening + "".join(self._since_tag), []
        return None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content: list[str] = []
        deltas: list[dict] = []
        if self._state == "text":
            content.append(self._before.feed(text))
            if not self._before.in_calls:
                return "".join(content), []
            text, self._state = self._before.rest()[len(self._syntax.opening):], self._first_state
        self._since_tag.append(text)
        while text:
            text = getattr(self, "_read_" + self._state)(text, content, deltas)
        return "".join(content), _merged(deltas)


class StreamedListCalls(CallsAfterTag):
    """One streamed choice's text in Mistral's syntax (`[TOOL_CALLS]` then a JSON array of {"name", "arguments"}
    objects, or one object), read as vLLM's mistral parser streams it: `feed` and `finish` return (content to send
    now, tool_calls deltas).

    The text before the tag goes out as content as it comes (`HeldText`). After it, each object of the array that
    opens with `{"name": <one of the tools>, "arguments": {` goes out as a call at once: its id, type and name,
    then its arguments object's text piece by piece as the model writes it (the rest of the object, such as an
    "id" the model wrote, is syntax). An object that opens otherwise is read whole and goes out as a call where it
    is one. Where the text after the tag stops being such an array, the rest is content: with no call sent yet,
    the whole text from the tag on (as the non-streamed answer has it); after calls, the rest alone (a call once
    sent is not taken back). Whitespace after the array is dropped."""

    # states: text | open (after the tag) | next (an object or the array's end) | object (its start, or held whole) |
    # arguments | tail (the rest of the object) | between (a comma or the array's end) | after | content; the
    # buffer holds, in "object", the object read so far, in "after" and "content" the text held

    def __init__(self, syntax: WholeSyntax, tools: Mapping[str, Any]):
        super().__init__(syntax, tools, "open")
        self._array = True  # the calls are an array (else one object)

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the text is whole."""
        if (unsent := self._unsent()) is not None:
            return unsent
        if self._state in ("arguments", "tail"):  # cut short inside a call
            self.whole = False
            return "", []
        rest = self._buffer if self._state in ("object", "content") or self._buffer.strip() else ""
        return rest, []

    def _read_open(self, text: str, content: list[str], deltas: list[dict]) -> str:
        rest = text.lstrip()
        if rest[:1] == "[":
            return self._go("next", rest[1:])
        if rest[:1] == "{":
            self._array = False
            return self._go("next", rest)
        return self._go("content", rest) if rest else ""

    def _read_next(self, text: str, content: list[str], deltas: list[dict]) -> str:
        rest = text.lstrip()
        if rest[:1] == "{":
            self._buffer, self._scan = "", JsonScan()
            return self._go("object", rest)
        if rest[:1] == "]" and self._array:
            return self._go("after", rest[1:])
        return self._go("content", rest) if rest else ""

    def _read_object(self, text: str, content: list[str], deltas: list[dict]) -> str:
        read = len(self._buffer)
        pending = self._buffer + text
        head = JSON_CALL_HEAD.match(pending)
        name = _json_string(head.group(1)) if head is not None else None
        if name in self._tools:
            deltas.append(call_header(self.calls, name))
            self.calls += 1
            self._buffer, self._scan = "", JsonScan()
            return self._go("arguments", pending[head.end() - 1:])  # from the arguments' opening brace
        end = self._scan.end(text)
        if end is None:
            self._buffer = pending
            return ""
        call = json_call(pending[:read + end], self._tools)
        if call is None:
            self._buffer = ""
            return self._go("content", pending)
        deltas.append(_call_delta(self.calls, call))
        self.calls += 1
        self._buffer = ""
        return self._go("between" if self._array else "after", pending[read + end:])

    def _read_arguments(self, text: str, content: list[str], deltas: list[dict]) -> str:
        end = self._scan.end(text)
        piece = text if end is None else text[:end]
        if piece:
            deltas.append(arguments_piece(self.calls - 1, piece))
        if end is None:
            return ""
        self._scan = JsonScan(depth=1)  # inside the call's object
        return self._go("tail", text[end:])

    def _read_tail(self, text: str, content: list[str], deltas: list[dict]) -> str:
        end = self._scan.end(text)
        if end is None:
            return ""
        return self._go("between" if self._array else "after", text[end:])

    def _read_between(self, text: str, content: list[str], deltas: list[dict]) -> str:
        rest = text.lstrip()
        if rest[:1] == ",":
            return self._go("next", rest[1:])
        if rest[:1] == "]":
            return self._go("after", rest[1:])
        return self._go("content", rest) if rest else ""

    def _read_after(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """After the calls: held, and sent at the end where it is more than whitespace."""
        self._buffer += text
        return ""

    def _read_content(self, text: str, content: list[str], deltas: list[dict]) -> str:
        """Text that is not calls: held, and sent at the end."""
        self._buffer += text
        return ""

    def _go(self, state: str, text: str) -> str:
        self._state = state
        return text


def _json_string(literal: str) -> str | None:
    """The value of a JSON string literal; None where it is not one."""
    try:
        return json.loads(literal)
    except ValueError:
        return None



class HeldCalls:
    """One streamed choice's text in a syntax read only once whole (harmony's; any syntax where the calls go out
    whole, as the Responses API sends them): `feed` and `finish` return (content to send now, tool_calls deltas).
    The text from the syntax's opening tag on is held (`HeldText`); at the end it goes out as calls where it reads as
    calls, else as content."""

    def __init__(self, syntax: WholeSyntax, tools: Mapping[str, Any]):
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
