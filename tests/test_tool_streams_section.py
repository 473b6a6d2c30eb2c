"""The streamed reader of DeepSeek-V3's and Kimi K2's sections of tool calls (server/tool_streams_section.py) on its
own: a reply fed in pieces of every size gives the content and the calls the non-streamed answer has (`split`),
each call's name in its first delta and its arguments in pieces as they come; replies that are no calls, or are
cut, lose no text."""

from __future__ import annotations

import json

import pytest
from test_tool_streams_xml import ARGUMENTS, TOOLS, calls_of, check_streamed_as_split, read

from colibri_stream.server.tool_syntax import DeepSeekToolSyntax, KimiToolSyntax

DEEPSEEK = DeepSeekToolSyntax()
KIMI = KimiToolSyntax()
WEATHER_JSON = '{"city": "Paris", "days": 3, "metric": true}'
DEEPSEEK_V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + WEATHER_JSON
               + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>ping\n```json\n{}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + WEATHER_JSON
                + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>ping<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
KIMI_K2 = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           + WEATHER_JSON + "<|tool_call_end|><|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>")
REPLIES = {"deepseek_v3": (DEEPSEEK, DEEPSEEK_V3), "deepseek_v3.1": (DEEPSEEK, DEEPSEEK_V31), "kimi_k2": (KIMI, KIMI_K2)}


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize("name", sorted(REPLIES))
def test_streamed_calls_equal_the_non_streamed_answer(name, size):
    syntax, calls_text = REPLIES[name]
    check_streamed_as_split(syntax, "Checking.\n" + calls_text + "\n", size)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_the_name_goes_first_then_the_arguments_as_they_come(name):
    syntax, text = REPLIES[name]
    _, feeds = read(syntax, text, 1)
    first = [(i, d) for i, deltas in enumerate(feeds) for d in deltas if d["index"] == 0]
    assert first[0][1]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[0][0] < text.index("Paris")  # the header went out before the arguments were written
    assert len(first) > 10 and "".join(d["function"]["arguments"] for _, d in first) == WEATHER_JSON
    assert first[-1][0] < text.index("ping")  # the first call was whole before the second began


@pytest.mark.parametrize(("syntax", "text"), [
    (DEEPSEEK, "Checking.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),  # no tool of the request
    (DEEPSEEK, "Checking.\n<｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜>"),
    (KIMI, "Checking.\n<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
           "<|tool_call_argument_begin|>[1, 2]<|tool_call_end|><|tool_calls_section_end|>"),  # arguments not an object
])
def test_a_section_that_is_no_calls_of_the_tools_stays_content(syntax, text):
    content, feeds = read(syntax, text, 3)
    assert content == text and not calls_of(feeds)
    assert syntax.split(text, TOOLS) is None


def test_text_after_sent_calls_goes_out_as_content():
    """A call once sent stays one; what follows in the section that is no call, and text after the section, is
    content."""
    text = DEEPSEEK_V31.replace("<｜tool▁call▁begin｜>ping", "stray<｜tool▁call▁begin｜>ping")
    content, feeds = read(DEEPSEEK, "Checking.\n" + text, 4)
    assert [json.loads(c["arguments"]) for c in calls_of(feeds).values()] == [ARGUMENTS]
    assert content == "Checking.\n" + text[text.index("stray"):]
    content, feeds = read(KIMI, KIMI_K2 + " and more", 4)
    assert len(calls_of(feeds)) == 2 and content == " and more"


def test_a_call_cut_inside_its_arguments_is_not_whole():
    reader = KIMI.stream_reader(TOOLS)
    content, deltas = reader.feed("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                                  '<|tool_call_argument_begin|>{"city": "Par')
    assert content == "" and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Par'
    assert reader.finish() == ("", []) and not reader.whole
