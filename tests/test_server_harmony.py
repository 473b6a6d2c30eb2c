"""gpt-oss's harmony replies read by channel (server/harmony.py): analysis as reasoning, final as content, a
commentary message to a function as a tool call. On the real server through the openai client, serving a tiny
random gpt-oss model (exported from transformers, NumPy backend) with a chat template of our own that writes
harmony messages, the reply steered by a structured_outputs regex; chat and Responses, streamed and not; a reply
that breaks the format stays content; forced calls (tool_choice "required" or named) are tool calls. Then the
stream's rules on their own, fed whole and a character at a time."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import MAX_POSITIONS, TOKENIZER_VOCAB_SIZE, model_with_template, write_tokenizer
from test_server import API_KEY, LiveServer
from test_server_auto_tools import extra, regex, streamed
from tiny_models import build_hf_model

from colibri_stream.server.harmony import HARMONY_TOOL_SYNTAX, HarmonyStream, harmony_in

pytest.importorskip("llguidance")

# as gpt-oss's template, earlier answers in the final channel
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}"
                    "{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m['content'] or '' }}"
                    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
THINK = "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant"
ANSWER = THINK + "<|channel|>final<|message|>Hello there!"
CALL = (THINK + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from colibri_stream.export import export_model

    root = tmp_path_factory.mktemp("gpt_oss")
    build_hf_model("gpt_oss", root / "hf", vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS)
    export_model(root / "hf", root / "exported", dtype="fp32", progress=False)
    write_tokenizer(root / "exported")
    folder = model_with_template(root / "exported", root / "model", HARMONY_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny")
    yield openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    live.close()
    shutil.rmtree(root)


def chat(client, reply: str, stream: bool = False, **fields):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, temperature=0,
                                          stream=stream, extra_body=regex(reply), **fields)


def test_analysis_is_reasoning_and_final_is_content(client):
    message = chat(client, ANSWER).choices[0].message
    assert (extra(message), message.content) == ("The user greets me.", "Hello there!")
    reasoning, content = "", ""
    for chunk in chat(client, ANSWER, stream=True):
        delta = chunk.choices[0].delta
        reasoning += extra(delta) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The user greets me.", "Hello there!")


def test_a_commentary_message_to_a_function_is_a_tool_call(client):
    choice = chat(client, CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert extra(choice.message) == "The user greets me."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    content, calls, reason = streamed(chat(client, CALL, stream=True, tools=TOOLS))
    assert (content, reason, calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        "", "tool_calls", "get_weather", {"city": "Paris"})


def test_responses_put_the_analysis_in_a_reasoning_item(client):
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=300, temperature=0,
                                       extra_body=regex(ANSWER))
    reasoning, message = response.output
    assert (reasoning.type, reasoning.content[0].text) == ("reasoning", "The user greets me.")
    assert message.type == "message" and response.output_text == "Hello there!"


@pytest.mark.parametrize("reply", ["Just plain words.", "<|channel|>final<|message|>Hi<|end|>stray words"])
def test_a_reply_that_breaks_the_format_stays_content(client, reply):
    message = chat(client, reply).choices[0].message
    assert extra(message) is None
    assert "words" in message.content


def feed(text: str, step: int | None) -> tuple[str, str, bool]:
    stream = HarmonyStream()
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece, 1)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c, stream.thought


@pytest.mark.parametrize("step", [None, 1, 2, 5])
@pytest.mark.parametrize(("text", "expected"), [
    (ANSWER, ("The user greets me.", "Hello there!", True)),
    (CALL, ("The user greets me.", 'to=functions.get_weather<|message|>{"city": "Paris"}<|call|>', True)),
    # the recipient before the channel, and the call's own ending token written out
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.ping<|channel|>commentary json'
     '<|message|>{}<|call|>', ("x", "to=functions.ping<|message|>{}<|call|>", True)),
    ("<|channel|>analysis<|message|>cut off mid thought", ("cut off mid thought", "", True)),
    ("<|channel|>commentary<|message|>A preamble.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     ("", "A preamble.Done.", False)),
    ("No harmony at all.", ("", "No harmony at all.", False)),
    ("<|channel|>final<|message|>Hi<|end|>stray words", ("", "Hi<|end|>stray words", False)),  # markup kept
    ("<|chan", ("", "<|chan", False)),
    ("<|message|>no channel", ("", "<|message|>no channel", False)),
])
def test_the_stream_splits_by_channel_in_any_pieces(text, expected, step):
    assert feed(text, step) == expected


def test_the_calls_syntax_and_the_template_marker():
    calls = HARMONY_TOOL_SYNTAX.split('to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>',
                                      {"get_weather": {}})
    assert calls[0] == "" and json.loads(calls[1][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert HARMONY_TOOL_SYNTAX.split("to=functions.nope<|message|>{}<|call|>", {"get_weather": {}}) is None
    assert HARMONY_TOOL_SYNTAX.split("to=functions.get_weather<|message|>[1]<|call|>", {"get_weather": {}}) is None
    assert harmony_in({"default": HARMONY_TEMPLATE}) and not harmony_in({"default": "<|im_start|>"})


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_on_a_harmony_model_are_tool_calls(client, tool_choice):
    """tool_choice "required" or a named function writes the call under its grammar, as on any model: the harmony
    reader keeps the channel tokens out of that reply, and the call is a tool call, streamed and not (one call: the
    random model would repeat calls until max_tokens)."""
    fields = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0, tools=FORCED_TOOLS,
                  tool_choice=tool_choice, parallel_tool_calls=False)
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and extra(choice.message) is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    content, calls, reason = streamed(client.chat.completions.create(stream=True, **fields))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]


def test_harmony_replies_are_read_by_channel_without_the_reasoning_parser(tmp_path):
    """--no-reasoning-parser leaves <think> text in the content; a harmony reply is still read by channel (its
    answer and its calls are messages of their own), so the answer is the content and the call a tool call."""
    from colibri_stream.export import export_model

    build_hf_model("gpt_oss", tmp_path / "hf", vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS)
    export_model(tmp_path / "hf", tmp_path / "exported", dtype="fp32", progress=False)
    write_tokenizer(tmp_path / "exported")
    folder = model_with_template(tmp_path / "exported", tmp_path / "model", HARMONY_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny",
                      reasoning_parser=False)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        message = chat(client, ANSWER).choices[0].message
        assert (extra(message), message.content) == ("The user greets me.", "Hello there!")
        choice = chat(client, CALL, tools=TOOLS).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    finally:
        live.close()
