"""Tags in streamed text (`<tool_call>`, `<think>`, ...): how much of a text's end may still become one."""

from __future__ import annotations


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may still become the tag once more
    arrives; 0 where none can)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
