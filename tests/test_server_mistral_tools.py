"""tool_choice "auto" with Mistral's `[TOOL_CALLS]` syntax (server/tool_syntax.py) on the real server through the
official openai client.

The tiny model gets a tokenizer where `[TOOL_CALLS]` is a special token (as in Mixtral-8x22B-Instruct's) and a
Mistral-style template that shows it the tools. A Lark grammar (vLLM's structured_outputs) makes it write the
special token and a JSON array of calls: they come back as tool_calls, streamed or not, with the text before
them as content (the special token is not in it). Text without the tag, or with a tag not followed by calls of
the request's tools, stays content, whole (the tag included), and the end-of-sequence token never reaches it,
though such requests keep special tokens in their text.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import SPECIAL_TOKENS, linked_model, write_tokenizer
from test_server import API_KEY, LiveServer
from test_server_auto_tools import call_deltas, streamed

from colibri_stream.server.tool_syntax import MistralToolSyntax

pytest.importorskip("llguidance")
TOOL_CALLS_ID = len(SPECIAL_TOKENS)  # the special token after pad, bos and eos
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}'
    "{%- if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] {{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}<|im_end|>{% endif %}"
    "{%- endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "clock", "arguments": {}}]'


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    folder = linked_model(tiny_model_dir, tmp_path_factory.mktemp("mistral") / "model")
    write_tokenizer(folder, special_tokens=(*SPECIAL_TOKENS, "[TOOL_CALLS]"), chat_template=MISTRAL_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny")
    yield openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    live.close()
    shutil.rmtree(folder)


def ask(client, lark: str, stream: bool = False):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                          temperature=0, stream=stream,
                                          extra_body={"structured_outputs": {"grammar": lark}})


def written(*pieces: str) -> str:
    """A Lark grammar of exactly `pieces`: texts, and the [TOOL_CALLS] token where a piece is None."""
    return "start: " + " ".join(f"<[{TOOL_CALLS_ID}]>" if p is None else json.dumps(p) for p in pieces)


def test_the_special_token_and_its_calls_come_back_as_tool_calls(client):
    lark = written("Let me check.", None, " " + CALLS)
    choice = ask(client, lark).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("weather", {"city": "Paris"}), ("clock", {})]
    content, calls, reason = streamed(ask(client, lark, stream=True))
    assert (content, reason) == ("Let me check.", "tool_calls")
    assert [calls[i]["name"] for i in sorted(calls)] == ["weather", "clock"]


def test_streamed_calls_send_each_name_first_then_its_arguments_in_pieces(client):
    """As vLLM's mistral parser streams: each call's id and name as soon as its object names it, then its
    arguments' text in pieces as the model writes it; the pieces make the arguments the non-streamed answer has."""
    lark = written("Let me check.", None, ' [{"name": "weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}},'
                                          ' {"name": "clock", "arguments": {}}]')
    chunks = list(ask(client, lark, stream=True))
    deltas = call_deltas(chunks)
    first = [call for call, _ in deltas if call.index == 0]
    assert first[0].id.startswith("call_") and first[0].function.name == "weather"
    assert first[0].function.arguments == "" and all(call.function.name is None for call in first[1:])
    assert len(first) > 3  # the arguments came in pieces, not in one delta
    assert json.loads("".join(call.function.arguments for call in first)) == {"city": "Paris", "days": [1, 2, 3]}
    second = [call for call, _ in deltas if call.index == 1]
    assert second[0].function.name == "clock" and "".join(call.function.arguments for call in second) == "{}"
    assert deltas[0][1] < deltas[-1][1]  # the first call went out before the reply ended
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Let me check."


@pytest.mark.parametrize("pieces", [
    ("Just words.",),
    (None, " not JSON"),
    (None, ' [{"name": "unknown", "arguments": {}}]'),
    (None, ' []'),
    (None, ' [{"name": "clock", "arguments": 5}]'),
])
def test_text_that_is_not_calls_stays_content_without_special_tokens_leaking_in(client, pieces):
    text = "".join("[TOOL_CALLS]" if p is None else p for p in pieces)  # the tag's text, kept for such requests
    answer = ask(client, written(*pieces)).choices[0]
    assert (answer.message.content, answer.message.tool_calls, answer.finish_reason) == (text, None, "stop")
    content, calls, reason = streamed(ask(client, written(*pieces), stream=True))
    assert (content, calls, reason) == (text, {}, "stop")


@pytest.mark.parametrize(("text", "expected"), [
    ('[TOOL_CALLS] {"name": "clock", "arguments": {}}', ("", ["clock"])),
    ('Hi [TOOL_CALLS][{"name": "clock", "arguments": {"zone": "UTC"}, "id": "abc123xyz"}]', ("Hi ", ["clock"])),
    ("[TOOL_CALLS] []", None),
    ('[TOOL_CALLS] [{"name": "clock", "arguments": 5}]', None),
    ('[TOOL_CALLS] [{"name": "clock", "arguments": {}}] and more', None),
    ("no tag", None),
])
def test_mistral_split(text, expected):
    split = MistralToolSyntax().split(text, {"clock": {"type": "object"}})
    assert (None if split is None else (split[0], [c["function"]["name"] for c in split[1]])) == expected


@pytest.mark.parametrize("text", [
    'Hi [TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "U]T}C"}, "id": "a1"},'
    ' {"arguments": {}, "name": "weather"}]',
    '[TOOL_CALLS] {"name": "weather", "arguments": {"city": "Paris"}}',
    '[TOOL_CALLS] [{"name": "unknown", "arguments": {}}]',
])
def test_a_stream_read_a_character_at_a_time_reads_as_one_piece(text):
    """Where the model's tokens cut the text does not change what the stream sends."""
    def read(pieces):
        reader = MistralToolSyntax().stream_reader({"clock": {}, "weather": {}})
        outs = [reader.feed(piece) for piece in pieces] + [reader.finish()]
        content = "".join(content for content, _ in outs)
        calls: dict[int, str] = {}  # index -> name and arguments
        for _, deltas in outs:
            for delta in deltas:
                function = delta["function"]
                calls[delta["index"]] = calls.get(delta["index"], "") + function.get("name", "") + function["arguments"]
        return content, calls

    assert read(list(text)) == read([text])
