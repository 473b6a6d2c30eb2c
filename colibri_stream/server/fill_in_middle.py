"""Fill in the middle: /v1/completions with a `suffix` (OpenAI's legacy field), for code models trained on it.

The completion fills the gap between the prompt and the suffix: the prompt the model sees is its fill-in-the-middle
tokens around the two, `<prefix-token> prompt <suffix-token> suffix <middle-token>` (prefix-suffix-middle order, as
Qwen2.5-Coder, Qwen3-Coder, StarCoder and DeepSeek-Coder were trained). The tokens are the model's own, found in its
vocabulary (`fim_tokens_of`); a model without them refuses `suffix` (a 400 naming it).
"""

from __future__ import annotations

from collections.abc import Callable

# (prefix, suffix, middle) tokens of the families that use them
FIM_STYLES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder and its derivatives
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_tokens_of(token_to_id: Callable[[str], int | None]) -> tuple[str, str, str] | None:
    """The first style of FIM_STYLES whose three tokens are all in the vocabulary (`token_to_id`), else None."""
    return next((style for style in FIM_STYLES if all(token_to_id(token) is not None for token in style)), None)


def fim_prompt(tokens: tuple[str, str, str], prefix: str, suffix: str) -> str:
    """The text whose completion is the middle between `prefix` and `suffix`."""
    begin, hole, end = tokens
    return f"{begin}{prefix}{hole}{suffix}{end}"
