"""tool_choice "auto" in the syntaxes of GLM-4.5, MiniMax-M2, DeepSeek-V3 and Kimi K2 (server/tool_syntax.py), with
DeepSeek-R1's reasoning before its calls: each on the real server through the official openai client, serving a
tiny random model of its own family (exported from transformers, on the NumPy backend) with a chat template of our
own that teaches the syntax, the reply steered by a structured_outputs regex; streamed and not; and each parser's
rules on their own."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import MAX_POSITIONS, TOKENIZER_VOCAB_SIZE, model_with_template, write_tokenizer
from test_server import API_KEY, LiveServer
from test_server_auto_tools import HERMES_TEMPLATE, call_deltas, regex, streamed
from tiny_models import build_hf_model

from colibri_stream.server.tool_syntax import (DeepSeekToolSyntax, GlmToolSyntax, HermesToolSyntax, KimiToolSyntax,
                                               MiniMaxToolSyntax, QwenXmlToolSyntax, tool_syntax_of)

pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object"}}
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True}

# Each family's template teaches its syntax by the marker tool_syntax_of reads; the reply steered to that syntax
GLM_TEMPLATE = HERMES_TEMPLATE.replace("For each call return", "Call <tool_call>name<arg_key>key</arg_key>"
                                       "<arg_value>value</arg_value></tool_call>, or return")
GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n"
            "<arg_value>true</arg_value>\n</tool_call>")
MINIMAX_TEMPLATE = HERMES_TEMPLATE.replace("For each call return", "Call <minimax:tool_call><invoke name=...>"
                                           "</invoke></minimax:tool_call>, or return")
MINIMAX_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '<parameter name="days">3</parameter>\n<parameter name="metric">true</parameter>\n</invoke>\n'
                '</minimax:tool_call>')
DEEPSEEK_TEMPLATE = HERMES_TEMPLATE.replace("For each call return", "Think in <think></think>, then call "
                                            "<｜tool▁calls▁begin｜>, or return")
DEEPSEEK_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                 '{"city": "Paris", "days": 3, "metric": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI_TEMPLATE = HERMES_TEMPLATE.replace("For each call return", "Call <|tool_calls_section_begin|>, or return")
KIMI_CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris", "days": 3, "metric": true}<|tool_call_end|><|tool_calls_section_end|>')
# syntax -> (the family whose tiny model serves it, its template, its call, the reasoning before it)
CASES = {"glm45": ("glm4_moe", GLM_TEMPLATE, GLM_CALL, ""),
         "minimax_m2": ("minimax_m2", MINIMAX_TEMPLATE, MINIMAX_CALL, ""),
         "deepseek_v3": ("deepseek_v3", DEEPSEEK_TEMPLATE, DEEPSEEK_CALL, "<think>Rain likely.</think>\n\n"),
         "kimi_k2": ("deepseek_v3", KIMI_TEMPLATE, KIMI_CALL, "")}  # Kimi K2 is DeepSeek-V3's architecture


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    """(the syntax's name, an openai client of its family's tiny model served with its template, the reply to
    steer to)."""
    from colibri_stream.export import export_model

    arch, template, call, thinking = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    build_hf_model(arch, root / "hf", vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS)
    export_model(root / "hf", root / "exported", dtype="fp32", progress=False)
    write_tokenizer(root / "exported")
    folder = model_with_template(root / "exported", root / "model", template)
    live = LiveServer(folder, dict(max_batch_size=2, max_seq_len=1024), api_key=API_KEY, served_model_name="tiny")
    yield request.param, openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60), \
        thinking + "Checking.\n" + call
    live.close()
    shutil.rmtree(root)


def test_calls_come_back_as_tool_calls(family):
    name, client, reply = family

    def ask(stream: bool):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                              tools=TOOLS, max_tokens=500, temperature=0, stream=stream,
                                              extra_body=regex(reply))

    choice = ask(False).choices[0]
    assert choice.finish_reason == "tool_calls", (name, choice)
    assert choice.message.content == "Checking.\n"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == ARGUMENTS
    thinking = getattr(choice.message, "reasoning_content", None) or (choice.message.model_extra or {}).get(
        "reasoning_content")
    assert thinking == ("Rain likely." if name == "deepseek_v3" else None)
    chunks = list(ask(True))
    content, calls, reason = streamed(chunks)
    assert (content, reason) == ("Checking.\n", "tool_calls")
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == ARGUMENTS
    # streamed as vLLM's parsers do: the name first, then the arguments in pieces (a parameter at a time in the XML
    # syntaxes, the JSON text as it comes in the others), the first before the reply ends
    deltas = call_deltas(chunks)
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].function.arguments == ""
    assert deltas[0][1] < deltas[-1][1]
    if name in ("glm45", "minimax_m2"):
        assert len(deltas) == 1 + len(ARGUMENTS) + 1


def test_a_malformed_call_stays_content(family):
    """A block naming no tool of the request comes back as the text the model wrote."""
    name, client, reply = family
    broken = reply.replace("get_weather", "get_time")
    choice = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, max_tokens=500, temperature=0,
                                            extra_body=regex(broken)).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "get_time" in choice.message.content and choice.message.content.startswith("Checking.\n")


def test_the_template_marker_picks_the_syntax():
    assert isinstance(tool_syntax_of({"default": GLM_TEMPLATE}), GlmToolSyntax)
    assert isinstance(tool_syntax_of({"default": MINIMAX_TEMPLATE}), MiniMaxToolSyntax)
    assert isinstance(tool_syntax_of({"default": DEEPSEEK_TEMPLATE}), DeepSeekToolSyntax)
    assert isinstance(tool_syntax_of({"default": KIMI_TEMPLATE}), KimiToolSyntax)
    hermes = tool_syntax_of({"default": HERMES_TEMPLATE})
    assert type(hermes) is HermesToolSyntax and not isinstance(hermes, QwenXmlToolSyntax)


def arguments_of(split):
    return None if split is None else [json.loads(c["function"]["arguments"]) for c in split[1]]


@pytest.mark.parametrize(("text", "expected"), [
    (GLM_CALL, [ARGUMENTS]),
    ("<tool_call>ping</tool_call>", [{}]),
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>", [{"days": "three"}]),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>\n<tool_call>ping",
     [{"city": "Paris"}, {}]),  # the last block cut off before its closing tag
    ("<tool_call>nope</tool_call>", None),  # not a tool of the request
    ("<tool_call>get_weather stray<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", None),
    ("<tool_call>get_weather<arg_key>city</arg_key>stray<arg_value>Paris</arg_value></tool_call>", None),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call> after", None),
])
def test_glm_split(text, expected):
    assert arguments_of(GlmToolSyntax().split(text, SCHEMAS)) == expected


@pytest.mark.parametrize(("text", "expected"), [
    (MINIMAX_CALL, [ARGUMENTS]),
    ('<minimax:tool_call><invoke name="ping"></invoke><invoke name="get_weather"><parameter name="days">'
     '2</parameter></invoke></minimax:tool_call>', [{}, {"days": 2}]),  # two calls in one block
    ('<minimax:tool_call><invoke name="nope"></invoke></minimax:tool_call>', None),
    ('<minimax:tool_call>stray<invoke name="ping"></invoke></minimax:tool_call>', None),
    ('<minimax:tool_call><invoke name="ping">stray</invoke></minimax:tool_call>', None),
    ("<minimax:tool_call></minimax:tool_call>", None),  # no call
])
def test_minimax_split(text, expected):
    assert arguments_of(MiniMaxToolSyntax().split(text, SCHEMAS)) == expected


# (syntax, the text after "Checking.\n", the arguments of its calls or None: it stays content)
TOKEN_CASES = [(DeepSeekToolSyntax(), text, expected) for text, expected in [
    (DEEPSEEK_CALL, [ARGUMENTS]),
    (DEEPSEEK_CALL.removesuffix("<｜tool▁calls▁end｜>"), [ARGUMENTS]),  # stopped before the last token
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>ping<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [{"city": "Oslo"}, {}]),  # V3.1
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n[1]\n```'
     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),  # arguments not an object
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```<｜tool▁call▁end｜>',
     None),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather {}<｜tool▁call▁end｜>', None),  # no separator
    (DEEPSEEK_CALL + " after", None),
    ("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", None),
    ]] + [(KimiToolSyntax(), text, expected) for text, expected in [
    (KIMI_CALL, [ARGUMENTS]),
    (KIMI_CALL.removesuffix("<|tool_calls_section_end|>"), [ARGUMENTS]),  # stopped before the last token
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>{}'
     '<|tool_call_end|><|tool_calls_section_end|>', [{"city": "Oslo"}, {}]),
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}'
     '<|tool_call_end|>', None),  # not a tool of the request
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.ping:0<|tool_call_argument_begin|>{broken'
     '<|tool_call_end|>', None),
    (KIMI_CALL + " after", None),
    ("<|tool_calls_section_begin|><|tool_calls_section_end|>", None),
    ]]


@pytest.mark.parametrize(("syntax", "text", "expected"), TOKEN_CASES)
def test_special_token_split(syntax, text, expected):
    split = syntax.split("Checking.\n" + text, SCHEMAS)
    assert arguments_of(split) == expected
    if split is not None:
        assert split[0] == "Checking.\n"
