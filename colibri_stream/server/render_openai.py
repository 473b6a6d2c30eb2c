"""Chat and text completions' replies: the whole completion, or its stream chunks, in OpenAI's layout (logprobs,
usage, tool_calls, reasoning_content)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import APIError
from .admission import Admission
from .generate_request import GenerateRequest
from .reply_text import ReplyPiece, ReplyText
from .sse import EventStream

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way

# A token id's text and its bytes (the bytes of a byte-level token need not be valid UTF-8 on their own).
TokenPiece = Callable[[int], tuple[str, bytes]]


@dataclass
class _Choice:
    """What one of the request's n sequences has produced so far."""

    index: int
    reply: ReplyText  # its text through the reasoning split and the tool calls' reading
    # Non-streaming only: the logprobs, for the final body.
    logprobs: list[dict] = field(default_factory=list)  # chat: content entries
    tokens: list[str] = field(default_factory=list)  # completions: parallel lists
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # completions: characters of token text so far
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    echoed: bool = False  # echo: the prompt went out (with the choice's first output)
    prompt_logprobs: list | None = None  # with prompt_logprobs: vLLM's list for the prompt (None first)


class Responder:
    """Turns one request's RequestOutputs into OpenAI response bodies: stream chunks or the whole completion."""

    framing = EventStream  # its stream's SSE framing

    def __init__(self, request: GenerateRequest, model: str, token_piece: TokenPiece,
                 decode: Callable[[list[int]], str]):
        self.request = request
        self._decode = decode  # token ids -> text: the echo of a prompt given as token ids
        self.model = model
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if request.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if request.chat else "text_completion"
        # Per prompt: its tokens, and those its sequence 0 took from the prefix cache (its n sequences share one
        # prompt, counted once).
        self._prompt_tokens = [0] * len(request.prompts)
        self._cached_tokens = [0] * len(request.prompts)
        self._token_piece = token_piece
        self._choices: list[_Choice] = []  # once admitted: one per sequence, prompt p's n sequences from p * n

    def _body(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def add(self, output: Any, prompt_index: int = 0) -> dict:
        """Record one RequestOutput of the prompt `prompt_index`; returns its choice as a stream chunk's `choices`
        entry."""
        choice = self._choices[prompt_index * self.request.params.n + output.index]
        self._prompt_tokens[prompt_index] = output.prompt_tokens
        if output.index == 0:
            self._cached_tokens[prompt_index] = output.cached_tokens
        request = self.request
        echo = request.echo and not choice.echoed
        text, entries = ("", None) if request.echo_only else (output.text, output.logprobs)
        choice.completion_tokens = 0 if request.echo_only else output.completion_tokens
        choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
        if request.echo_only and output.finish_reason == "stop":  # the token that stopped is dropped: max_tokens 0
            choice.finish_reason, choice.stop_reason = "length", None
        if echo:  # the prompt first: its text, its tokens' logprobs (the first token's null)
            choice.echoed = True
            prompt = request.prompts[prompt_index]
            text = (prompt if isinstance(prompt, str) else self._decode(list(prompt))) + text
            if output.prompt_token_ids:
                first = output.prompt_token_ids[0]
                entries = [(first, None, None), *(output.prompt_logprobs or ()), *(entries or ())]
        if request.prompt_logprobs and output.prompt_token_ids and choice.prompt_logprobs is None:
            choice.prompt_logprobs = [None, *(self._vllm_logprobs(entry) for entry in output.prompt_logprobs or ())]
        piece = choice.reply.feed(text, len(output.token_ids), output.finished)
        logprobs = self._logprobs(choice, entries) if request.logprobs else None
        if output.finished and choice.reply.called:
            choice.finish_reason = "tool_calls"
        entry: dict[str, Any] = {"index": choice.index}
        if not request.chat:
            entry["text"] = piece.content
        elif not request.stream:  # the body is built from the whole reply
            entry["delta"] = {}
        else:
            entry["delta"] = self._delta(piece, output.finished)
        entry["logprobs"] = logprobs
        entry["finish_reason"] = choice.finish_reason
        if output.finished:
            entry["stop_reason"] = choice.stop_reason
        return entry

    def _delta(self, piece: ReplyPiece, finished: bool) -> dict:
        """A streamed chat choice's delta: the reasoning, the content and the tool calls' pieces that may go out
        now (an empty content where there is nothing, in a plain reply's chunks before its last)."""
        delta: dict[str, Any] = {"reasoning_content": piece.reasoning} if piece.reasoning else {}
        if piece.content or not (finished or piece.reasoning or self.request.forced_call or
                                 self.request.auto_calls):
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = piece.calls
        return delta

    def _logprobs(self, choice: _Choice, entries: list | None) -> dict:
        """This delta's logprobs in the endpoint's format; kept in the choice too when not streaming."""
        keep = not self.request.stream
        if self.request.chat:
            content = [dict(self._chat_logprob(token_id, logprob),
                            top_logprobs=[self._chat_logprob(t, lp) for t, lp in top])
                       for token_id, logprob, top in entries or ()]
            if keep:
                choice.logprobs += content
            return {"content": content}
        delta: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in entries or ():
            text = self._token_piece(token_id)[0]
            delta["tokens"].append(text)
            if logprob is None:  # an echoed prompt's first token: nothing before it to predict it
                delta["token_logprobs"].append(None)
                delta["top_logprobs"].append(None)
            else:
                delta["token_logprobs"].append(max(logprob, MIN_LOGPROB))
                alternatives: dict[str, float] = {}
                for t, lp in top:  # best first: a text two tokens share keeps the better logprob
                    alternatives.setdefault(self._token_piece(t)[0], max(lp, MIN_LOGPROB))
                alternatives.setdefault(text, max(logprob, MIN_LOGPROB))  # as OpenAI: the sampled token's too
                delta["top_logprobs"].append(alternatives)
            delta["text_offset"].append(choice.offset)
            choice.offset += len(text)
        if keep:
            choice.tokens += delta["tokens"]
            choice.token_logprobs += delta["token_logprobs"]
            choice.top_logprobs += delta["top_logprobs"]
            choice.text_offset += delta["text_offset"]
        return delta

    def _vllm_logprobs(self, entry: tuple) -> dict:
        """One prompt position as vLLM's prompt_logprobs give it: token id (a string) -> its logprob, its rank (1:
        the most likely; null for the prompt's token where it is not among the top ones) and its text."""
        token_id, logprob, top = entry
        ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(top, start=1)}
        out = {str(token_id): {"logprob": max(logprob, MIN_LOGPROB), "rank": ranked.get(token_id, (None, None))[1],
                               "decoded_token": self._token_piece(token_id)[0]}}
        for t, (lp, rank) in ranked.items():
            out.setdefault(str(t), {"logprob": max(lp, MIN_LOGPROB), "rank": rank,
                                    "decoded_token": self._token_piece(t)[0]})
        return out

    def _chat_logprob(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token_piece(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    def usage(self) -> dict:
        prompt, completion = sum(self._prompt_tokens), sum(c.completion_tokens for c in self._choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens)}}
        if self.request.split_reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reply.reasoning_tokens
                                                                          for c in self._choices)}
        return usage

    def admitted(self, admission: Admission) -> None:
        """The prompts as admitted (before any output): their token counts, whether the reply starts thinking."""
        self._prompt_tokens = admission.prompt_tokens
        self._choices = [_Choice(i, ReplyText(self.request, admission.thinking_started))
                         for i in range(len(self.request.prompts) * self.request.params.n)]

    def opening(self) -> list[dict]:
        """A stream's first chunks: chat streams open with one per choice that carries the assistant role."""
        return self.role_chunks() if self.request.chat else []

    def events(self, output: Any, prompt_index: int = 0) -> list[dict]:
        """Record one RequestOutput; the stream chunk it makes (none for an output with nothing to show yet)."""
        choice = self.add(output, prompt_index)
        if self.request.chat and output.finished and choice["delta"].get("tool_calls"):
            # The calls, then the end in a chunk of its own, as OpenAI sends them: the SDK's stream helper closes
            # a call's arguments (its arguments.done event) when the end arrives after the call.
            end = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                   "stop_reason": choice.get("stop_reason")}
            calls = {key: value for key, value in choice.items() if key != "stop_reason"}
            return [*map(self.chunk, _one_entry_per_call(dict(calls, finish_reason=None))), self.chunk(end)]
        if self.request.forced_call is not None:  # the calls go out whole, at the end
            return [self.chunk(choice)] if output.finished else []
        text = any(choice["delta"].values()) if self.request.chat else choice.get("text")
        shown = text or output.finished or (self.request.logprobs and output.logprobs)
        return list(map(self.chunk, _one_entry_per_call(choice))) if shown else []

    @staticmethod
    def stream_error(error: APIError) -> list[dict]:
        """The events that end a stream on an error once its 200 has gone out: the error's body, as vLLM sends it."""
        return [error.body()]

    def closing(self) -> list[dict]:
        """A stream's last chunks: the usage, when stream_options asked for it."""
        return [self.usage_chunk()] if self.request.include_usage else []

    def chunk(self, choice: dict) -> dict:
        """A stream chunk holding one choice's delta."""
        body = self._body(self.chunk_object, [choice])
        if self.request.include_usage:
            body["usage"] = self.usage() if self.request.continuous_usage else None
        return body

    def role_chunks(self) -> list[dict]:
        """Chat streams open with one chunk per choice that carries the assistant role."""
        return [self.chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for c in self._choices]

    def usage_chunk(self) -> dict:
        return dict(self._body(self.chunk_object, []), usage=self.usage())

    def response(self) -> dict:
        """The non-streaming body, once every choice has finished."""
        choices = []
        for c in self._choices:
            entry: dict[str, Any] = {"index": c.index}
            reply = c.reply.whole()
            if self.request.chat:
                entry["message"] = ({"role": "assistant", "content": reply.content}
                                    if reply.calls is None else  # (the text before the calls, where it says anything)
                                    {"role": "assistant", "content": reply.content if reply.content.strip() else None,
                                     "tool_calls": reply.calls})
                if reply.reasoning is not None:
                    entry["message"]["reasoning_content"] = reply.reasoning
                entry["logprobs"] = {"content": c.logprobs} if self.request.logprobs else None
            else:
                entry["text"] = reply.content
                entry["logprobs"] = ({"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                                      "top_logprobs": c.top_logprobs, "text_offset": c.text_offset}
                                     if self.request.logprobs else None)
            entry["finish_reason"] = c.finish_reason
            entry["stop_reason"] = c.stop_reason
            if self.request.prompt_logprobs and not self.request.chat:
                entry["prompt_logprobs"] = c.prompt_logprobs
            choices.append(entry)
        body = dict(self._body(self.object, choices), usage=self.usage())
        if self.request.prompt_logprobs and self.request.chat:  # vLLM's chat answer holds them once, at the top
            body["prompt_logprobs"] = self._choices[0].prompt_logprobs
        return body


def _one_entry_per_call(choice: dict) -> list[dict]:
    """A streamed choice as chunks' choices in which no call's index repeats: where its delta holds several
    entries of one call (a call's name, then a first piece of its arguments), each later entry starts a choice of
    its own, as OpenAI streams a call (older SDKs' stream helpers keep one entry per call and chunk). The first
    holds the content, reasoning and logprobs; the last the finish reason."""
    calls = choice.get("delta", {}).get("tool_calls") or []  # completions' choices have text, no delta
    runs: list[list[dict]] = [[]]
    for call in calls:
        if any(other["index"] == call["index"] for other in runs[-1]):
            runs.append([])
        runs[-1].append(call)
    if len(runs) == 1:
        return [choice]
    parts = []
    for i, run in enumerate(runs):
        part = dict(choice, delta=dict(choice["delta"], tool_calls=run) if i == 0 else {"tool_calls": run})
        if i > 0:
            part["logprobs"] = None
        if i < len(runs) - 1:
            part["finish_reason"] = None
            part.pop("stop_reason", None)
        parts.append(part)
    return parts
