"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages through the template, to token ids) and
`POST /detokenize` (token ids to text), for clients that count or inspect tokens with the served model's tokenizer.

/tokenize takes {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...]} (rendered as chat
completions render them, with the same `tools`, `chat_template_kwargs` and `add_generation_prompt`, so the count
is the one a chat completion's usage reports) and answers {"count", "max_model_len", "tokens"}, plus
"token_strs" (each token's text) with "return_token_strs": true. /detokenize takes {"tokens": [ids]} and answers
{"prompt": text}, special tokens included. Both name the served model or leave it out, and take the API key as /v1/
does.

A prompt of a few MiB has millions of tokens. Their checks, token texts and JSON are made on a worker thread, the
JSON a slice at a time: one orjson call over the whole list would hold the GIL for tens of milliseconds, and every
stream on the event loop would wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .chat_messages import chat_messages
from .fields import Fields, bad_request, body_object
from .params import template_kwargs
from .tools import function_tools


LONG_TOKEN_LIST = 1 << 15  # token lists longer than this are checked, decoded and written on a worker thread
_JSON_SLICE = 1 << 15  # items written by one orjson call


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated /tokenize body."""

    model: str | None
    prompt: str | list[dict]  # a text, or chat messages
    add_special_tokens: bool
    return_token_strs: bool
    tools: list[dict] | None  # messages: the tools the template shows
    template_kwargs: dict | None  # messages: the template's variables and add_generation_prompt


def parse_tokenize(body: Any) -> TokenizeRequest:
    fields = Fields(body_object(body))
    prompt, messages = fields.string("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("send either prompt (a string) or messages", param="prompt" if messages is None
                          else "messages")
    tools = fields.get("tools", (list,), "an array")
    listed = function_tools(tools, bad_request)[1] if tools else None
    return TokenizeRequest(fields.string("model"), prompt if prompt is not None else chat_messages(messages),
                           fields.boolean("add_special_tokens", True), fields.boolean("return_token_strs"),
                           listed, template_kwargs(fields))


def parse_detokenize(body: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(model, token ids) of a /detokenize body; every id within the model's vocabulary."""
    fields = Fields(body_object(body))
    tokens = fields.integers("tokens")
    if "tokens" not in body or any(not 0 <= t < vocab_size for t in tokens):
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab_size})", param="tokens")
    return fields.string("model"), list(tokens)


def tokenize_body(ids: list[int], max_model_len: int, token_text: Callable[[int], str] | None) -> bytes:
    """The /tokenize answer as JSON; with `token_text`, each token's text as "token_strs"."""
    body = b'{"count":%d,"max_model_len":%d,"tokens":%s' % (len(ids), max_model_len, _json_array(ids))
    if token_text is not None:
        body += b',"token_strs":' + _json_array([token_text(t) for t in ids])
    return body + b"}"


def _json_array(items: list) -> bytes:
    """orjson's JSON of a list, written a slice at a time (so a thread writing it lets others run in between)."""
    return b"[" + b",".join(orjson.dumps(items[i:i + _JSON_SLICE])[1:-1]
                            for i in range(0, len(items), _JSON_SLICE)) + b"]"
