"""The request's reasoning effort reaches the chat template as `reasoning_effort` (chat's field, Responses'
reasoning.effort), as gpt-oss's template reads it: on the real server through the openai client, the prompt's
length telling which effort the template rendered; a bad effort is a 400 naming the field."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import CHATML_TEMPLATE, model_with_template
from test_server import API_KEY, LiveServer, request

# The effort written into a system turn, as gpt-oss's template writes "Reasoning: <effort>"; "medium" by default
EFFORT_TEMPLATE = ("{{ '<|im_start|>system\nReasoning: ' + (reasoning_effort | default('medium') + ' ') * 8 + "
                   "'<|im_end|>\n' }}" + CHATML_TEMPLATE)
MESSAGES = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = model_with_template(tiny_model_dir, tmp_path_factory.mktemp("effort") / "model", EFFORT_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=512), api_key=API_KEY, served_model_name="tiny")
    yield live, openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    live.close()
    shutil.rmtree(folder)


def chat_prompt_tokens(client, **fields) -> int:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, **fields).usage.prompt_tokens


def test_chat_reasoning_effort_reaches_the_template(served):
    _, client = served
    default, low, high = (chat_prompt_tokens(client), chat_prompt_tokens(client, reasoning_effort="low"),
                          chat_prompt_tokens(client, reasoning_effort="high"))
    assert len({default, low, high}) == 3, (default, low, high)  # three different system turns
    assert chat_prompt_tokens(client, reasoning_effort="medium") == default  # the template's own default
    # chat_template_kwargs set the variable itself: it wins
    assert chat_prompt_tokens(client, reasoning_effort="low",
                              extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}) == high


def test_responses_reasoning_effort_reaches_the_template(served):
    _, client = served

    def input_tokens(**fields) -> int:
        answer = client.responses.create(model="tiny", input="Hello world", max_output_tokens=1, **fields)
        return answer.usage.input_tokens

    assert input_tokens(reasoning={"effort": "high"}) == chat_prompt_tokens(client, reasoning_effort="high")
    assert input_tokens(reasoning={"effort": None}) == input_tokens() == chat_prompt_tokens(client)


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": 3}, "reasoning_effort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning"),
])
def test_a_bad_effort_is_a_400_naming_the_field(served, path, fields, param):
    live, client = served
    status, _, raw = request(live, "POST", path, data=json.dumps({"model": "tiny", "max_tokens": 1, **fields}).encode(),
                             headers={"Content-Type": "application/json"})
    assert (status, json.loads(raw)["error"]["param"]) == (400, param)
    assert chat_prompt_tokens(client) > 0  # and the server goes on
