"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the real server, through the official
`anthropic` client and raw HTTP.

The tiny model is served under a Qwen-style template (test_server_auto_tools.HERMES_TEMPLATE: Hermes `<tool_call>`
blocks, `<think>` tags and enable_thinking), its text steered with vLLM's structured_outputs regex. Checked: a
message says what chat says for the same conversation, with Anthropic's id, stop_reason and usage; system and
content blocks render as chat's system and text; stop_sequences end the text (stop_reason stop_sequence); the SDK's
stream helper gets the same message; calls in the template's syntax come back as tool_use blocks (tool_choice
auto; streamed, the input in pieces as the model writes it, and a call that has begun stays one), a template
without a syntax answers in text, forced calls follow the tool's schema (any, tool), none leaves the text alone;
a failed model step is an api_error (an error event in a stream); tool_use and tool_result
blocks go back to the template as chat's tool_calls and tool messages; thinking reaches the template's
enable_thinking and the <think> text comes back as a thinking block; count_tokens counts what a message uses; the
streamed events come in Anthropic's order with their names; the key works as x-api-key and as Bearer; every
error on these routes is in Anthropic's shape with its status; what Anthropic refuses (a temperature above 1, empty
content, a tool_result that answers no call of the turn before) is a 400 in Anthropic's words.
"""

from __future__ import annotations

import json
import shutil

import anthropic
import openai
import orjson
import pytest
from conftest import model_with_template
from test_server import API_KEY, LiveServer, request
from test_server_auto_tools import CALL, HERMES_TEMPLATE, SECOND, TOOLS, WEATHER, regex

from colibri_stream.server.state import STATE

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_TOOLS = [{"name": "weather", "description": "The forecast", "input_schema": WEATHER},
                   {"name": "clock", "input_schema": {"type": "object"}}]  # test_server_auto_tools.TOOLS, Anthropic's
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
# The SDK's create() no longer names temperature, top_p and top_k (models that take them take them as extra fields)
GREEDY = {"temperature": 0}
GREEDY_TO_THE_END = {"temperature": 0, "ignore_eos": True}
MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The tiny model under HERMES_TEMPLATE, served as "tiny" behind the API key, bodies up to 1 MiB; the steps on
    a thread of this process, whose model a test reaches (`engine._core`)."""
    folder = model_with_template(tiny_model_dir, tmp_path_factory.mktemp("anthropic") / "model", HERMES_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=4, max_seq_len=1024, engine_process=False), api_key=API_KEY,
                      served_model_name=MODEL,
                      max_body_bytes=MAX_BODY_BYTES)
    yield live
    live.close()
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def write(client, text: str, **fields):
    """A message the model writes as `text` (steered by a regex), with the tools unless told otherwise."""
    return client.messages.create(model=MODEL, max_tokens=fields.pop("max_tokens", 400),
                                  messages=fields.pop("messages", MESSAGES), tools=fields.pop("tools", ANTHROPIC_TOOLS),
                                  extra_body={**regex(text), **GREEDY}, **fields)


def streamed(client, text: str, **fields):
    """The SDK stream helper's text and final message for the message `write` asks for."""
    with client.messages.stream(model=MODEL, max_tokens=fields.pop("max_tokens", 400),
                                messages=fields.pop("messages", MESSAGES), tools=fields.pop("tools", ANTHROPIC_TOOLS),
                                extra_body={**regex(text), **GREEDY}, **fields) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def blocks(message) -> list[dict]:
    """A message's content blocks as dicts, tool_use ids left out (each reply makes new ones)."""
    return [{k: v for k, v in block.model_dump(exclude_none=True).items() if k != "id"} for block in message.content]


