"""The reply-text stage that every API's renderer stands on (chat and text completions, Responses, Anthropic's
Messages): one choice's text, fed as the engine writes it, goes through the reasoning split (a thinking model's
<think> text, reasoning.py), the hold-back of text that may be a tool call and the reading of the calls
(tool_syntax.py for tool_choice "auto", tools.py for a forced call).

`feed` returns what may go out now (`ReplyPiece`); `whole`, once the reply has finished, the reply read whole
(`Reply`): a non-streamed answer is built from it, and so are the parts of a streamed one that go out at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .generate_request import GenerateRequest
from .harmony import HarmonyStream
from .reasoning import ThinkingStream
from .tool_streams import CallReader, HeldCalls
from .tools import tool_calls


@dataclass
class ReplyPiece:
    """What one piece of the reply lets go out now."""

    reasoning: str = ""  # text inside the thinking tag
    content: str = ""  # text outside it; none of a forced call's (its text is its calls) until it proves cut short
    # chat's tool_calls stream deltas: streamed "auto" calls as they are written, a forced call's whole at the end
    calls: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    """A whole reply, read once it has finished."""

    reasoning: str | None  # the text inside the thinking tag; None where the reply did not think
    content: str  # the rest, less the calls it makes (a forced call's: "", unless cut by max_tokens)
    calls: list[dict] | None  # chat's tool_calls entries the text makes; None: it makes none


class ReplyText:
    """One choice's reply text through the reasoning split, the tool-call hold-back and the tool parse.

    request: the validated request (split_reasoning, forced_call, auto_calls, stream); thinking_started: the prompt
    leaves the reply inside the thinking tag (admission.py). A streamed "auto" reply is read by its syntax's
    stream reader, which lets calls out as they are written (tool_syntax.py); `calls_whole` holds every call until
    the text is whole instead (the Responses API sends its function_call items at the end).
    """

    def __init__(self, request: GenerateRequest, thinking_started: bool = False, calls_whole: bool = False):
        self._forced = request.forced_call
        self._auto = request.auto_calls
        self._thinking: ThinkingStream | HarmonyStream | None = None
        if request.split_reasoning:
            self._thinking = HarmonyStream() if request.harmony else ThinkingStream(thinking_started)
        self._content: list[str] = []  # the content pieces so far (the reply outside its reasoning)
        # streaming "auto": the calls read so far
        self._reader: CallReader | None = None
        if self._auto is not None and request.stream:
            self._reader = (HeldCalls(self._auto.syntax, self._auto.schemas) if calls_whole
                            else self._auto.syntax.stream_reader(self._auto.schemas))
        self._whole: Reply | None = None

    def feed(self, text: str, tokens: int = 0, finished: bool = False) -> ReplyPiece:
        """The next piece of the reply, `text` of `tokens` tokens (`finished`: the last one); what may go out now."""
        reasoning, content = "", text
        if self._thinking is not None:
            reasoning, content = self._thinking.feed(text, tokens)
            if finished:
                more_reasoning, more_content = self._thinking.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        self._content.append(content)
        if self._forced is not None:
            return self._forced_piece(reasoning, finished)
        calls: list[dict] = []
        if self._reader is not None:
            content, calls = self._reader.feed(content)
            if finished:
                rest, more_calls = self._reader.finish()
                content, calls = content + rest, calls + more_calls
            if not self._auto.parallel:  # parallel_tool_calls false: the first call's deltas alone
                calls = [delta for delta in calls if delta.get("index", 0) == 0]
        return ReplyPiece(reasoning, content, calls)

    def _forced_piece(self, reasoning: str, finished: bool) -> ReplyPiece:
        """A forced call's piece: nothing until the end, then its calls (or, cut short, its text)."""
        if not finished:
            return ReplyPiece(reasoning)
        reply = self.whole()
        if reply.calls is None:
            return ReplyPiece(reasoning, reply.content)
        return ReplyPiece(reasoning, calls=[dict(call, index=i) for i, call in enumerate(reply.calls)])

    def whole(self) -> Reply:
        """The whole reply (once the last piece has been fed): a forced call's text read as its calls (unless
        max_tokens cut it), "auto" calls split from the text before them."""
        if self._whole is None:
            content, calls = "".join(self._content), None
            if self._forced is not None:
                calls = tool_calls(self._forced, content)
                content = "" if calls is not None else content
            elif self._auto is not None:
                split = self._auto.syntax.split(content, self._auto.schemas)
                content, calls = split if split is not None else (content, None)
                if calls and not self._auto.parallel:  # parallel_tool_calls false: the first call alone
                    calls = calls[:1]
            thought = self._thinking is not None and self._thinking.thought
            self._whole = Reply(self.reasoning if thought else None, content, calls or None)
        return self._whole

    @property
    def reasoning(self) -> str:
        """The reasoning so far."""
        return "".join(self._thinking.reasoning) if self._thinking is not None else ""

    @property
    def called(self) -> bool:
        """Whether the reply ends in tool calls: streamed "auto" calls where each went out whole, else the whole
        reply's."""
        if self._reader is not None:
            return bool(self._reader.calls and self._reader.whole)
        return self.whole().calls is not None

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the reply spent inside the thinking tag."""
        return self._thinking.reasoning_tokens if self._thinking is not None else 0
