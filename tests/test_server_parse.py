"""The request parsers, field by field, without HTTP: every API's known fields set to each wrong type and each
out-of-range value are a 400 APIError of type invalid_request_error naming the field (test_server_edge_cases.py
sends a few of these requests to the real server too). Bodies go through the JSON text and orjson, as the server
reads them (an integer past 64 bits arrives as a float)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from colibri_stream.errors import APIError
from colibri_stream.server.generate_request import GenerateRequest
from colibri_stream.server.parse_anthropic import parse_messages
from colibri_stream.server.parse_openai import parse_chat, parse_completion
from colibri_stream.server.parse_responses import parse_response

MESSAGES = [{"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# the numeric fields chat and completions share: (field, wrong values)
BAD_NUMBERS = [
    ("max_tokens", [0, -1, True, "5", 1.5, 2.0]),
    ("n", [0, -1, 17, True, "2", 2.0, 10**30]),
    ("temperature", [-0.1, 100.5, True, "0.5", 1e308]),
    ("top_p", [-0.01, -1, 1.01, False, "1"]),
    ("top_k", [-2, 1.0, True, "3"]),
    ("min_p", [-0.1, 1.1, True]),
    ("presence_penalty", [2.5, -2.5, True]),
    ("frequency_penalty", [2.5, -2.5, "0"]),
    ("repetition_penalty", [0, -1, 1e-300, 0.001, 10.5, True]),
    ("seed", [1.5, True, "7", 2**64, -(2**63) - 1, 10**30]),
    ("stop_token_ids", [5, [1.5], [True], ["1"]]),
    ("min_tokens", [-1, 1.5, True, "1"]),
    ("prompt_logprobs", [-1, 21, 1.5, True]),
    ("truncate_prompt_tokens", [0, -2, 1.5, True, "8"]),
]
NOT_BOOLEANS = [1, 0, "true", [], {}]
NOT_STRINGS = [5, True, [], {}]
NOT_OBJECTS = [[], "x", 5, True]
NOT_ARRAYS = ["x", 5, {}, True]
# the other fields chat and completions share
COMMON = BAD_NUMBERS + [
    ("stream", NOT_BOOLEANS),
    ("ignore_eos", NOT_BOOLEANS),
    ("skip_special_tokens", NOT_BOOLEANS),
    ("include_stop_str_in_output", NOT_BOOLEANS),
    ("model", NOT_STRINGS),
    ("user", NOT_STRINGS),
    ("stop", [5, [1], [None], {}, True]),
    ("logit_bias", [[], "x", 5, {"x": 1}, {"-1": 1}, {"01": 1}, {"5": "1"}, {"5": True}, {"5": 101}]),
    ("best_of", [0, -1, True, 1.5]),
    ("response_format", [5, "json", {"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}},
                         {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
                         {"type": "json_schema", "json_schema": {"name": 5}},
                         {"type": "json_schema", "json_schema": {"name": "has space"}},
                         {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
                         {"type": "json_schema", "json_schema": {"name": "a", "description": {}}}]),
    ("guided_regex", [5, [], "("]),
    ("guided_choice", ["x", [], [1]]),
    ("guided_json", [5, "{"]),
]
CHAT_FIELDS = COMMON + [
    ("messages", [None, [], "Hello", [5], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
                  [{"role": "user", "content": [{"type": "image_url"}]}]]),
    ("logprobs", NOT_BOOLEANS),
    ("top_logprobs", [-1, 21, 1.5, True]),
    ("max_completion_tokens", [0, -1, True, "5", 1.5]),
    ("tools", NOT_ARRAYS + [[5], [{"type": "function"}]]),
    ("tool_choice", [5, "banana", []]),
    ("parallel_tool_calls", NOT_BOOLEANS),
    ("chat_template_kwargs", NOT_OBJECTS + [{"self": 1}, {"messages": []}, {"not an identifier": 1}]),
    ("add_generation_prompt", NOT_BOOLEANS),
    ("echo", [True]),
    ("prompt", ["Hello"]),
]
COMPLETION_FIELDS = COMMON + [
    ("prompt", [None, 5, True, {}, [], [1.5], [[1, "2"]], [-1], ["a", [1]]]),
    ("logprobs", [-1, 21, 1.5, True, "1"]),
    ("echo", NOT_BOOLEANS),
    ("suffix", NOT_STRINGS),
    ("messages", [MESSAGES]),
    ("max_completion_tokens", [5]),
    ("top_logprobs", [2]),
]
RESPONSE_FIELDS = [
    ("input", [None, "", [], 5, {}, [5], [{"type": "image"}], [{"role": "user", "content": 5}]]),
    ("max_output_tokens", [0, -1, True, "5", 1.5]),
    ("temperature", [-0.1, 100.5, True, "0.5"]),
    ("top_p", [-0.01, 1.01, False, "1"]),
    ("stream", NOT_BOOLEANS),
    ("store", NOT_BOOLEANS),
    ("metadata", NOT_OBJECTS),
    ("instructions", NOT_STRINGS),
    ("model", NOT_STRINGS),
    ("text", NOT_OBJECTS + [{"format": {"type": "xml"}}]),
    ("tools", NOT_ARRAYS + [[5], [{"type": "web_search"}]]),
    ("tool_choice", [5, "banana"]),
    ("parallel_tool_calls", NOT_BOOLEANS),
    ("reasoning", NOT_OBJECTS + [{"effort": "extreme"}, {"summary": "auto"}]),
    ("include", NOT_ARRAYS + [["message.output_text.logprobs"]]),
    ("previous_response_id", ["resp_1"]),
    ("truncation", ["auto"]),
]
MESSAGE_FIELDS = [
    ("model", [None, 5, True, [], {}]),
    ("max_tokens", [None, 0, -1, True, "5", 1.5]),
    ("messages", [None, [], "Hello", [5], [{"role": "system", "content": "x"}], [{"role": "user", "content": 5}],
                  [{"role": "user", "content": [{"type": "image"}]}], [{"role": "assistant", "content": "x"}]]),
    ("system", [5, [5], {}]),
    ("temperature", [-0.1, 100.5, True, "0.5"]),
    ("top_p", [-0.01, 1.01, False]),
    ("top_k", [-2, 1.0, True]),
    ("stop_sequences", [5, [1], {}]),
    ("stream", NOT_BOOLEANS),
    ("metadata", NOT_OBJECTS),
    ("tools", NOT_ARRAYS + [[5], [{"name": "f"}], [{"type": "web_search_20250305", "name": "web_search"}]]),
    ("tool_choice", NOT_OBJECTS + [{"type": "banana"}, {"type": "auto", "disable_parallel_tool_use": 1}]),
    ("thinking", NOT_OBJECTS + [{"type": "maybe"}, {"type": "enabled"}, {"type": "enabled", "budget_tokens": 64}]),
    ("output_config", NOT_OBJECTS + [{"effort": "high"}, {"format": {"type": "xml"}}]),
]

Parse = Callable[[Any], GenerateRequest]
APIS: dict[str, tuple[Parse, dict, list]] = {
    "chat": (parse_chat, {"messages": MESSAGES, "max_tokens": 2}, CHAT_FIELDS),
    "completions": (parse_completion, {"prompt": "Hello", "max_tokens": 2}, COMPLETION_FIELDS),
    "responses": (parse_response, {"input": "Hello", "max_output_tokens": 2}, RESPONSE_FIELDS),
    "messages": (parse_messages, {"model": "m", "messages": MESSAGES, "max_tokens": 64}, MESSAGE_FIELDS),
}


def wire(body: dict) -> Any:
    """`body` as the server reads it: written as JSON text (the standard module writes any integer), read by
    orjson."""
    return orjson.loads(json.dumps(body))


def named(name: str, param: str | None) -> bool:
    """Whether an error's `param` names the field `name` (itself, or a part of it: messages[0].role)."""
    return param is not None and (param == name or param.startswith((name + "[", name + ".")))