def named_events(raw: bytes) -> list[dict]:
    """Parse an Anthropic SSE body strictly: every event is `event: <type>` and `data: <json of that type>`,
    then a blank line; comments (keep-alives) are skipped."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw[:-2].split(b"\n\n"):
        if block.startswith(b":"):
            continue
        name, data = block.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), block
        payload = orjson.loads(data[len(b"data: "):])
        assert payload["type"] == name[len(b"event: "):].decode(), block
        events.append(payload)
    return events


# ------------------------------------------------------------------------------------------------------- text

def test_a_message_says_what_chat_says_for_the_same_conversation(client, chat_client):
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                               messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
                                               extra_body={"ignore_eos": True})
    message = client.messages.create(model=MODEL, max_tokens=8, system="Be brief.", messages=MESSAGES,
                                     metadata={"user_id": "u1"}, extra_body=GREEDY_TO_THE_END)
    assert message.id.startswith("msg_") and (message.type, message.role, message.model) == ("message", "assistant",
                                                                                           MODEL)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    as_blocks = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY_TO_THE_END,
                                       system=[{"type": "text", "text": "Be brief."}],
                                       messages=[{"role": "user", "content": [{"type": "text",
                                                                               "text": MESSAGES[0]["content"]}]}])
    assert blocks(as_blocks) == blocks(message) and as_blocks.usage.input_tokens == chat.usage.prompt_tokens
    assert client.messages.count_tokens(model=MODEL, system="Be brief.", messages=MESSAGES).input_tokens == \
        message.usage.input_tokens


def test_stop_sequences_end_the_text_and_a_whole_text_ends_the_turn(client):
    message = write(client, "Hello world. Bye.", stop_sequences=["world", "zzz"], tools=[])
    assert message.content[0].text == "Hello " and message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "world"
    whole = write(client, "Just this.", tools=[])
    assert (whole.content[0].text, whole.stop_reason, whole.stop_sequence) == ("Just this.", "end_turn", None)
    text, final = streamed(client, "Hello world. Bye.", stop_sequences=["world"], tools=[])
    assert text == final.content[0].text == "Hello " and (final.stop_reason, final.stop_sequence) == (
        "stop_sequence", "world")


def test_the_sdk_stream_helper_gets_the_message_create_returns(client):
    fields = dict(model=MODEL, max_tokens=10, messages=MESSAGES, extra_body=GREEDY_TO_THE_END)
    message = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    assert final.id.startswith("msg_") and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (message.usage.input_tokens, 10)
    kinds = [event.type for event in client.messages.create(stream=True, **fields)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]


# ------------------------------------------------------------------------------------------------------- tools

def test_a_call_in_the_templates_syntax_is_a_tool_use_block(client):
    message = write(client, "Let me look.\n" + CALL + "\n" + SECOND)
    assert message.stop_reason == "tool_use"
    assert blocks(message) == [{"type": "text", "text": "Let me look.\n"},
                               {"type": "tool_use", "name": "weather", "input": {"city": "Paris", "days": 3}},
                               {"type": "tool_use", "name": "clock", "input": {}}]
    assert all(block.id.startswith("toolu_") for block in message.content[1:])
    text, final = streamed(client, "Let me look.\n" + CALL + "\n" + SECOND)
    assert text == "Let me look.\n" and blocks(final) == blocks(message) and final.stop_reason == "tool_use"
    alone = write(client, CALL)
    assert blocks(alone) == [{"type": "tool_use", "name": "weather", "input": {"city": "Paris", "days": 3}}]


NOT_CALLS = ["Plain words, no call at all.", "A tag <tool_ that never opens, and <tool_call> alone",
             '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>']  # (not one of the tools)
CUT_SHORT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("text", NOT_CALLS + [CALL + "\nand some words after it", CUT_SHORT])
def test_text_that_is_not_well_formed_calls_stays_text(client, text):
    message = write(client, text)
    assert blocks(message) == [{"type": "text", "text": text}] and message.stop_reason == "end_turn"


@pytest.mark.parametrize("text", NOT_CALLS)
def test_streamed_text_that_opens_no_call_stays_text(client, text):
    streamed_text, final = streamed(client, text)
    assert streamed_text == text and blocks(final) == [{"type": "text", "text": text}]
    assert final.stop_reason == "end_turn"


def test_a_streamed_call_goes_out_as_it_is_written_whatever_follows(client):
    """As chat streams calls (and vLLM): a call that has begun is not taken back; what follows it is text."""
    text, final = streamed(client, CALL + "\nand some words after it")
    assert text == "\nand some words after it" and final.stop_reason == "tool_use"
    assert blocks(final) == [{"type": "tool_use", "name": "weather", "input": {"city": "Paris", "days": 3}},
                             {"type": "text", "text": text}]
    text, final = streamed(client, CUT_SHORT)
    assert text == "" and [block.type for block in final.content] == ["tool_use"]
    assert final.stop_reason == "end_turn"  # the call never closed


UNITS = {"name": "units", "input_schema": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}},
                                            "required": ["unit"], "additionalProperties": False}}
SWITCH = {"name": "switch", "input_schema": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                             "required": ["on"], "additionalProperties": False}}


def test_forced_calls_follow_the_tools_schema(client):
    # (a schema of few documents: the random model's strings would run to max_tokens)
    for choice in ({"type": "tool", "name": "units"}, {"type": "any", "disable_parallel_tool_use": True}):
        fields = dict(model=MODEL, max_tokens=200, messages=MESSAGES, tools=[UNITS, SWITCH],
                      tool_choice=choice, extra_body=GREEDY)
        message = client.messages.create(**fields)
        assert message.stop_reason == "tool_use", choice
        (call,) = message.content
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.input in ({"unit": "C"}, {"unit": "F"}) if call.name == "units" else call.input in (
            {"on": True}, {"on": False})
        assert call.name == "units" if choice["type"] == "tool" else call.name in ("units", "switch")
        with client.messages.stream(**fields) as stream:
            final = stream.get_final_message()
        assert blocks(final) == blocks(message) and final.stop_reason == "tool_use"
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "weather"}, extra_body=GREEDY)
    assert [block.type for block in cut.content] == ["text"] and cut.stop_reason == "max_tokens"
    assert cut.content[0].text.startswith("{")  # the call's text as far as it got


def test_tool_choice_none_leaves_the_text_alone_and_hides_the_tools(client):
    message = write(client, CALL, tool_choice={"type": "none"})
    assert blocks(message) == [{"type": "text", "text": CALL}] and message.stop_reason == "end_turn"
    shown = write(client, "x").usage.input_tokens
    assert write(client, "x", tool_choice={"type": "none"}).usage.input_tokens < shown - 20


def test_tool_use_and_tool_result_go_back_as_chats_tool_calls_and_tool_messages(client, chat_client):
    history = [*MESSAGES,
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C"},
                   {"type": "text", "text": "And tomorrow?"}]}]
    chat_history = [*MESSAGES,
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [
                        {"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 24 C"},
                    {"role": "user", "content": "And tomorrow?"}]
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=1, messages=chat_history, tools=TOOLS,
                                               extra_body=regex("S"))
    message = write(client, "Sunny again.", messages=history)
    assert message.content[0].text == "Sunny again."
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == chat.usage.prompt_tokens
    as_blocks = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 24 C"}]},
        {"type": "text", "text": "And tomorrow?"}]}]
    assert client.messages.count_tokens(model=MODEL, messages=as_blocks, tools=ANTHROPIC_TOOLS).input_tokens == \
        counted.input_tokens
    # a failed call: the tool message the template shows starts "Error: " (chat's form of the same message)
    failed = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": True},
        {"type": "text", "text": "And tomorrow?"}]}]
    chat_failed = [*chat_history[:2], {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
                   chat_history[-1]]
    chat = chat_client.chat.completions.create(model=MODEL, max_tokens=1, messages=chat_failed, tools=TOOLS,
                                               extra_body=regex("S"))
    assert client.messages.count_tokens(model=MODEL, messages=failed, tools=ANTHROPIC_TOOLS).input_tokens == \
        chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError, match="is_error must be a boolean"):
        client.messages.count_tokens(model=MODEL, messages=[*history[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "is_error": "yes"}]}])


def test_a_model_whose_template_teaches_no_tool_syntax_answers_in_text(tiny_server):
    """(conftest's ChatML template: tool_choice auto, the default, is a text answer there, as in chat.)"""
    plain = anthropic.Anthropic(base_url=tiny_server.url, api_key=API_KEY, max_retries=0, timeout=60)
    fields = dict(model=MODEL, max_tokens=6, messages=MESSAGES, tools=ANTHROPIC_TOOLS, extra_body=GREEDY_TO_THE_END)
    message = plain.messages.create(**fields)
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "max_tokens"
    with plain.messages.stream(**fields) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    # thinking asks nothing of a template without enable_thinking
    thinking = plain.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 4})
    assert thinking.usage.input_tokens == message.usage.input_tokens


