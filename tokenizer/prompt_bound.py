"""How many characters a prompt of at most max_seq_len tokens can have, so a longer one is refused before it is
tokenized (or its chat rendered) whole.

A token stands for a bounded span of the text it came from when the tokenizer's pipeline keeps every character:
each piece of a BPE or Unigram vocabulary covers at most as many characters as it is long (a byte-level piece is
one alphabet character per byte, and a byte covers at most one character; a metaspace piece has one "▁" per space),
and an added token covers its content. Normalizers may change the length first: canonical composition (NFC, NFKC)
folds at most 4 characters into one (the longest canonical decomposition is 4 code points), and a string
replacement shortens by at most its pattern's length over its content's. So a text of more than
max_seq_len x (longest piece) x (normalizer shrink) characters has more than max_seq_len tokens.

The bound does not exist when a step can drop text without limit: normalizers that strip or map characters away
(Strip, StripAccents, BertNormalizer, Precompiled, an empty replacement, a regex), pre-tokenizers that remove what
they split on (Whitespace, BertPreTokenizer, "removed" splits), added tokens that swallow the whitespace around
them (lstrip / rstrip), and models that fuse or drop unknown characters. Only the components named here are
trusted; anything else gives no bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from tokenizers import pre_tokenizers

from ..errors import ColibriError, PromptTooLongError

COMPOSITION_SHRINK = 4  # NFC/NFKC: the most code points a canonical composition folds into one
_LENGTH_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep every character unless their behavior is "Removed"


class PromptTooManyCharsError(PromptTooLongError):
    """A prompt refused before it was tokenized whole: it has more characters than max_seq_len tokens of the
    model's tokenizer can stand for. Its token count is unknown (`prompt_tokens` is None)."""

    def __init__(self, what: str, limit: CharLimit):
        ColibriError.__init__(self, f"{what}, more than {limit.max_seq_len} tokens hold (a token of this model's "
                                    f"tokenizer stands for at most {limit.chars_per_token} characters)")
        self.prompt_tokens, self.max_tokens, self.max_seq_len = None, None, limit.max_seq_len


@dataclass(frozen=True)
class CharLimit:
    """The most characters a prompt of max_seq_len tokens can have with one tokenizer."""

    max_seq_len: int
    chars_per_token: int  # max_chars_per_token of the tokenizer

    @property
    def max_chars(self) -> int:
        return self.max_seq_len * self.chars_per_token

    def check_text(self, chars: int) -> None:
        """Raise PromptTooManyCharsError for a text of `chars` characters that cannot fit."""
        if chars > self.max_chars:
            raise PromptTooManyCharsError(f"the prompt has {chars} characters", self)

    def check_rendered(self, chars: int) -> None:
        """Raise PromptTooManyCharsError once a chat's rendering has produced more characters than can fit."""
        if chars > self.max_chars:
            raise PromptTooManyCharsError(f"the chat renders to more than {self.max_chars} characters", self)


def max_chars_per_token(tokenizer_json: str) -> int | None:
    """The most characters of input text one token can stand for, from the tokenizers library's JSON of a
    tokenizer; None when its pipeline can drop text without limit (see the module docstring)."""
    spec = json.loads(tokenizer_json)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre_tokenizer = spec.get("pre_tokenizer")
    added = spec.get("added_tokens") or []
    if shrink is None or not _keeps_characters(pre_tokenizer) or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    pieces = _vocabulary_if_covering(spec.get("model") or {}, _has_byte_level(pre_tokenizer))
    if pieces is None:
        return None
    longest = max([*map(len, pieces), *(len(t.get("content") or "") for t in added)], default=0)
    return max(1, shrink * longest)


def pipeline_parts(node: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as the list of its parts (a Sequence flattened, None as no part)."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [part for child in node.get(key) or [] for part in pipeline_parts(child, key)]
    return [node]


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """By how much at most the normalizer shortens a text (a whole factor); None: without limit."""
    shrink = 1
    for part in pipeline_parts(normalizer, "normalizers"):
        kind = part.get("type")
        if kind in ("NFC", "NFKC"):
            shrink *= COMPOSITION_SHRINK
        elif kind == "Replace":
            pattern, content = (part.get("pattern") or {}).get("String"), part.get("content") or ""
            if not isinstance(pattern, str) or not content:
                return None
            shrink *= max(1, -(-len(pattern) // len(content)))
        elif kind not in _LENGTH_KEEPING_NORMALIZERS:
            return None
    return shrink


def _keeps_characters(pre_tokenizer: dict | None) -> bool:
    """Whether the pre-tokenizer passes every character on to the model."""
    for part in pipeline_parts(pre_tokenizer, "pretokenizers"):
        kind = part.get("type")
        if kind in _SPLITTING_PRE_TOKENIZERS:
            if part.get("behavior") == "Removed":
                return False
        elif kind not in _KEEPING_PRE_TOKENIZERS:
            return False
    return True


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    return any(part.get("type") == "ByteLevel" for part in pipeline_parts(pre_tokenizer, "pretokenizers"))


def _vocabulary_if_covering(model: dict, byte_level: bool) -> list[str] | None:
    """The model's pieces when every character of its input ends up in some token; None otherwise."""
    kind, vocab = model.get("type"), model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        pieces = list(vocab)
        if model.get("byte_fallback"):
            return pieces
        if byte_level and set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():  # every byte has a piece
            return pieces
        unknown = model.get("unk_token")
        return pieces if unknown in vocab and not model.get("fuse_unk") else None  # one unknown token a character
    if kind == "Unigram" and isinstance(vocab, list) and model.get("byte_fallback"):  # Unigram fuses unknowns
        return [entry[0] for entry in vocab if isinstance(entry, list) and entry and isinstance(entry[0], str)]
    return None

