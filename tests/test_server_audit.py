"""The server against hostile inputs, fourth audit (the earlier ones: test_server_edge_cases.py,
test_server_api_compat.py, test_server_hostile.py): values the earlier audits did not send, each of which was a
500 or a broken stream. The shipped default model serves (its tokenizer has a "[[" token, which the nesting test
biases); every refusal is the API's error body, and a good request is answered after each."""

from __future__ import annotations

import json

import anthropic
import openai
import orjson
import pytest
from test_server import API_KEY, CHAT, COMPLETIONS, LiveServer, _error, client, post, request  # noqa: F401

from colibri_stream.checkpoint import default_model_path
from colibri_stream.server.json_depth import MAX_JSON_DEPTH
from colibri_stream.server.render_openai import Responder

MODEL = "default_model"
DOUBLE_BRACKET = 3452  # the default model's token "[["


@pytest.fixture(scope="module")
def server():
    live = LiveServer(default_model_path(), dict(max_batch_size=8, max_seq_len=1024, max_queue=64), api_key=API_KEY)
    yield live
    live.close()


def assert_serving(server: LiveServer) -> None:
    status, reply = post(server, COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 2})
    assert status == 200, reply


def assert_400(server: LiveServer, path: str, data: bytes, param: str | None = None) -> str:
    """The message of the 400 `data` sent to `path` gets, in the API's shape."""
    status, _, raw = request(server, "POST", path, data=data)
    assert status == 400, raw[:300]
    if path.startswith("/v1/messages"):
        body = orjson.loads(raw)
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    error = _error(orjson.loads(raw))
    assert error["param"] == param, error
    return error["message"]


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


# ------------------------------------------------------------------------------------------------------- nesting

def nested_schema(levels: int) -> str:
    return '{"type": "array", "items": ' * levels + '{"type": "object"}' + "}" * levels


def test_a_body_nested_deeper_than_the_limit_is_a_400(server):
    """orjson reads 1024 levels, and Python's json.dumps (a schema's grammar, an Anthropic tool_use's input), repr()
    and the chat template recursed past the interpreter's limit on them: 500s. Bodies nested deeper than
    MAX_JSON_DEPTH are refused in every API's shape."""
    schema = nested_schema(1000)
    deep_input = '{"a": ' * 1000 + "1" + "}" * 1000
    message = f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    cases = [
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {"type": '
               '"json_schema", "json_schema": {"name": "x", "schema": %s}}}' % schema),
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tool_choice": "required", '
               '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % schema),
        ("/v1/messages", '{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "q"}, '
                         '{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": %s}]}, '
                         '{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}'
                         % (MODEL, deep_input)),
        (COMPLETIONS, '{"prompt": "x", "max_tokens": 1, "extra": %s}' % ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)),
    ]
    for path, body in cases:
        assert assert_400(server, path, body.encode()) == message
    assert_serving(server)
    # as deep as the limit (the body's object is a level): read, the extra field ignored
    shallow = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    status, _, raw = request(server, "POST", COMPLETIONS,
                             data=b'{"prompt": "x", "max_tokens": 1, "extra": %s}' % shallow.encode())
    assert status == 200, raw[:300]
    # and JSON that is not one value inside the reader's padding is still not JSON
    for data in (b'{"prompt": "x"}, {"prompt": "y"}', b'{"prompt": "x"}]], [[1'):
        assert assert_400(server, COMPLETIONS, data).startswith("the request body is not valid JSON")


def test_json_texts_nested_too_deep_are_400(server, client):
    """JSON inside strings, read with json.loads: an earlier call's arguments (chat, Responses) and a schema sent as
    text raised RecursionError (500s)."""
    deep = "[" * 40_000 + "]" * 40_000
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "a", "content": "r"}])
    assert caught.value.body["param"] == "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, max_output_tokens=1, input=[
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep},
            {"type": "function_call_output", "call_id": "c", "output": "o"}])
    for extra in ({"guided_json": deep}, {"structured_outputs": {"json": deep}}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
    assert_serving(server)


def test_a_forced_call_nested_past_the_recursion_limit_is_answered(server, client):
    """A model made to write a call's arguments as arrays inside arrays (a recursive schema, "[[" biased) past
    Python's recursion limit: reading the text as a call raised RecursionError, a 500. It is a call cut by
    max_tokens now: text, finish_reason "length"."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
              "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=520, temperature=0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, logit_bias={str(DOUBLE_BRACKET): 100})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.count("[") > 1000


# ------------------------------------------------------------------------------------------------------- streams

def test_a_fault_after_the_200_ends_the_stream_with_an_error_event(server, monkeypatch):
    """An exception while a stream renders (after its 200 was sent) became a second HTTP response written into the
    chunked body: the client read a broken stream. It travels in the stream as the API's error now."""
    def fail(self, output, prompt_index=0):
        raise RuntimeError("renderer fault")

    monkeypatch.setattr(Responder, "events", fail)
    status, _, raw = request(server, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                    "stream": True})
    assert status == 200
    assert raw.endswith(b"data: [DONE]\n\n")
    errors = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert _error(errors[-1])["type"] == "server_error"
    monkeypatch.undo()
    assert_serving(server)


def test_an_anthropic_stream_fault_is_an_error_event(server, monkeypatch):
    from colibri_stream.server.render_anthropic import MessagesResponder

    def fail(self, output, prompt_index=0):
        raise RuntimeError("renderer fault")

    monkeypatch.setattr(MessagesResponder, "events", fail)
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()
    assert "internal server error" in str(caught.value)


# ------------------------------------------------------------------------------------------------- min_tokens

def test_min_tokens_the_output_format_cannot_reach_is_a_400(server, client):
    """min_tokens past what a grammar (or stop_token_ids over the whole vocabulary) lets the model write left no
    token to draw: the request failed as a 500 "generation failed". It is the request's own contradiction: a 400 on
    min_tokens, and an invalid_request_error in a stream."""
    for extra in ({"guided_choice": ["a"]}, {"stop_token_ids": list(range(8192))}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={"min_tokens": 5, **extra})
        assert caught.value.body["param"] == "min_tokens"
    status, _, raw = request(server, "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 10, "min_tokens": 5,
                                                           "guided_choice": ["a"], "stream": True})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    errors = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n") if line.startswith(b'data: {"error"')]
    assert _error(errors[0])["type"] == "invalid_request_error" and errors[0]["error"]["param"] == "min_tokens"
    assert_serving(server)