# ---------------------------------------------------------------------------------------------------- thinking

def test_the_think_text_is_a_thinking_block_and_thinking_reaches_the_template(client):
    text = "<think>\nPlan.\n</think>\n\nParis is sunny."
    message = write(client, text, thinking={"type": "enabled", "budget_tokens": 100})
    assert blocks(message) == [{"type": "thinking", "thinking": "\nPlan.\n", "signature": ""},
                               {"type": "text", "text": "Paris is sunny."}]
    streamed_text, final = streamed(client, text, thinking={"type": "enabled", "budget_tokens": 100})
    assert streamed_text == "Paris is sunny." and blocks(final) == blocks(message)
    call = write(client, "<think>\nx\n</think>\n\n" + CALL)
    assert [block.type for block in call.content] == ["thinking", "tool_use"] and call.stop_reason == "tool_use"

    def input_tokens(**fields) -> int:
        return write(client, "x", tools=[], **fields).usage.input_tokens

    plain = input_tokens()
    assert input_tokens(thinking={"type": "disabled"}) > plain  # the template's empty think block
    assert input_tokens(thinking={"type": "enabled", "budget_tokens": 100}) == plain
    assert input_tokens(thinking={"type": "adaptive"}) == plain


# ------------------------------------------------------------------------------------------------ raw HTTP, SSE

