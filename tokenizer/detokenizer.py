"""Turn a stream of generated token ids into a stream of text deltas, stopping at stop strings.

Decoding one token at a time is wrong twice over: byte-level BPE splits a multibyte character across tokens
(a lone piece decodes to U+FFFD), and SentencePiece-style decoders drop the leading space of the first token they
see. So each step decodes a short window of ids twice -- the already-emitted "prefix" tokens alone, and the prefix
plus the new tokens -- and emits the difference, once it no longer ends in an incomplete character. The window
then slides forward (the prefix/read-offset technique), so a step costs the same however long the output grows.

`tokenizers.decoders.DecodeStream` does the same sliding in Rust, but it offers no way to flush an incomplete
tail at the end of a request; the two small decodes per step are cheap enough here.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral

from .hf_tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so the first generated token is not seen as the start of a text.
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what decoding gives for the bytes of a character whose last bytes are still to come


class IncrementalDetokenizer:
    """The text of one sequence's generated tokens, delivered as deltas; never half a character.

    `add(ids)` returns the text that became final; text that could still be the start of one of the `stop`
    strings is held back. When a stop string completes, `stopped` turns True, `stop_reason` names it, and the
    text before it is the last delta; the stop string itself is emitted only with `include_stop`. When the request
    ends for another
    reason, `flush()` returns whatever was held back. The concatenated deltas equal
    `tokenizer.decode(prompt + output)` minus `tokenizer.decode(prompt)` (up to a stop string).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Iterable[int], skip_special_tokens: bool = True,
                 stop: Iterable[str] = (), include_stop: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop
        # The window: prefix tokens (their text already emitted), then tokens whose text is not out yet.
        self._ids: list[int] = list(prompt_token_ids)[-CONTEXT_TOKENS:]
        self._read = len(self._ids)  # window index of the first token whose text is not out yet
        self._prefix_text = self._decode(self._ids)
        self._held = ""  # decoded text held back because it may begin a stop string
        self.stopped = False
        self.stop_reason: str | None = None

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed newly generated token ids; returns the text they completed (often "", never a partial char)."""
        if self.stopped:
            return ""
        self._ids.extend([token_ids] if isinstance(token_ids, Integral) else token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character is still missing bytes
        return self._emit(self._advance(text))

    def flush(self) -> str:
        """Everything not yet returned (held-back text and an incomplete last character, as U+FFFD)."""
        if self.stopped:
            return ""
        tail = self._advance(self._decode(self._ids)) if len(self._ids) > self._read else ""
        out = self._emit(tail)
        if not self.stopped:
            out, self._held = out + self._held, ""
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, text: str) -> str:
        """The new part of `text` (the window's decode); the window then starts at the first unread token."""
        new = text[len(self._prefix_text):]
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def _emit(self, text: str) -> str:
        """Pass `text` through the stop-string filter: cut at a complete stop string, hold back a possible start."""
        if not self._stop:
            return text
        text, self._held = self._held + text, ""
        hits = [(pos, i) for i, s in enumerate(self._stop) if (pos := text.find(s)) >= 0]
        if hits:
            pos, i = min(hits)
            self.stopped, self.stop_reason = True, self._stop[i]
            return text[:pos + len(self._stop[i])] if self._include_stop else text[:pos]
        keep = max((k for s in self._stop for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]
