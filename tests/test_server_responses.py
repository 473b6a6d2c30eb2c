"""The Responses API (POST /v1/responses) through the official openai client on the real server: the same text as
chat completions for the same messages, OpenAI's stream event sequence (the SDK's stream helper included), the
status and usage, forced function calls as function_call items (and their outputs sent back), and a 400 naming the
field for what the server does not do; no value of any field is a 500."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import API_KEY, request

MODEL = "tiny"  # the name conftest.tiny_server serves the model under
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about experts"}]
STOPS = [" ", "e", "a", "\n"]  # one of these comes early in any text


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_a_stream_that_fails_after_its_200_ends_in_openais_error_events(tiny_server, client):
    """Raw SSE: every event named by its type, an `error` event then `response.failed` (its error's code and
    message) once the request's own constraints leave no token (a choice of one word, min_tokens past it), and
    no `[DONE]`; the SDK reads the two as typed events."""
    body = {"model": MODEL, "input": "Answer:", "max_output_tokens": 12, "stream": True,
            "structured_outputs": {"choice": ["yes"]}, "min_tokens": 6}
    status, _, raw = request(tiny_server, "POST", "/v1/responses", body)
    blocks = [block for block in raw.decode().split("\n\n") if block.strip()]
    assert status == 200 and blocks and all(block.startswith("event: ") for block in blocks)
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
    assert [b.split("\n", 1)[0][len("event: "):] for b in blocks] == [e["type"] for e in events]
    error, failed = events[-2:]
    assert error["type"] == "error" and "no token is allowed next" in error["message"]
    assert error["code"] == "invalid_request_error" and error["param"] == "min_tokens"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": error["code"], "message": error["message"]}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    typed = list(client.responses.create(stream=True, extra_body={"structured_outputs": {"choice": ["yes"]},
                                                                  "min_tokens": 6},
                                         **{k: body[k] for k in ("model", "input", "max_output_tokens")}))
    assert [event.type for event in typed[-2:]] == ["error", "response.failed"]


def test_a_response_says_what_chat_says_for_the_same_messages(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    response = client.responses.create(model=MODEL, instructions=MESSAGES[0]["content"],
                                       input=[{"role": "user", "content": [{"type": "input_text",
                                                                             "text": MESSAGES[1]["content"]}]}],
                                       max_output_tokens=8, temperature=0, reasoning={"effort": None},
                                       include=["reasoning.encrypted_content"],
                                       extra_body={"ignore_eos": True})  # a reasoning object that asks nothing
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    plain = client.responses.create(model=MODEL, input=MESSAGES[1]["content"], max_output_tokens=64,
                                    temperature=0, extra_body={"stop": STOPS})
    assert plain.status == "completed" and plain.incomplete_details is None
    assert not any(stop in plain.output_text for stop in STOPS)


def test_a_streamed_response_sends_openais_event_sequence(client):
    stream = client.responses.create(model=MODEL, input="Tell me about experts", max_output_tokens=10,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # cut by max_output_tokens (test_server_defects.py)
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.usage.output_tokens == 10
    assert text == client.responses.create(model=MODEL, input="Tell me about experts", max_output_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True}).output_text
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=64, temperature=0,
                                 extra_body={"stop": STOPS}) as helper:
        deltas = "".join(event.delta for event in helper if event.type == "response.output_text.delta")
        assert helper.get_final_response().output_text == deltas


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": ""}, "input"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"instructions": "x", "input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     "input[1].role"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"metadata": {"k": 5}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": [{"role": "user", "content": "a", "id": 5}]}, "input[0].id"),
    ({"input": [{"role": "user", "content": "a", "status": "done"}]}, "input[0].status"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {}}, "stream_options"),  # without stream
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": 5}}}, "text.format.strict"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"instructions": 5}, "instructions"),
    ({"model": "other"}, "model"),
])
def test_what_the_server_does_not_do_is_a_400_naming_the_field(tiny_server, client, fields, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    status, _, raw = request(tiny_server, "POST", "/v1/responses", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == ((404, param) if param == "model" else (400, param)), error
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).status in ("completed", "incomplete")


def test_no_value_of_any_field_is_a_500(tiny_server):
    fields = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
              "tool_choice", "previous_response_id", "reasoning", "text", "top_logprobs", "include", "truncation",
              "store", "metadata", "user", "background", "conversation", "prompt", "seed", "stop",
              "structured_outputs", "parallel_tool_calls"]
    values = [None, True, False, 0, -1, 1.5, "", "x", [], {}, [None], [[]], {"type": None}, {"format": 5}, 2**70,
              [1, "a"], "\u0000", {"regex": "("}, {"choice": ["a", "b"]}]
    for name in fields:
        for value in values:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, name: value}
            status, _, raw = request(tiny_server, "POST", "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
            assert status < 500, (name, value, raw[:300])
            if status >= 400:
                assert "error" in json.loads(raw), (name, value)


def test_a_prompt_over_the_context_names_input(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="experts " * 400, max_output_tokens=2)
    assert refused.value.body["param"] == "input" and refused.value.body["code"] == "context_length_exceeded"


TOOL = {"type": "function", "name": "weather", "description": "The forecast", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                       "additionalProperties": False}}


def test_a_forced_function_call_is_a_function_call_item_and_its_output_goes_back(client):
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=40,
                                       temperature=0, tool_choice={"type": "function", "name": "weather"})
    (item,) = response.output
    assert response.status == "completed" and item.type == "function_call" and item.name == "weather"
    assert json.loads(item.arguments)["city"] in ("Paris", "Rome") and item.call_id.startswith("call_")
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                          max_output_tokens=160, temperature=0, stream=True,
                                          parallel_tool_calls=False))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert events[3].delta == events[4].arguments == events[-1].response.output[0].arguments
    with client.responses.stream(model=MODEL, input="Weather?", tools=[TOOL], tool_choice="required",
                                 max_output_tokens=160, temperature=0, parallel_tool_calls=False) as stream:
        assert stream.get_final_response().output[0].type == "function_call"
    answer = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert answer.output[0].type == "message"


def test_the_response_object_repeats_the_requests_settings(client):
    """instructions, tools, tool_choice, text.format, metadata, parallel_tool_calls and reasoning.effort come back
    as the request gave them (they were the defaults whatever the request said), streamed or not; store stays
    false (nothing is stored)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text_format = {"type": "json_schema", "name": "place", "schema": schema}
    asked = dict(model=MODEL, instructions="Answer in JSON.", input="Where?", max_output_tokens=24, temperature=0,
                 tools=[TOOL], tool_choice="none", parallel_tool_calls=False, metadata={"run": "7"},
                 text={"format": text_format})
    for response in (client.responses.create(**asked),
                     [e for e in client.responses.create(**asked, stream=True)][-1].response):
        assert response.instructions == "Answer in JSON." and response.metadata == {"run": "7"}
        assert response.tool_choice == "none" and response.parallel_tool_calls is False
        assert [tool.name for tool in response.tools] == [TOOL["name"]]
        assert response.text.format.type == "json_schema" and response.text.format.name == "place"
        assert response.store is False
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, reasoning={"effort": "low"})
    assert plain.instructions is None and plain.tools == [] and plain.tool_choice == "auto"  # the API's default
    assert plain.reasoning.effort == "low" and plain.text.format.type == "text"