def test_a_stream_sends_anthropics_named_events_in_order(server):
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "stream": True, "messages": MESSAGES,
            "tools": ANTHROPIC_TOOLS, **regex("<think>\nhm\n</think>\n\nLet me look.\n" + CALL)}
    status, headers, raw = request(server, "POST", "/v1/messages", body, headers=HEADERS, key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream") and b"[DONE]" not in raw
    events = named_events(raw)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    opened = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in opened] == [0, 1, 2]
    assert [e["content_block"]["type"] for e in opened] == ["thinking", "text", "tool_use"]
    assert opened[2]["content_block"]["input"] == {} and opened[2]["content_block"]["name"] == "weather"
    for index, delta_type in ((0, "thinking_delta"), (1, "text_delta"), (2, "input_json_delta")):
        own = [e for e in events[2:-2] if e["index"] == index]
        assert own[0]["type"] == "content_block_start" and own[-1]["type"] == "content_block_stop"
        assert {e["type"] for e in own[1:-1]} == {"content_block_delta"}
        assert {e["delta"]["type"] for e in own[1:-1]} == {delta_type}
    # each block closes before the next one opens
    assert [e["type"] for e in events[2:-2] if e["type"] != "content_block_delta"] == \
        ["content_block_start", "content_block_stop"] * 3
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "\nhm\n"
    assert "".join(d.get("text", "") for d in deltas) == "Let me look.\n"
    pieces = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == {"city": "Paris", "days": 3}  # streamed as written
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] > 0


def test_an_empty_reply_has_an_empty_text_block_streamed_or_not(server):
    body = {"model": MODEL, "max_tokens": 20, "messages": MESSAGES, "stop_sequences": ["H"], **regex("Hi")}
    status, reply = post(server, body)
    assert status == 200 and reply["content"] == [{"type": "text", "text": ""}]
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", "H")
    status, _, raw = request(server, "POST", "/v1/messages", dict(body, stream=True), headers=HEADERS, key=None)
    kinds = [e["type"] for e in named_events(raw)]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]


# ---------------------------------------------------------------------------------------------- keys and errors

def post(server, body, headers=HEADERS, path="/v1/messages", **kwargs) -> tuple[int, dict]:
    status, _, raw = request(server, "POST", path, body, headers=headers, key=None, **kwargs)
    return status, orjson.loads(raw)


def anthropic_error(reply: dict, kind: str) -> str:
    """The message of an error body in Anthropic's shape of type `kind`."""
    assert set(reply) == {"type", "error"} and reply["type"] == "error", reply
    assert reply["error"]["type"] == kind and isinstance(reply["error"]["message"], str), reply
    return reply["error"]["message"]


BODY = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES}


