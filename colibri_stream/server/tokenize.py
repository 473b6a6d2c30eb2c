"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages through the template, to token ids) and
`POST /detokenize` (token ids to text), for clients that count or inspect tokens with the served model's tokenizer.

/tokenize takes {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...]} (rendered as chat
completions render them, with the same `tools`, `chat_template_kwargs` and `add_generation_prompt`, so the count
is the one a chat completion's usage reports) and answers {"count", "max_model_len", "tokens"}, plus
"token_strs" (each token's text) with "return_token_strs": true. /detokenize takes {"tokens": [ids]} and answers
{"prompt": text}, special tokens included. Both name the served model or leave it out, and take the API key as /v1/
does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import Fields, bad_request, body_object, chat_messages, template_kwargs
from .tools import function_tools


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
    listed = function_tools(tools, lambda message, param: bad_request(message, param=param))[1] if tools else None
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
