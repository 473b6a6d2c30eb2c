"""vLLM's /tokenize and /detokenize on the real server: the engine's own token ids for a text and for chat messages
(the ids a chat completion's usage counts, with the same tools, template variables and add_generation_prompt),
their texts, the text of ids, the API key, and a 400 naming the field for what is malformed."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import API_KEY, request

from colibri_stream.server.state import STATE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def post(server, path: str, body, key: str | None = API_KEY) -> tuple[int, dict]:
    status, _, raw = request(server, "POST", path, body, key=key)
    return status, json.loads(raw)


def test_tokenize_gives_the_engines_ids_and_detokenize_their_text(tiny_server):
    tokenizer = tiny_server.app[STATE].engine.tokenizer
    status, reply = post(tiny_server, "/tokenize", {"model": "tiny", "prompt": "Hello there",
                                                    "return_token_strs": True})
    ids = tokenizer.encode("Hello there")
    assert status == 200 and reply["tokens"] == ids and reply["count"] == len(ids) and reply["max_model_len"] == 256
    assert "".join(reply["token_strs"]) == tokenizer.decode(ids, skip_special_tokens=False)
    status, plain = post(tiny_server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False)
    status, chat = post(tiny_server, "/tokenize", {"messages": MESSAGES})
    usage = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
    for fields in ({"add_generation_prompt": False}, {"chat_template_kwargs": {"flag": True}},
                   {"tools": tools, "tool_choice": "required"}):
        asked = {k: v for k, v in fields.items() if k != "tool_choice"}
        status, counted = post(tiny_server, "/tokenize", {"messages": MESSAGES, **asked})
        used = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=fields).usage
        assert status == 200 and counted["count"] == used.prompt_tokens, fields
    assert post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})[1]["count"] < \
        chat["count"]
    status, text = post(tiny_server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and text == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 1}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_malformed_bodies_are_refused_naming_the_field(tiny_server, path, body, status, param):
    got, reply = post(tiny_server, path, body)
    assert (got, reply["error"]["param"]) == (status, param), reply


def test_the_tokenizer_endpoints_take_the_api_key(tiny_server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, reply = post(tiny_server, path, body, key="wrong")
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
