"""The server against hostile inputs, fourth audit (the earlier ones: test_server_edge_cases.py,
test_server_api_compat.py, test_server_hostile.py): values the earlier audits did not send, each of which was a
500 or a broken stream. The shipped default model serves; every refusal is the API's error body, and a good
request is answered after each."""

from __future__ import annotations

import openai
import pytest
from test_server import API_KEY, COMPLETIONS, LiveServer, post

from colibri_stream.checkpoint import default_model_path

MODEL = "default_model"


@pytest.fixture(scope="module")
def server():
    live = LiveServer(default_model_path(), dict(max_batch_size=8, max_seq_len=1024, max_queue=64), api_key=API_KEY)
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def assert_serving(server: LiveServer) -> None:
    status, reply = post(server, COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 2})
    assert status == 200, reply


# ------------------------------------------------------------------------------------------------------ tool_choice

def test_a_tool_choice_naming_a_function_by_a_list_or_object_is_a_400(server, client):
    """The name was looked up in a dict of the tools' schemas: a list or an object raised TypeError (a 500)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for name in ([], {}, ["f"]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                           tools=[tool], tool_choice={"type": "function", "function": {"name": name}})
        assert caught.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                    tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                                    tool_choice={"type": "function", "name": name})
        assert caught.value.body["param"] == "tool_choice"
    assert_serving(server)
