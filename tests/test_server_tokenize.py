"""vLLM's /tokenize and /detokenize on the real server: the engine's own token ids for a text and for chat messages
(the ids a chat completion's usage counts), their texts, the text of ids, the API key, and a 400 naming the field for
what is malformed."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import API_KEY, request

from colibri_stream.server.app import STATE

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
    status, text = post(tiny_server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and text == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt"),
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