def cases(fields: list) -> list[tuple[str, Any]]:
    return [(name, value) for name, values in fields for value in values]


@pytest.mark.parametrize("api", list(APIS))
def test_the_good_body_parses(api):
    parse, good, _ = APIS[api]
    assert isinstance(parse(wire(good)), GenerateRequest)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", list(APIS))
def test_each_wrong_field_is_a_400_naming_it(api, stream):
    parse, good, fields = APIS[api]
    wrong = []
    for name, value in cases(fields):
        body = {**good, "stream": stream, name: value}
        if value is None:
            del body[name]
        try:
            parse(wire(body))
        except APIError as error:
            if not (error.status == 400 and error.type == "invalid_request_error" and named(name, error.param)):
                wrong.append((name, value, error.status, error.type, error.param, error.message))
        else:
            wrong.append((name, value, "accepted"))
    assert not wrong, wrong


@pytest.mark.parametrize("api", list(APIS))
def test_a_body_that_is_no_object_is_a_400(api):
    parse = APIS[api][0]
    for body in ([1, 2], "text", 5, None, True):
        with pytest.raises(APIError) as info:
            parse(body)
        assert info.value.status == 400 and "JSON object" in info.value.message


def test_stream_options_need_a_stream():
    for parse, good in ((parse_chat, {"messages": MESSAGES}), (parse_completion, {"prompt": "Hello"})):
        with pytest.raises(APIError) as info:
            parse(wire(dict(good, stream_options={"include_usage": True})))
        assert info.value.param == "stream_options"
        with pytest.raises(APIError) as info:
            parse(wire(dict(good, stream=True, stream_options={"include_usage": "yes"})))
        assert info.value.param == "stream_options.include_usage"
        with pytest.raises(APIError) as info:
            parse(wire(dict(good, prompt_logprobs=1, stream=True)))
        assert info.value.param == "prompt_logprobs"
        assert parse(wire(dict(good, stream=True, stream_options={"include_usage": True}))).include_usage


