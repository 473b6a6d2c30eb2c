"""A thinking model's reasoning, split from its answer: the text inside `<think>...</think>` goes to the message's
`reasoning_content` (as llama.cpp's server and vLLM's reasoning parsers return it), the text after it to `content`.

Models whose chat template knows the tags (Qwen3, Qwen3-MoE, DeepSeek-R1 style) write `<think>`, their reasoning,
`</think>`, then the answer; some templates (Qwen3's thinking-only releases) open the tag in the prompt, so the
text starts inside it (`started`). A text that does not open with the tag is all content; one cut off before the
closing tag is all reasoning. The answer's leading whitespace (the blank line after `</think>`) is dropped.
Streamed or not, the split is the same: `ThinkingStream` holds back only what may still be part of a tag.
"""

from __future__ import annotations

from collections.abc import Mapping

from .text_tags import held_prefix

OPENING, CLOSING = "<think>", "</think>"


def reasoning_tags_in(chat_templates: Mapping[str, str]) -> bool:
    """Whether the model's default chat template knows the thinking tags (so its replies may hold them)."""
    template = chat_templates.get("default") or chat_templates.get("tool_use") or ""
    return OPENING in template and CLOSING in template


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending in `prompt_tail` leaves the reply inside the thinking tag."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPENING)


class ThinkingStream:
    """One reply's text, fed as it comes, split into (reasoning, content) pieces that may go out now."""

    def __init__(self, started: bool = False):
        self._mode = "reasoning" if started else "undecided"  # undecided | reasoning | answer_start | content
        self.thought = started  # the reply has been inside the tag
        self.reasoning_tokens = 0  # tokens of the pieces fed while inside the tag (the tags' own included)
        self._undecided_tokens = 0  # tokens fed before the reply shows whether it opens the tag
        self._held = ""
        self.reasoning: list[str] = []  # all reasoning so far
        self.content: list[str] = []  # all content so far

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece of the reply, of `tokens` tokens) lets go
        out."""
        before = self._mode
        held, reasoning, content = self._held + text, "", ""
        while True:
            if self._mode == "undecided":
                stripped = held.lstrip()
                if stripped.startswith(OPENING):
                    held, self._mode, self.thought = stripped[len(OPENING):], "reasoning", True
                    continue
                if OPENING.startswith(stripped):  # may still open the tag (or only whitespace so far)
                    break
                self._mode = "content"
            elif self._mode == "reasoning":
                end = held.find(CLOSING)
                if end >= 0:
                    reasoning += held[:end]
                    held, self._mode = held[end + len(CLOSING):], "answer_start"
                    continue
                keep = held_prefix(held, CLOSING)
                reasoning, held = reasoning + held[:len(held) - keep], held[len(held) - keep:]
                break
            elif self._mode == "answer_start":
                held = held.lstrip()
                if held:
                    self._mode = "content"
                    continue
                break
            else:
                content, held = content + held, ""
                break
        self._held = held
        self._count(before, tokens)
        return self._record(reasoning, content)

    def _count(self, before: str, tokens: int) -> None:
        """Count the tokens of a piece fed in mode `before`: inside the tag (the closing one's piece included), or
        while undecided once the reply proves to open the tag."""
        if before == "reasoning":
            self.reasoning_tokens += tokens
        elif before == "undecided":
            self._undecided_tokens += tokens
            if self._mode != "undecided":
                if self.thought:
                    self.reasoning_tokens += self._undecided_tokens
                self._undecided_tokens = 0

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the reply: reasoning if it was inside the tag, else content (nothing
        when called again)."""
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            return self._record(held, "")
        return self._record("", held if self._mode in ("undecided", "content") else "")

    def _record(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content
