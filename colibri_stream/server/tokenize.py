"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages through the template, to token ids) and
`POST /detokenize` (token ids to text), for clients that count or inspect tokens with the served model's tokenizer.

/tokenize takes {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...]} (rendered with the
generation prompt, as chat completions render them) and answers {"count", "max_model_len", "tokens"}, plus
"token_strs" (each token's text) with "return_token_strs": true. /detokenize takes {"tokens": [ids]} and answers
{"prompt": text}, special tokens included. Both name the served model or leave it out, and take the API key as /v1/
does.
"""

from __future__ import annotations

from typing import Any

from .protocol import Fields, bad_request, body_object, chat_messages


def parse_tokenize(body: Any) -> tuple[str | None, str | list[dict], bool, bool]:
    """(model, prompt text or chat messages, add_special_tokens, return_token_strs) of a /tokenize body."""
    fields = Fields(body_object(body))
    prompt, messages = fields.string("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("send either prompt (a string) or messages", param="prompt" if messages is None
                          else "messages")
    if not fields.boolean("add_generation_prompt", True):
        raise bad_request("add_generation_prompt false is not supported: messages are rendered as chat completions "
                          "render them", param="add_generation_prompt")
    return (fields.string("model"), prompt if prompt is not None else chat_messages(messages),
            fields.boolean("add_special_tokens", True), fields.boolean("return_token_strs"))


def parse_detokenize(body: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """(model, token ids) of a /detokenize body; every id within the model's vocabulary."""
    fields = Fields(body_object(body))
    tokens = fields.integers("tokens")
    if "tokens" not in body or any(not 0 <= t < vocab_size for t in tokens):
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab_size})", param="tokens")
    return fields.string("model"), list(tokens)