def test_unsupported_features_say_so():
    """A feature this server does not implement is a 400 with code unsupported_parameter, naming the field."""
    for parse, good, name, value in (
            (parse_chat, {"messages": MESSAGES}, "functions", [{"name": "f"}]),
            (parse_chat, {"messages": MESSAGES}, "modalities", ["text", "audio"]),
            (parse_chat, {"messages": MESSAGES}, "continue_final_message", True),
            (parse_chat, {"messages": MESSAGES}, "chat_template", "{{ x }}"),
            (parse_completion, {"prompt": "x"}, "suffix", "end"),
            (parse_completion, {"prompt": "x"}, "tools", TOOLS),
            (parse_completion, {"prompt": "x", "n": 2}, "best_of", 3),
            (parse_response, {"input": "x"}, "previous_response_id", "resp_1"),
            (parse_messages, {"model": "m", "messages": MESSAGES, "max_tokens": 8}, "output_config",
             {"effort": "high"})):
        with pytest.raises(APIError) as info:
            parse(wire(dict(good, **{name: value})))
        assert info.value.code == "unsupported_parameter" and named(name, info.value.param), info.value.body()


def test_a_tool_choice_needs_its_tools():
    """A tool_choice that names a call is refused naming tools where there are none, tool_choice where it names
    none of them."""
    anthropic_tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    for parse, good, choice, param in (
            (parse_chat, {"messages": MESSAGES}, {"type": "function", "function": {"name": "nope"}}, "tools"),
            (parse_chat, {"messages": MESSAGES, "tools": TOOLS}, {"type": "function", "function": {"name": "nope"}},
             "tool_choice"),
            (parse_messages, {"model": "m", "messages": MESSAGES, "max_tokens": 8}, {"type": "any"}, "tools"),
            (parse_messages, {"model": "m", "messages": MESSAGES, "max_tokens": 8, "tools": anthropic_tools},
             {"type": "tool", "name": "nope"}, "tool_choice.name")):
        with pytest.raises(APIError) as info:
            parse(wire(dict(good, tool_choice=choice)))
        assert info.value.status == 400 and info.value.param == param, info.value.body()
