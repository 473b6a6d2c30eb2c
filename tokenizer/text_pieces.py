"""Cut a long text into pieces whose token ids, one after the other, are exactly those of the whole text.

Encoding a few MiB in one call makes the tokenizers library build one encoding of millions of tokens, whose ids
list and whose freeing each hold the GIL for tens of milliseconds, and whose heap is hundreds of MiB. Pieces of
64 Ki characters keep each of those small.

Where a cut is exact: before a space that has a non-whitespace character on each side. The pre-tokenizers trusted
here (GPT-2's byte-level regex, and the Split regexes of Qwen2/Qwen3, Qwen3.5 and Llama 3 before a byte-level
mapping) never put such a space anywhere but at the start of a pre-token (` ?\\p{L}+`, `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`
take it as an optional first character; whitespace runs start at it), and no match of theirs depends on what lies
past a non-whitespace character (their one lookahead, `\\s+(?!\\S)`, ends a whitespace run) or before a match (no
lookbehind). So the whole text's pre-tokens are the pieces' pre-tokens, and the model encodes each pre-token on its
own. The rest of the pipeline must not see across the cut either: no normalizer or only NFC (a space composes with
nothing), no added token that a cut could split (one holding a space beside another character) or that takes up
whitespace around it (lstrip / rstrip), a deterministic model (no BPE dropout), and a post-processor that adds
nothing, unless the text is encoded without special tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .prompt_bound import pipeline_parts

PIECE_CHARS = 1 << 16  # characters per piece, give or take the distance to the next cut
_CUT = re.compile(r"(?<=\S) (?=\S)")  # Python's \s holds every character the Rust regexes call whitespace
_SPLIT_PATTERNS = {
    # Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen3.5
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
}


@dataclass(frozen=True)
class CutRule:
    """Whether one tokenizer's texts may be encoded in pieces (see the module docstring)."""

    exact: bool  # the pieces' ids, one after the other, are the whole text's (special tokens aside)
    adds_special_tokens: bool  # the post-processor adds tokens: only texts encoded without them are cut

    @classmethod
    def of(cls, tokenizer_json: str) -> CutRule:
        """The rule for a tokenizer given as the tokenizers library's JSON."""
        spec = json.loads(tokenizer_json)
        exact = (_normalizer_keeps_cuts(spec.get("normalizer")) and _pre_tokenizer_keeps_cuts(spec.get("pre_tokenizer"))
                 and _added_tokens_keep_cuts(spec.get("added_tokens") or [])
                 and (spec.get("model") or {}).get("dropout") is None)
        return cls(exact, _adds_special_tokens(spec.get("post_processor")))

    def applies(self, add_special_tokens: bool) -> bool:
        return self.exact and not (add_special_tokens and self.adds_special_tokens)


def cut_into_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut before the first exact cut past every piece_chars characters (one piece when it has none)."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        cut = _CUT.search(text, start + piece_chars)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def _normalizer_keeps_cuts(normalizer: dict | None) -> bool:
    return all(part.get("type") == "NFC" for part in pipeline_parts(normalizer, "normalizers"))


def _pre_tokenizer_keeps_cuts(pre_tokenizer: dict | None) -> bool:
    parts = pipeline_parts(pre_tokenizer, "pretokenizers")
    if len(parts) == 1:  # GPT-2's: the byte-level pre-tokenizer with its own regex
        byte_level = parts[0]
        return byte_level.get("type") == "ByteLevel" and byte_level.get("use_regex", True) \
            and not byte_level.get("add_prefix_space")
    if len(parts) == 2:
        split, byte_level = parts
        return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") in _SPLIT_PATTERNS
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
                and not byte_level.get("add_prefix_space"))
    return False


def _adds_special_tokens(processor: dict | None) -> bool:
    """Whether the post-processor puts tokens around a text (a template's special tokens, BERT's and RoBERTa's)."""
    parts = pipeline_parts(processor, "processors")
    return any(part.get("type") != "ByteLevel" and not (
        part.get("type") == "TemplateProcessing" and all("Sequence" in item for item in part.get("single") or []))
        for part in parts)


def _added_tokens_keep_cuts(added_tokens: list[dict]) -> bool:
    for token in added_tokens:
        content = token.get("content") or ""
        if token.get("lstrip") or token.get("rstrip") or (" " in content and content.strip()):
            return False
    return True
