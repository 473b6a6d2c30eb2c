"""Forced tool calls in chat completions (server/tools.py) through the official openai client on the real server:
a named function or tool_choice "required" gives tool_calls whose arguments are valid under the tools' schemas
(finish_reason "tool_calls"), streamed as the client accumulates them; the client's `parse` helper fills a pydantic
model; a conversation holding earlier calls and their results is accepted; a call cut by max_tokens comes back as
text; what is malformed is a 400 naming the field. (tool_choice "auto" with this model's template, which teaches no
tool-call syntax: test_server_defects.py.)"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from test_server import API_KEY

pytest.importorskip("llguidance")
MODEL = "tiny"  # the name conftest.tiny_server serves the model under
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") and \
            1 <= arguments["days"] <= 9
    return call.function.name == "clock" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


def choice_of(reply):
    (choice,) = reply.choices
    return choice


def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = choice_of(reply)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    assert valid_call(call)


def test_required_calls_stream_and_a_conversation_carries_them_back(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                           temperature=0, tool_choice="required")
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                            temperature=0, tool_choice="required", parallel_tool_calls=False)
    assert len(choice_of(single).message.tool_calls) == 1 and valid_call(choice_of(single).message.tool_calls[0])
    calls = choice_of(reply).message.tool_calls
    assert calls and all(valid_call(call) for call in calls) and choice_of(reply).finish_reason == "tool_calls"
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                                        temperature=0, tool_choice="required", stream=True)
              if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                          {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 24 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=0)
    assert choice_of(answer).message.content is not None


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^(Paris|Rome)$")
    days: int = pydantic.Field(ge=1, le=9)


def test_the_clients_parse_helper_fills_a_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                          tools=[openai.pydantic_function_tool(Weather)],
                                          tool_choice={"type": "function", "function": {"name": "Weather"}})
    parsed = choice_of(reply).message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and parsed.city in ("Paris", "Rome")


def test_a_call_cut_by_max_tokens_comes_back_as_text(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = choice_of(reply)
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools[2]", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tool_choice": "required"},
     "tools[0].function.parameters", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "xml"}}, "response_format", None),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "weather",
                                                                                  "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", None),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "weather",
                                                                                  "arguments": "1" * 5000}}]}]},
     "messages[1].tool_calls[0].function.arguments", None),  # an integer past Python's 4300 digits
])
def test_what_is_malformed_is_a_400_naming_the_field(client, fields, param, code):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body)
    assert (refused.value.body["param"], refused.value.body["code"]) == (param, code)
