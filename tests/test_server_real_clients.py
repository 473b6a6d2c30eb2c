"""The server as client libraries drive it, each request here the payload a library sends (the OpenAI Agents SDK,
LangChain, instructor, the anthropic SDK's tool runner), replayed through the official openai and anthropic
clients on the real server: an agent with an output type whose tool_choice forces a call
sends an output format too; LangChain sends a tool's result as text parts in the Responses API; the anthropic
SDK's tool runner asks the server to hold the conversation (`thread`) and sends only the new turn after that."""

from __future__ import annotations

import json
from typing import Annotated

import anthropic
import openai
import orjson
import pydantic
import pytest
from test_server import API_KEY, request

pytest.importorskip("llguidance")
MODEL = "tiny"  # the name conftest.tiny_server serves the model under
# (schemas of few documents: the random model's strings would run to max_tokens)
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
         "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "digit", "description": "A digit", "parameters": DIGIT}}]
RESPONSES_TOOLS = [{"type": "function", "name": "digit", "description": "A digit", "parameters": DIGIT,
                    "strict": True}]
MESSAGES = [{"role": "user", "content": "Pick a digit"}]
GREEDY = {"temperature": 0}


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def claude(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key=API_KEY, max_retries=0, timeout=60)


def is_digit_call(name: str, arguments: dict) -> bool:
    return name == "digit" and set(arguments) == {"n"} and arguments["n"] in range(10)


# ------------------------------------------------------------------------- a forced call with an output format

def test_a_forced_call_with_an_output_format_is_answered_with_the_call(client, claude):
    """The Agents SDK sends an agent's output type as response_format (chat) or text.format (Responses) on every
    turn, tool_choice "required" included; instructor's RESPONSES_TOOLS mode sends text.format with a named
    function. Both were a 400 ("a forced tool call and response_format cannot be asked together"); OpenAI answers
    with the call, written under the tool's schema, not the format's."""
    chat_format = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": ANSWER, "strict": True}}
    for choice in ("required", {"type": "function", "function": {"name": "digit"}}):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=choice,
                                               response_format=chat_format, parallel_tool_calls=False,
                                               max_tokens=60, **GREEDY)
        (choice_0,) = reply.choices
        assert choice_0.finish_reason == "tool_calls", choice
        (call,) = choice_0.message.tool_calls
        assert is_digit_call(call.function.name, json.loads(call.function.arguments)), call
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS,
                                                     tool_choice=choice, response_format=chat_format,
                                                     parallel_tool_calls=False, max_tokens=60, stream=True,
                                                     **GREEDY))
        streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
        assert [c.function.arguments for c in streamed] == [call.function.arguments]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text_format = {"format": {"type": "json_schema", "name": "Answer", "schema": ANSWER, "strict": True}}
    response = client.responses.create(model=MODEL, input="Pick a digit", tools=RESPONSES_TOOLS,
                                       tool_choice={"type": "function", "name": "digit"}, text=text_format,
                                       max_output_tokens=60, **GREEDY)
    (item,) = response.output
    assert response.status == "completed" and item.type == "function_call"
    assert is_digit_call(item.name, json.loads(item.arguments))
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=MESSAGES,
                                     tools=[{"name": "digit", "input_schema": DIGIT}],
                                     tool_choice={"type": "tool", "name": "digit"},
                                     extra_body={"output_config": {"format": {"type": "json_schema",
                                                                              "schema": ANSWER}}, **GREEDY})
    (block,) = message.content
    assert message.stop_reason == "tool_use" and is_digit_call(block.name, block.input)


def test_the_output_format_beside_a_forced_call_is_still_checked(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice="required",
                                       response_format={"type": "json_schema", "json_schema": {"schema": ANSWER}},
                                       max_tokens=4)
    assert refused.value.body["param"] == "response_format.json_schema.name"


# ------------------------------------------------------------------ Responses: a function's output as text parts

def call_and_output(output) -> list[dict]:
    """The input LangChain sends for a conversation with one call and its result (a ToolMessage of text blocks
    becomes an output of input_text parts)."""
    return [{"type": "message", "role": "user", "content": "Pick a digit"},
            {"type": "function_call", "name": "digit", "arguments": '{"n": 3}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": output}]


def test_a_function_calls_output_may_be_text_parts(client):
    """The Responses API's function_call_output takes a string or an array of content parts; the parts were
    refused as "content of type 'input_text' is not supported; this model reads text only". They reach the
    template as the tool message's text: the prompt is the one the same text as a string gives."""
    as_string = client.responses.create(model=MODEL, input=call_and_output("sunny"), tools=RESPONSES_TOOLS,
                                        max_output_tokens=2, **GREEDY)
    as_parts = client.responses.create(model=MODEL, input=call_and_output([{"type": "input_text", "text": "sunny"}]),
                                       tools=RESPONSES_TOOLS, max_output_tokens=2, **GREEDY)
    assert as_parts.usage.input_tokens == as_string.usage.input_tokens
    assert as_parts.output_text == as_string.output_text
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=call_and_output([image]), tools=RESPONSES_TOOLS,
                                max_output_tokens=2)
    assert refused.value.body["param"] == "input[2].output"
    assert refused.value.body["code"] == "unsupported_parameter"


# ---------------------------------------------------------------------------- Anthropic: a thread the server holds

THREAD_UNSUPPORTED = "thread_unsupported_request"


def test_a_thread_is_refused_with_the_code_on_which_the_sdk_sends_the_whole_conversation(tiny_server, claude):
    """The anthropic SDK's tool runner sends `thread: {"type": "create"}`, then `{"type": "continue",
    "previous_message_id"}` with the new turn alone (no system, no tools). The field was ignored, so the second
    turn's tool_result answered no tool_use (a 400) and a text turn would be answered without its history. A
    thread is refused with error.details.error_code "thread_unsupported_request", on which the SDK goes on
    without a thread, sending the whole conversation."""
    body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES}
    for thread in ({"type": "create"}, {"type": "continue", "previous_message_id": "msg_0"}):
        status, _, raw = request(tiny_server, "POST", "/v1/messages", {**body, "thread": thread})
        error = orjson.loads(raw)
        assert status == 400 and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["details"] == {"error_code": THREAD_UNSUPPORTED}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**body, extra_body={"thread": {"type": "create"}})
    assert refused.value.body["error"]["details"]["error_code"] == THREAD_UNSUPPORTED
    status, _, raw = request(tiny_server, "POST", "/v1/messages", {**body, "thread": None})
    assert status == 200, raw[:200]


def test_the_sdks_tool_runner_runs_its_turns(claude):
    """Two turns, each forced to call the tool, the second answering the first's call: the runner's loop ends
    without an error whether or not the SDK threads its requests."""
    @anthropic.beta_tool
    def digit(n: Annotated[int, pydantic.Field(ge=0, le=9)]) -> str:
        """A digit."""
        return f"got {n}"

    runner = claude.beta.messages.tool_runner(model=MODEL, max_tokens=60, messages=MESSAGES, tools=[digit],
                                              tool_choice={"type": "tool", "name": "digit"}, max_iterations=2,
                                              extra_body=GREEDY)
    replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    assert all(is_digit_call(block.name, block.input) for reply in replies for block in reply.content)
