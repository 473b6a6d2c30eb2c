"""tool_choice "auto" with Qwen3-Coder's XML calls (server/tool_syntax.py): parameters typed by the tool's schema,
on the real server through the official openai client (the tiny model steered by a structured_outputs regex),
and the parser's rules on their own."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import model_with_template
from test_server import API_KEY, LiveServer
from test_server_auto_tools import HERMES_TEMPLATE, call_deltas, regex, streamed

from colibri_stream.server.tool_syntax import QwenXmlToolSyntax, tool_syntax_of

pytest.importorskip("llguidance")
# Qwen3-Coder's template teaches the XML form; the marker the server reads it by is "<function="
XML_TEMPLATE = HERMES_TEMPLATE.replace("For each call return", "Call <function=name><parameter=key>value"
                                       "</parameter></function>, or return")
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                           "exact": {"type": "boolean"}, "tags": {"type": "array"},
                                           "score": {"type": ["number", "null"]}}}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
CALL = ("<tool_call>\n<function=search>\n<parameter=query>\nexperts\nin 2 lines\n</parameter>\n"
        "<parameter=limit>\n5\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n"
        '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=score>\nnull\n</parameter>\n</function>\n</tool_call>')
ARGUMENTS = {"query": "experts\nin 2 lines", "limit": 5, "exact": True, "tags": ["a", "b"], "score": None}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    folder = model_with_template(tiny_model_dir, tmp_path_factory.mktemp("xml") / "model", XML_TEMPLATE)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny")
    yield openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    live.close()
    shutil.rmtree(folder)


def ask(client, text: str, stream: bool = False):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Find experts"}],
                                          tools=TOOLS, max_tokens=500, temperature=0, stream=stream,
                                          extra_body=regex(text))


def test_xml_calls_come_back_with_typed_arguments(client):
    choice = ask(client, "Looking.\n" + CALL).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Looking.\n"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == ARGUMENTS
    content, calls, reason = streamed(ask(client, "Looking.\n" + CALL, stream=True))
    assert (content, reason, json.loads(calls[0]["arguments"])) == ("Looking.\n", "tool_calls", ARGUMENTS)


def test_streamed_xml_calls_send_the_name_first_then_a_parameter_at_a_time(client):
    """As vLLM's qwen3_coder parser streams: the call's id and name once `<function=...>` is written, then its
    arguments as JSON, a piece as each parameter closes and the closing brace at `</function>`; the pieces make
    the arguments the non-streamed answer has."""
    text = "Looking.\n" + CALL + "\n<tool_call>\n<function=search>\n</function>\n</tool_call>"
    chunks = list(ask(client, text, stream=True))
    deltas = call_deltas(chunks)
    first = [call for call, _ in deltas if call.index == 0]
    assert first[0].id.startswith("call_") and first[0].function.name == "search"
    assert first[0].function.arguments == "" and all(call.function.name is None for call in first[1:])
    assert len(first) > 3  # the parameters came one by one, not in one delta
    assert json.loads("".join(call.function.arguments for call in first)) == ARGUMENTS
    assert "".join(call.function.arguments for call in first) == json.dumps(ARGUMENTS)
    second = [call for call, _ in deltas if call.index == 1]
    assert second[0].function.name == "search" and "".join(c.function.arguments for c in second) == "{}"
    assert deltas[0][1] < deltas[-1][1]  # the first call went out before the reply ended
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_template_marker_picks_the_xml_syntax():
    assert isinstance(tool_syntax_of({"default": XML_TEMPLATE}), QwenXmlToolSyntax)
    assert not isinstance(tool_syntax_of({"default": HERMES_TEMPLATE}), QwenXmlToolSyntax)


SCHEMAS = {"search": SEARCH, "ping": {"type": "object"}}


@pytest.mark.parametrize(("text", "expected"), [
    (CALL, ARGUMENTS),
    ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", {}),
    ("<tool_call><function=search><parameter=limit>five</parameter></function></tool_call>", {"limit": "five"}),
    ("<tool_call><function=search><parameter=other>7</parameter></function></tool_call>", {"other": "7"}),
    ("<tool_call><function=search><parameter=score>1.5</parameter></function></tool_call>", {"score": 1.5}),
    ("<tool_call><function=nope></function></tool_call>", None),  # not a tool of the request
    ("<tool_call><function=search>stray<parameter=limit>1</parameter></function></tool_call>", None),
    ("<tool_call><function=search><parameter=limit>1</parameter></tool_call>", None),  # no </function>
    ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None),  # the JSON form is not this syntax
])
def test_xml_split(text, expected):
    split = QwenXmlToolSyntax().split(text, SCHEMAS)
    assert (None if split is None else json.loads(split[1][0]["function"]["arguments"])) == expected
