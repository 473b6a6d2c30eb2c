"""A Qwen-style chat template on the real server through the official openai client: tool_choice "auto"
(server/tool_syntax.py), reasoning (server/reasoning.py) and the template's own variables.

The tiny model gets a chat template that shows it the tools and teaches Hermes `<tool_call>` blocks. Its weights
are random, so the tests steer its text with vLLM's structured_outputs regex: what it then writes in the
template's syntax comes back as tool_calls (finish_reason "tool_calls"), the text before them as content,
streamed or not, one call or several; a text that is not well-formed calls of the request's tools stays content,
whole, streamed or not; tool_choice "none" leaves the text alone; the template shows the tools only when asked
to call them; chat_template_kwargs (Qwen3's enable_thinking) and add_generation_prompt reach the template; the
reply's <think> text comes back as reasoning_content, streamed or not, also before calls and when the prompt
opened the tag (not with --no-reasoning-parser), its tokens counted as reasoning_tokens. In the Responses API
the calls are function_call items after the message of the text before them and the reasoning a reasoning item
before both, in OpenAI's event order; earlier reasoning goes back in the input. A model whose template teaches
no syntax refuses "auto" (test_server_tools.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from typing import Any

import aiohttp

import openai
import pydantic
import pytest
from conftest import model_with_template
from test_server import API_KEY, LiveServer, request

from colibri_stream.server.state import STATE
from colibri_stream.server.tool_streams import HeldText
from colibri_stream.server.tool_syntax import HermesToolSyntax

pytest.importorskip("llguidance")
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'For each call return {"name": <function-name>, "arguments": <args-json-object>} within '
    "<tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif thinking_opened is defined %}<think>\n{% endif %}"
    "{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'


def regex(text: str) -> dict:
    """extra_body that makes the model write exactly `text`."""
    escaped = "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with HERMES_TEMPLATE as its chat template, served as "tiny"."""
    folder = model_with_template(tiny_model_dir, tmp_path_factory.mktemp("hermes") / "model", HERMES_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=4, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny")
    yield live
    live.close()
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def client(hermes_server):
    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def ask(client, text: str, stream: bool = False, **fields):
    return client.chat.completions.create(model="tiny", messages=fields.pop("messages", MESSAGES), max_tokens=400,
                                          temperature=fields.pop("temperature", 0), tools=fields.pop("tools", TOOLS),
                                          stream=stream, extra_body=regex(text), **fields)


def streamed(chunks) -> tuple[str, dict[int, dict], str | None]:
    """(the content, the tool calls by index as the client accumulates them, the finish_reason) of a stream."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def call_deltas(chunks) -> list[tuple[Any, int]]:
    """(each tool_calls delta of a stream, the index of its chunk)."""
    return [(call, i) for i, chunk in enumerate(chunks) if chunk.choices
            for call in chunk.choices[0].delta.tool_calls or ()]


def test_a_call_in_the_templates_syntax_comes_back_as_tool_calls(client):
    answer = ask(client, "Let me look.\n" + CALL)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    content, calls, reason = streamed(ask(client, "Let me look.\n" + CALL, stream=True))
    assert (content, reason) == ("Let me look.\n", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("weather",
                                                                                  {"city": "Paris", "days": 3})]


def test_several_calls_and_no_content(client):
    text = CALL + "\n" + SECOND
    answer = ask(client, text)
    assert answer.choices[0].message.content is None
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["weather", "clock"]
    content, calls, reason = streamed(ask(client, text, stream=True))
    assert content == "" and reason == "tool_calls" and sorted(calls) == [0, 1]
    assert [calls[i]["name"] for i in (0, 1)] == ["weather", "clock"] and calls[1]["arguments"] == "{}"


NOT_CALLS = [
    "Plain words, no call at all.",
    "A tag <tool_ that never opens, and <tool_call> alone",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # not one of the request's tools
    '<tool_call>\n{"name": "weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
]
CALL_ARGUMENTS = '{"city": "Paris", "days": 3}'  # CALL's, as the model writes them


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """As vLLM: with parallel_tool_calls false, of the calls the model writes under "auto" only the first is kept,
    streamed or not."""
    text = CALL + "\n" + SECOND
    answer = ask(client, text, parallel_tool_calls=False)
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["weather"]
    assert answer.choices[0].finish_reason == "tool_calls"
    content, calls, reason = streamed(ask(client, text, stream=True, parallel_tool_calls=False))
    assert reason == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("text", NOT_CALLS + [
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Pa',  # cut short
    CALL + "\nand some words after it",
    CALL + "\n<tool_ca",
])
def test_text_that_is_not_well_formed_calls_stays_content_whole(client, text):
    answer = ask(client, text)
    assert answer.choices[0].message.content == text and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("text", NOT_CALLS)
def test_streamed_text_that_opens_no_call_is_content_whole(client, text):
    content, calls, reason = streamed(ask(client, text, stream=True))
    assert (content, calls, reason) == (text, {}, "stop")


@pytest.mark.parametrize(("text", "content", "arguments", "reason"), [
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Pa', "", '{"city": "Pa', "stop"),  # cut short
    (CALL + "\nand some words after it", "\nand some words after it", CALL_ARGUMENTS, "tool_calls"),
    (CALL + "\n<tool_ca", "\n<tool_ca", CALL_ARGUMENTS, "tool_calls"),
])
def test_a_streamed_call_goes_out_as_it_is_written_whatever_follows(client, text, content, arguments, reason):
    """As vLLM streams calls: a call that has begun is not taken back; what follows it is content."""
    streamed_content, calls, finish_reason = streamed(ask(client, text, stream=True))
    assert (streamed_content, finish_reason) == (content, reason)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("weather", arguments)]


def test_streamed_arguments_arrive_in_pieces_after_the_name(client):
    """vLLM's streaming: the call's id and name first, then its arguments' text in pieces as the model writes it,
    then the end; the pieces make the arguments the non-streamed answer has."""
    chunks = list(ask(client, "Let me look.\n" + CALL + "\n" + SECOND, stream=True))
    pieces = call_deltas(chunks)
    first = [call for call, _ in pieces if call.index == 0]
    assert first[0].id.startswith("call_") and first[0].function.name == "weather"
    assert first[0].function.arguments == "" and all(call.function.name is None for call in first[1:])
    assert len(first) > 3  # the arguments came in pieces, not in one delta
    assert "".join(call.function.arguments for call in first) == CALL_ARGUMENTS
    last_piece = max(i for _, i in pieces)
    assert chunks[last_piece].choices[0].finish_reason is None  # the end in a chunk of its own
    assert [c.choices[0].finish_reason for c in chunks[last_piece + 1:] if c.choices] == ["tool_calls"]
    whole = ask(client, "Let me look.\n" + CALL + "\n" + SECOND).choices[0].message.tool_calls
    assert json.loads(whole[0].function.arguments) == json.loads(CALL_ARGUMENTS)


def test_no_chunk_holds_two_entries_of_one_call(client):
    """A call's name and the first piece of its arguments go out in chunks of their own, as OpenAI streams a call:
    stream helpers of the openai SDK before 3.14 keep one entry per call and chunk."""
    chunks = list(ask(client, "Let me look.\n" + CALL + "\n" + SECOND, stream=True))
    for chunk in chunks:
        for choice in chunk.choices:
            indexes = [call.index for call in choice.delta.tool_calls or []]
            assert len(indexes) == len(set(indexes)), chunk
    assert sum(1 for c in chunks for choice in c.choices if choice.delta.tool_calls) > 3


def test_tool_choice_none_leaves_the_text_alone_and_hides_the_tools(client):
    answer = ask(client, CALL, tool_choice="none")
    assert answer.choices[0].message.content == CALL and answer.choices[0].finish_reason == "stop"
    shown = ask(client, "x").usage.prompt_tokens
    hidden = ask(client, "x", tool_choice="none").usage.prompt_tokens
    assert shown > hidden + 20  # the template listed the tools only when they may be called


def test_a_conversation_with_earlier_calls_and_results_goes_on(client):
    first = ask(client, CALL).choices[0].message
    history = MESSAGES + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 24 C"}]
    answer = ask(client, "It is sunny in Paris.", messages=history)
    assert answer.choices[0].message.content == "It is sunny in Paris."


@pytest.mark.parametrize("pieces", [
    ["Hi <tool", "_call>\n{}", "</tool_call>"],
    ["Hi <", "t", "ool_call", ">{}"],
    ["<tool_call>{}"],
    ["a<to", "x <tool_c", "all>"],
])
def test_held_text_sends_all_before_the_tag_and_nothing_after(pieces):
    held = HeldText(HermesToolSyntax.opening)
    sent = "".join(held.feed(piece) for piece in pieces)
    whole = "".join(pieces)
    assert sent == whole[:whole.index("<tool_call>")] and held.rest() == whole[len(sent):]


def test_held_text_holds_only_what_may_begin_the_tag():
    held = HeldText(HermesToolSyntax.opening)
    assert held.feed("Hello <to") == "Hello " and held.feed("day") == "<today" and held.rest() == ""
    assert not held.in_calls


RESPONSE_TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER},
                  {"type": "function", "name": "clock", "parameters": {"type": "object"}}]


def respond(client, text: str, stream: bool = False):
    return client.responses.create(model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS,
                                   max_output_tokens=400, temperature=0, stream=stream, extra_body=regex(text))


def test_responses_auto_calls_are_function_call_items_after_the_text_before_them(client):
    response = respond(client, "Let me look.\n" + CALL + "\n" + SECOND)
    message, first, second = response.output
    assert response.status == "completed" and message.type == "message" and response.output_text == "Let me look.\n"
    assert (first.type, first.name, json.loads(first.arguments)) == ("function_call", "weather",
                                                                    {"city": "Paris", "days": 3})
    assert (second.name, second.arguments) == ("clock", "{}")
    events = list(respond(client, "Let me look.\n" + CALL, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-8:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed_text == final.output_text == "Let me look.\n" and final.output[1].name == "weather"
    assert events[-4].output_index == 1 and events[-4].delta == final.output[1].arguments


def test_responses_calls_alone_and_text_alone(client):
    events = list(respond(client, CALL, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert [item.type for item in respond(client, CALL).output] == ["function_call"]
    text = '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'
    events = list(respond(client, text, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text == respond(client, text).output_text
    assert events[-1].response.output[0].type == "message" and len(events[-1].response.output) == 1


def test_no_value_of_the_tool_fields_is_a_500(hermes_server):
    values = [None, True, 0, "", "auto", "required", "none", [], {}, [None], [{}], [{"type": "function"}],
              [{"type": "function", "function": {"name": ""}}], {"type": "function"}, [1, "a"], "\u0000"]
    for path, base in (("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS}),
                       ("/v1/responses", {"input": "hi", "tools": RESPONSE_TOOLS})):
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            for value in values:
                body = {**base, "model": "tiny", "max_tokens" if "messages" in base else "max_output_tokens": 3,
                        name: value}
                status, _, raw = request(hermes_server, "POST", path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
                assert status in (200, 400), (path, name, value, raw[:300])
                assert status == 200 or "error" in json.loads(raw), (path, name, value)


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(client):
    def prompt_tokens(**fields) -> int:
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                              extra_body=fields).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain  # Qwen3's empty think block
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_tokens(add_generation_prompt=False) < plain
    assert prompt_tokens(chat_template_kwargs={"add_generation_prompt": False}) < plain
    for fields, param in [({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                          ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                          ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
                          ({"chat_template_kwargs": {"add_generation_prompt": "yes"}}, "chat_template_kwargs"),
                          ({"chat_template_kwargs": []}, "chat_template_kwargs"),
                          ({"add_generation_prompt": 1}, "add_generation_prompt"),
                          ({"chat_template": "{{ messages }}"}, "chat_template")]:
        with pytest.raises(openai.BadRequestError) as refused:
            prompt_tokens(**fields)
        assert refused.value.body["param"] == param, fields


def extra(message_or_delta, name: str = "reasoning_content"):
    return (message_or_delta.model_extra or {}).get(name)


def test_the_think_text_is_reasoning_content_and_the_rest_content(client):
    text = "<think>\nThe user wants Paris.\n</think>\n\nParis is sunny."
    message = ask(client, text).choices[0].message
    assert (extra(message), message.content) == ("\nThe user wants Paris.\n", "Paris is sunny.")
    chunks = list(ask(client, text, stream=True))
    reasoning = "".join(extra(c.choices[0].delta) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("\nThe user wants Paris.\n", "Paris is sunny.")
    plain = ask(client, "No thinking here.")
    assert plain.choices[0].message.content == "No thinking here." and extra(plain.choices[0].message) is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    usage = ask(client, text).usage
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    response = respond(client, text).usage
    assert 0 < response.output_tokens_details.reasoning_tokens < response.output_tokens


def test_reasoning_before_calls_and_a_reply_cut_while_thinking(client):
    answer = ask(client, "<think>\nCall the tool.\n</think>\n\n" + CALL).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert extra(answer.message) == "\nCall the tool.\n" and answer.message.tool_calls[0].function.name == "weather"
    content, calls, reason = streamed(ask(client, "<think>\nCall the tool.\n</think>\n\n" + CALL, stream=True))
    assert (content, reason, calls[0]["name"]) == ("", "tool_calls", "weather")
    cut = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body=regex("<think>\n" + "x" * 200))
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == ""
    assert extra(cut.choices[0].message).startswith("\nxx")
    assert cut.usage.completion_tokens_details.reasoning_tokens == cut.usage.completion_tokens == 12


def test_a_prompt_that_opens_the_tag_makes_the_reply_start_inside_it(client):
    fields = {"chat_template_kwargs": {"thinking_opened": True}, **regex("I see.\n</think>\n\nParis.")}
    message = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0,
                                             extra_body=fields).choices[0].message
    assert (extra(message), message.content) == ("I see.\n", "Paris.")


def test_without_the_reasoning_parser_the_think_text_stays_content(hermes_server):
    live = LiveServer(hermes_server.model_dir, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY,
                      served_model_name="tiny", reasoning_parser=False)
    try:
        raw = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        text = "<think>\nhmm\n</think>\n\nParis."
        message = raw.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0,
                                              extra_body=regex(text)).choices[0].message
        assert message.content == text and extra(message) is None
    finally:
        live.close()


def test_responses_put_the_think_text_in_a_reasoning_item_before_the_message(client):
    text = "<think>\nPlan.\n</think>\n\nParis."
    response = respond(client, text)
    reasoning, message = response.output
    assert (reasoning.type, reasoning.content[0].type, reasoning.content[0].text) == ("reasoning", "reasoning_text",
                                                                                     "\nPlan.\n")
    assert message.type == "message" and response.output_text == "Paris."
    events = list(respond(client, text, stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:kinds.index("response.reasoning_text.done")]) == {"response.reasoning_text.delta"}
    assert kinds[kinds.index("response.reasoning_text.done"):first_text] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.output_index for e in events if e.type.startswith("response.reasoning_text")] == \
        [0] * kinds.count("response.reasoning_text.delta") + [0]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nPlan.\n"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Paris."
    with client.responses.stream(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, max_output_tokens=400,
                                 temperature=0, extra_body=regex("<think>\nx\n</think>\n\n" + CALL)) as stream:
        done = stream.get_final_response()
    assert [item.type for item in done.output] == ["reasoning", "function_call"]
    assert done.output[1].name == "weather"


def test_earlier_reasoning_goes_back_in_the_input(client):
    first = respond(client, "<think>\nx\n</think>\n\n" + CALL)
    reasoning, call = first.output
    answer = client.responses.create(model="tiny", max_output_tokens=3, input=[
        {"role": "user", "content": "Weather?"}, reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id, "output": "sun"}])
    assert answer.status in ("completed", "incomplete")
    chat = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
        *MESSAGES, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
        {"role": "user", "content": "And Rome?"}])
    assert chat.choices[0].finish_reason == "length"
    for bad in ({"role": "user", "content": "x", "reasoning_content": "y"},
                {"role": "assistant", "content": "x", "reasoning_content": 5}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[*MESSAGES, bad])
        assert refused.value.body["param"] == "messages[1].reasoning_content"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", max_output_tokens=2, input=[
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": "not parts"}, {"role": "user",
                                                                                        "content": "x"}])
    assert refused.value.body["param"] == "input[0].content"


def test_each_of_n_choices_has_its_own_reasoning_and_calls(client):
    text = "<think>\nhm\n</think>\n\n" + CALL
    answer = ask(client, text, n=2, temperature=1.0, seed=4)
    assert [c.finish_reason for c in answer.choices] == ["tool_calls", "tool_calls"]
    assert all(extra(c.message) == "\nhm\n" and c.message.tool_calls[0].function.name == "weather"
               for c in answer.choices)
    by_choice: dict[int, list] = {0: [], 1: []}
    for chunk in ask(client, text, stream=True, n=2, temperature=1.0, seed=4):
        for choice in chunk.choices:
            by_choice[choice.index].append(chunk.model_copy(update={"choices": [choice]}))
    for chunks in by_choice.values():
        content, calls, reason = streamed(chunks)
        reasoning = "".join(extra(c.choices[0].delta) or "" for c in chunks)
        assert (reasoning, content, reason, calls[0]["name"]) == ("\nhm\n", "", "tool_calls", "weather")


class Weather(pydantic.BaseModel):
    city: str
    days: int


def test_the_sdks_stream_helper_closes_each_call_with_its_parsed_arguments(client):
    tools = [openai.pydantic_function_tool(Weather, name="weather")]
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=tools, max_tokens=400, temperature=0,
                                        extra_body=regex("Sure.\n" + CALL + "\n" + CALL)) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.index, e.parsed_arguments) for e in done] == [(i, Weather(city="Paris", days=3)) for i in (0, 1)]
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content == "Sure.\n"


def test_concurrent_mixed_requests_each_get_their_own_answer(hermes_server, client):
    """Tool calls, reasoning, grammars, Responses and a client that leaves, all at once: each answer is the one the
    request gets alone, the leaver's sequence is freed, and the server goes on."""
    think_call = "<think>\nhm\n</think>\n\n" + CALL
    alone = {"calls": ask(client, CALL).choices[0].message.tool_calls[0].function.arguments,
             "think": extra(ask(client, think_call).choices[0].message),
             "plain": ask(client, "Just text.").choices[0].message.content}
    base = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 400, "temperature": 0}

    async def post(session, path: str, body: dict) -> dict:
        async with session.post(hermes_server.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def leaver(session) -> None:
        body = dict(base, stream=True, max_tokens=300, **regex("y" * 300))
        async with session.post(hermes_server.url + "/v1/chat/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")

    async def everything() -> list:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            chat = "/v1/chat/completions"
            return await asyncio.gather(
                *(post(session, chat, dict(base, **regex(CALL))) for _ in range(3)),
                *(post(session, chat, dict(base, **regex(think_call))) for _ in range(3)),
                *(post(session, chat, dict(base, **regex("Just text."))) for _ in range(3)),
                post(session, "/v1/responses", {"model": "tiny", "input": "Weather?", "tools": RESPONSE_TOOLS,
                                                 "max_output_tokens": 400, **regex(think_call)}),
                leaver(session))

    answers = asyncio.run(everything())
    calls, thinks, plains, response = answers[:3], answers[3:6], answers[6:9], answers[9]
    assert all(a["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == alone["calls"] for a in calls)
    assert all(a["choices"][0]["message"]["reasoning_content"] == alone["think"] for a in thinks)
    assert all(a["choices"][0]["message"]["content"] == alone["plain"] for a in plains)
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    engine = hermes_server.app[STATE].engine
    for _ in range(100):  # the leaver's sequence is aborted once the server notices the closed connection
        if engine.stats().kv_blocks_used == 0:
            break
        time.sleep(0.05)
    assert engine.stats().kv_blocks_used == 0
    assert ask(client, "Still here.").choices[0].message.content == "Still here."