def test_the_key_works_as_x_api_key_and_as_bearer(server):
    assert post(server, BODY)[0] == 200
    assert post(server, BODY, headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200
    assert post(server, BODY, headers={"x-api-key": API_KEY})[0] == 200  # anthropic-version may be left out
    for headers in ({"x-api-key": "wrong"}, {}, {"Authorization": "Bearer wrong"}, {"x-api-key": ""}):
        status, reply = post(server, BODY, headers=headers)
        assert status == 401 and "API key" in anthropic_error(reply, "authentication_error"), headers
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**BODY)
    assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"
    # the OpenAI routes take x-api-key too, and keep OpenAI's error shape
    chat = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES}
    assert post(server, chat, headers={"x-api-key": API_KEY}, path="/v1/chat/completions")[0] == 200
    status, reply = post(server, chat, headers={"x-api-key": "wrong"}, path="/v1/chat/completions")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("fields, named", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}]}, "tool_use_id"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "weather",
                                                                 "input": "Paris"}]}, *MESSAGES]}, "tool_use"),
    ({"system": 5}, "system"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": 5}, "stop_sequences"),
    ({"metadata": "x"}, "metadata"),
    ({"tools": [{"name": "weather"}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    ({"tools": ANTHROPIC_TOOLS + ANTHROPIC_TOOLS[:1]}, "used twice"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
     "disable_parallel_tool_use"),
    ({"tool_choice": {"type": "any"}}, "tools"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4}}, "budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "adaptive"}, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "effort"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
])
def test_a_bad_field_is_a_400_in_anthropics_shape_naming_it(server, fields, named):
    body = {k: v for k, v in {**BODY, **fields}.items() if v is not None}
    status, reply = post(server, body)
    assert status == 400 and named in anthropic_error(reply, "invalid_request_error"), (fields, reply)


CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Paris"}}]}
NON_EMPTY = "all messages must have non-empty content except for the optional final assistant message"
UNANSWERED = ("unexpected `tool_use_id` found in `tool_result` blocks: toolu_2. Each `tool_result` block must have "
              "a corresponding `tool_use` block in the previous message.")


def result(tool_use_id: str) -> dict:
    """A user message holding the tool_result of the call `tool_use_id`."""
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "Sunny"}]}


@pytest.mark.parametrize("fields, message", [
    ({"temperature": 5}, "temperature must be between 0 and 1, got 5"),
    ({"temperature": -0.1}, "temperature must be between 0 and 1, got -0.1"),
    ({"temperature": 1.01}, "temperature must be between 0 and 1, got 1.01"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0]: " + NON_EMPTY),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0]: " + NON_EMPTY),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": ""}, *MESSAGES]}, "messages[1]: " + NON_EMPTY),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": []}, *MESSAGES]}, "messages[1]: " + NON_EMPTY),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}]},
     "messages[0].content[1]: text content blocks must be non-empty"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": ""}]}, *MESSAGES]},
     "messages[1].content[0]: text content blocks must be non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": " \n\t"}]}]},
     "messages[0].content[0]: text content blocks must contain non-whitespace text"),
    ({"messages": [*MESSAGES, CALLED, result("toolu_2")]}, "messages[2].content[0]: " + UNANSWERED),
    ({"messages": [result("toolu_2")]}, "messages[0].content[0]: " + UNANSWERED),  # no assistant turn before it
    # toolu_2 was called two turns before: the assistant turn just before it called nothing
    ({"messages": [*MESSAGES, {**CALLED, "content": [{**CALLED["content"][0], "id": "toolu_2"}]}, result("toolu_2"),
                   {"role": "assistant", "content": "Sunny."}, result("toolu_2")]},
     "messages[4].content[0]: " + UNANSWERED),
])
def test_what_anthropic_refuses_is_a_400_with_anthropics_message(server, client, fields, message):
    body = {**BODY, **fields}
    status, reply = post(server, body)
    assert status == 400 and anthropic_error(reply, "invalid_request_error") == message, reply
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=body["messages"],
                               extra_body={k: v for k, v in fields.items() if k != "messages"})
    assert refused.value.body["error"] == {"type": "invalid_request_error", "message": message}
    if "messages" in fields:  # count_tokens reads the same conversation
        status, reply = post(server, {"model": MODEL, "messages": body["messages"]},
                             path="/v1/messages/count_tokens")
        assert status == 400 and anthropic_error(reply, "invalid_request_error") == message, reply


def test_what_anthropic_accepts_next_to_its_refusals_is_accepted(server):
    """Temperatures 0 and 1; a tool_result answering a call of the assistant turn before its own where either turn
    is several messages (Anthropic combines consecutive messages of one role); an empty final assistant message
    passes the non-empty rule, as with Anthropic, and is refused as any last assistant message is (prefill)."""
    for temperature in (0, 0.5, 1):
        assert post(server, dict(BODY, temperature=temperature))[0] == 200
    combined = [*MESSAGES, CALLED, {"role": "assistant", "content": "Let me look."},
                {"role": "user", "content": "Well?"}, result("toolu_1")]
    status, reply = post(server, dict(BODY, messages=combined))
    assert status == 200, reply
    for empty in ("", []):
        status, reply = post(server, dict(BODY, messages=[*MESSAGES, {"role": "assistant", "content": empty}]))
        assert status == 400 and "(prefill) is not supported" in anthropic_error(reply, "invalid_request_error")


