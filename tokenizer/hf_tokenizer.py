"""A model folder's Hugging Face tokenizer, loaded with the `tokenizers` library (no transformers at run time).

Reads `tokenizer.json`, `tokenizer_config.json` (special tokens, `add_bos_token`/`add_eos_token`, the chat
template), `chat_template.jinja` plus `additional_chat_templates/*.jinja` (where transformers 5 saves templates)
and `generation_config.json` (the end-of-sequence ids). Encoding gives the ids transformers' fast tokenizer gives
for the same files.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.processors import TemplateProcessing

from ..errors import CheckpointError
from .chat_template import ChatTemplateError, render_chat_template
from .native_heap import release_free_heap
from .prompt_bound import CharLimit
from .text_pieces import PIECE_CHARS, CutRule, cut_into_pieces

# Texts and conversations longer than these leave enough freed heap behind to be worth returning (native_heap.py).
TRIM_AFTER_CHARS = 1 << 16
TRIM_AFTER_MESSAGES = 1024
PIECES_AT_ONCE = 8  # pieces of a long text encoded by one call (in parallel): 512 Ki characters, ~60 MiB of heap
DECODE_HOLDING_GIL_IDS = 4096  # longer id lists are decoded by the library's batch call, which drops the GIL (the
# one-text call, faster for the short windows of streaming, keeps it)

# The named special tokens transformers passes to chat templates (as strings) when the config sets them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    """A JSON object file, or {} when absent; CheckpointError when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # (nested too deep)
        raise CheckpointError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _added_token(value: Any, special: bool | None = True) -> AddedToken | None:
    """A config's token entry (a string or a serialised AddedToken dict) as an AddedToken; None when unset.

    special: the flag to give it (named special tokens are always special); None keeps the entry's own flag.
    """
    if isinstance(value, str):
        return AddedToken(value, special=bool(special))
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        flags = {key: value[key] for key in ("single_word", "lstrip", "rstrip", "normalized") if key in value}
        return AddedToken(value["content"], special=bool(value.get("special")) if special is None else special,
                          **flags)
    return None


