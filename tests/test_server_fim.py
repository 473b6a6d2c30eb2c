"""Fill in the middle (server/fill_in_middle.py) on the real server through the official openai client: a
completion with a suffix sees the prompt and the suffix around the model's own FIM tokens (Qwen-Coder style) and
answers the middle alone; a model without those tokens refuses a suffix, naming the field."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import SPECIAL_TOKENS, linked_model, write_tokenizer
from test_server import API_KEY, LiveServer, request

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return total\n"


@pytest.fixture(scope="module")
def fim_server(tiny_model_dir, tmp_path_factory):
    folder = linked_model(tiny_model_dir, tmp_path_factory.mktemp("fim") / "model")
    write_tokenizer(folder, special_tokens=(*SPECIAL_TOKENS, *FIM))
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=256), api_key=API_KEY, served_model_name="tiny")
    yield live
    live.close()
    shutil.rmtree(folder)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_a_suffix_puts_prompt_and_suffix_around_the_fim_tokens(fim_server):
    client = client_of(fim_server)
    middle = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    spelled = f"{FIM[0]}{PREFIX}{FIM[1]}{SUFFIX}{FIM[2]}"
    _, _, raw = request(fim_server, "POST", "/tokenize", {"prompt": spelled})
    tokens = json.loads(raw)["tokens"]
    assert middle.usage.prompt_tokens == len(tokens)
    assert [t for t in tokens if t < len(SPECIAL_TOKENS) + len(FIM)] == [3, 4, 5]  # each FIM token is one token
    spelled_out = client.completions.create(model="tiny", prompt=spelled, max_tokens=8, temperature=0)
    assert middle.choices[0].text == spelled_out.choices[0].text  # the middle alone, as the spelled prompt gives
    batch = client.completions.create(model="tiny", prompt=[PREFIX, "x = "], suffix=SUFFIX, max_tokens=4,
                                      temperature=0)
    assert batch.choices[0].text == client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX,
                                                               max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize(("fields", "code"), [
    ({"prompt": [1, 2, 3], "suffix": SUFFIX}, None),
    ({"prompt": PREFIX, "suffix": SUFFIX, "echo": True}, None),
])
def test_a_suffix_takes_text_prompts_without_echo(fim_server, fields, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(fim_server).completions.create(model="tiny", max_tokens=2, **fields)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("suffix", code)


def test_a_model_without_fim_tokens_refuses_a_suffix(tiny_server):
    client = client_of(tiny_server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=2)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("suffix", "unsupported_parameter")
    assert client.completions.create(model="tiny", prompt=PREFIX, suffix="", max_tokens=2).choices[0].text is not None