def test_every_error_on_these_routes_is_in_anthropics_shape(server, client):
    status, _, raw = request(server, "POST", "/v1/messages", data=b'{"model": ', headers=HEADERS, key=None)
    assert status == 400 and "JSON" in anthropic_error(orjson.loads(raw), "invalid_request_error")
    status, reply = post(server, dict(BODY, model="claude-sonnet-4-5"))
    assert status == 404 and MODEL in anthropic_error(reply, "not_found_error")
    status, _, raw = request(server, "GET", "/v1/messages", headers=HEADERS, key=None)
    assert status == 405 and anthropic_error(orjson.loads(raw), "invalid_request_error")
    status, reply = post(server, BODY, path="/v1/messages/nothing")
    assert status == 404 and anthropic_error(reply, "not_found_error")
    status, reply = post(server, dict(BODY, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]))
    assert status == 413 and anthropic_error(reply, "request_too_large")
    status, reply = post(server, dict(BODY, max_tokens=5000))
    assert status == 400 and "context length" in anthropic_error(reply, "invalid_request_error")
    status, reply = post(server, {"model": MODEL}, path="/v1/messages/count_tokens")
    assert status == 400 and "messages" in anthropic_error(reply, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"temperature": -1})
    assert refused.value.status_code == 400 and refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    assert post(server, BODY)[0] == 200  # and the server goes on serving


def test_a_failed_model_step_is_an_api_error_and_in_a_stream_an_error_event(server, client):
    runner = server.app[STATE].engine._core.runner
    execute = runner.execute

    def broken(step):
        raise RuntimeError("device lost")

    runner.execute = broken
    try:
        status, reply = post(server, BODY)
        assert status == 500 and "device lost" in anthropic_error(reply, "api_error")
        status, _, raw = request(server, "POST", "/v1/messages", dict(BODY, stream=True), headers=HEADERS, key=None)
        events = named_events(raw)
        assert status == 200 and [e["type"] for e in events] == ["message_start", "ping", "error"]
        assert "device lost" in anthropic_error(events[-1], "api_error")
        with pytest.raises(anthropic.APIStatusError) as failed:
            with client.messages.stream(**BODY) as stream:
                stream.get_final_message()
        assert failed.value.body["error"]["type"] == "api_error"
    finally:
        runner.execute = execute
    assert post(server, BODY)[0] == 200


def test_no_value_of_any_field_is_a_500(server):
    values = [None, True, 0, -1, 1.5, "", "x", [], [{}], {}, {"type": "text"}, [5], {"type": None}]
    names = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
             "tools", "tool_choice", "thinking", "metadata", "output_config"]
    for name in names:
        for value in values:
            status, reply = post(server, dict(BODY, **{name: value}))
            assert status in (200, 400) or (status, name) == (404, "model"), (name, value, reply)
            if status != 200:
                anthropic_error(reply, "invalid_request_error" if status == 400 else "not_found_error")
    for value in values:
        message = [{"role": "user", "content": [value]}, {"role": "assistant", "content": [value]}, *MESSAGES]
        status, reply = post(server, dict(BODY, messages=message))
        assert status in (200, 400), (value, reply)


def test_anthropic_clients_list_models_in_anthropic_shape(client, server):
    """Anthropic's clients (they send anthropic-version) get its Models API's page and ModelInfo; OpenAI's the list
    they know."""
    page = client.models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [(MODEL, "model", MODEL)]
    assert page.has_more is False and page.first_id == page.last_id == MODEL
    assert page.data[0].created_at.tzinfo is not None
    one = client.models.retrieve(MODEL)
    assert (one.id, one.type, one.created_at) == (MODEL, "model", page.data[0].created_at)
    status, _, raw = request(server, "GET", "/v1/models")
    listed = orjson.loads(raw)
    assert status == 200 and listed["object"] == "list" and listed["data"][0]["object"] == "model"