def _chat_templates(folder: Path, config: dict) -> dict[str, str]:
    """Named chat templates ('default', 'tool_use', ...); the .jinja files win over tokenizer_config.json."""
    templates: dict[str, str] = {}
    files = {"default": folder / "chat_template.jinja"}
    files.update({p.stem: p for p in sorted((folder / "additional_chat_templates").glob("*.jinja"))})
    if any(path.is_file() for path in files.values()):
        for name, path in files.items():
            if path.is_file():
                try:
                    templates[name] = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"{path} is not a readable UTF-8 chat template: {e}") from None
        return templates
    entry = config.get("chat_template")
    if isinstance(entry, str):
        templates["default"] = entry
    elif isinstance(entry, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        for item in entry:
            if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                templates[str(item.get("name"))] = item["template"]
    return templates


def _token_text(value: Any) -> Any:
    """A tokenizer_config.json value with each serialised AddedToken ({"content": ..., ...}) as its text."""
    if isinstance(value, Mapping):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {key: _token_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_token_text(item) for item in value]
    return value


def _eos_ids(value: Any) -> list[int]:
    """generation_config's eos_token_id (an int, a list or null) as a list."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """Text <-> token ids and chat prompts for one model.

    Build it with `Tokenizer.from_folder(path)`. `encode` matches transformers' `tokenizer.encode`, `decode` its
    `decode`, and `apply_chat_template` its `apply_chat_template(..., tokenize=False)`.
    """

    def __init__(self, backend: BackendTokenizer, special_tokens: Mapping[str, str],
                 chat_templates: Mapping[str, str], eos_token_ids: Sequence[int],
                 config: Mapping[str, Any] | None = None):
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_templates = dict(chat_templates)
        self.config = dict(config or {})  # tokenizer_config.json as read
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        self.pad_token_id: int | None = self.token_to_id(self.special_tokens.get("pad_token"))
        # Highest id + 1: the model's embedding may have more rows (padding), never fewer.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face model folder; CheckpointError if tokenizer.json is unusable."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise CheckpointError(f"{path} cannot be loaded: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        # A prompt is never cut or padded silently; transformers would keep a tokenizer.json's truncation.
        backend.no_truncation()
        backend.no_padding()

        named = {name: value for name, value in config.items() if name.endswith("_token")}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):  # named extra tokens, e.g. {"image_token": "<image>"}
            named.update(extra)
            extra = []
        named_tokens = {name: token for name, value in named.items() if (token := _added_token(value)) is not None}
        _add_missing_tokens(backend, config, [*named_tokens.values(), *map(_added_token, extra)])
        special_tokens = {name: token.content for name, token in named_tokens.items()}

        # The config's flags rebuild the post-processor, as in transformers 4 and transformers 5's model classes;
        # transformers 5's generic class ignores them when there is a tokenizer.json.
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_processor(
                backend, special_tokens.get("bos_token") if config.get("add_bos_token") else None,
                special_tokens.get("eos_token") if config.get("add_eos_token") else None)

        eos_ids = [backend.token_to_id(special_tokens["eos_token"])] if "eos_token" in special_tokens else []
        eos_ids += _eos_ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        return cls(backend, special_tokens, _chat_templates(folder, config), [i for i in eos_ids if i is not None],
                   config)

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token string, or None when the vocabulary lacks it."""
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds (e.g. BOS).

        Encodes through the library's batch call, which drops the GIL (its `encode` keeps it for the whole text),
        so a long text tokenized on a worker thread does not stall the others; a long text goes in pieces that
        give the same ids (text_pieces.py) where the tokenizer allows, and the heap it took is handed back after.
        """
        if len(text) <= PIECE_CHARS or not self._cut_rule.applies(add_special_tokens):
            ids = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = []
            pieces = cut_into_pieces(text)
            for start in range(0, len(pieces), PIECES_AT_ONCE):
                encodings = self._backend.encode_batch_fast(pieces[start:start + PIECES_AT_ONCE],
                                                            add_special_tokens=False)
                encodings.reverse()
                while encodings:  # each freed on its own, a short hold of the GIL
                    ids += encodings.pop().ids
        if len(text) > TRIM_AFTER_CHARS:
            release_free_heap()
        return ids

    @functools.cached_property
    def _cut_rule(self) -> CutRule:
        return CutRule.of(self._backend.to_str())

    def to_json(self) -> str:
        """The tokenizer in the tokenizers library's JSON (what llguidance builds its view of the vocabulary from)."""
        return self._backend.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for logprobs): a byte-level token's bytes need not be valid UTF-8
        on their own, and a byte-fallback token `<0xNN>` is that one byte."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._backend.decode([token_id], skip_special_tokens=False) == piece:  # added tokens, plain pieces
            return piece.encode("utf-8")
        if isinstance(self._backend.decoder, decoders.ByteLevel) and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        if len(ids) > DECODE_HOLDING_GIL_IDS:  # the batch call drops the GIL
            return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def info(self) -> dict[str, Any]:
        """The tokenizer as vLLM's GET /tokenizer_info describes it (transformers' view of the same files):
        tokenizer_config.json's fields, each token entry as its text; `tokenizer_class`, the class transformers
        loads (the fast one); the named special tokens (null where unset); the default chat template."""
        info = {key: _token_text(value) for key, value in self.config.items() if key != "chat_template"}
        named = self.config.get("tokenizer_class")
        info["tokenizer_class"] = (named if named.endswith("Fast") else named + "Fast") if isinstance(named, str) \
            else "PreTrainedTokenizerFast"
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            info[name] = self.special_tokens.get(name)
        if "default" in self.chat_templates:
            info["chat_template"] = self.chat_templates["default"]
        return info

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, *, char_limit: CharLimit | None = None,
                            **extra: Any) -> str:
        """The prompt text for an OpenAI-style message list; `extra` goes to the template (e.g. enable_thinking).
        With `char_limit`, a conversation that renders to more characters than the context holds raises
        PromptTooManyCharsError as soon as its text grows past them.

        The text usually starts with the BOS token already, so encode it with add_special_tokens=False.
        Raises ChatTemplateError when the model has no template, the messages are malformed, a variable of `extra`
        is one of the renderer's own names (chat_template.RESERVED_VARIABLES) or the template rejects them.
        """
        template = self._select_template(tools)
        try:
            return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        char_limit=char_limit, **{**self.special_tokens, **extra})
        finally:  # rendering a long conversation copies every message: hand the freed heap back
            if isinstance(messages, Sequence) and len(messages) > TRIM_AFTER_MESSAGES:
                release_free_heap()

    def _select_template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        if not self.chat_templates:
            raise ChatTemplateError("this model has no chat template; use the completions API with a plain prompt")
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ChatTemplateError(f"this model has several chat templates and none is named 'default': "
                                f"{sorted(self.chat_templates)}")


def _add_missing_tokens(backend: BackendTokenizer, config: dict, special: list[AddedToken | None]) -> None:
    """Add the config's special and added tokens that tokenizer.json lacks, as transformers does on loading."""
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    listed = [_added_token(entry, special=None) for _, entry in
              sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda item: int(item[0]))]
    missing = {}
    for token in [*listed, *special]:
        if token is not None and token.content not in present:
            missing.setdefault(token.content, token)
    if missing:
        backend.add_tokens(list(missing.values()))


def _bos_eos_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> TemplateProcessing:
    """transformers' post-processor when the config sets add_bos_token/add_eos_token: [BOS] text [EOS]."""
    specials = [(token, backend.token_to_id(token)) for token in (bos, eos) if token is not None]
    head = f"{bos}:0 " if bos is not None else ""
    tail = f" {eos}:0" if eos is not None else ""
    return TemplateProcessing(single=f"{head}$A:0{tail}", special_tokens=specials)


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the other 68 are shifted to
    code points from 256 on. Maps each character back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_UNICODE_TO_BYTE = _byte_level_alphabet()
