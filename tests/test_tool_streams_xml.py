"""The streamed readers of the XML-like tool-call syntaxes (server/tool_streams_xml.py) on their own: a reply fed in
pieces of every size gives the content and the calls the non-streamed answer has (`split`), each call's name in
its first delta and its arguments a parameter at a time; malformed and cut replies lose no text."""

from __future__ import annotations

import json

import pytest

from colibri_stream.server.tool_syntax import GlmToolSyntax, MiniMaxToolSyntax, QwenXmlToolSyntax

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}}}
TOOLS = {"get_weather": WEATHER, "ping": {"type": "object"}}
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True}

GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n"
            "<arg_value>true</arg_value>\n</tool_call>")
MINIMAX_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '<parameter name="days">3</parameter>\n<parameter name="metric">true</parameter>\n</invoke>\n'
                '</minimax:tool_call>')
QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
             "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
# (syntax, a reply of two calls after some text: the second a call with no parameters)
REPLIES = {
    "glm45": (GlmToolSyntax(), "Checking.\n" + GLM_CALL + "\n<tool_call>ping\n</tool_call>"),
    "minimax_m2": (MiniMaxToolSyntax(), "Checking.\n" + MINIMAX_CALL.replace(
        "</invoke>\n</minimax", '</invoke>\n<invoke name="ping">\n</invoke>\n</minimax')),
    "qwen3_xml": (QwenXmlToolSyntax(), "Checking.\n" + QWEN_CALL + "\n<tool_call>\n<function=ping>\n</function>\n"
                                                                     "</tool_call>"),
}


def read(syntax, text: str, size: int) -> tuple[str, list[list[dict]]]:
    """(the content, the tool_calls deltas of each feed and of the finish) of `text` fed `size` characters at a
    time."""
    reader = syntax.stream_reader(TOOLS)
    content, feeds = "", []
    for start in range(0, len(text), size):
        more, deltas = reader.feed(text[start:start + size])
        content += more
        feeds.append(deltas)
    more, deltas = reader.finish()
    feeds.append(deltas)
    return content + more, feeds


def calls_of(feeds: list[list[dict]]) -> dict[int, dict]:
    """The calls by index as a client accumulates the deltas."""
    calls: dict[int, dict] = {}
    for delta in (d for deltas in feeds for d in deltas):
        entry = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
        entry["name"] += delta["function"].get("name") or ""
        entry["arguments"] += delta["function"]["arguments"]
    return calls


def check_streamed_as_split(syntax, text: str, size: int) -> None:
    """`text` ("Checking.\n", then a get_weather call of ARGUMENTS and a ping call) streamed `size` characters at a
    time gives the content and the calls of `syntax.split`."""
    content, feeds = read(syntax, text, size)
    before, whole = syntax.split(text, TOOLS)
    assert content == before == "Checking.\n"
    calls = calls_of(feeds)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [ARGUMENTS, {}]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 1000])
@pytest.mark.parametrize("name", sorted(REPLIES))
def test_streamed_calls_equal_the_non_streamed_answer(name, size):
    check_streamed_as_split(*REPLIES[name], size)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_the_name_goes_first_then_the_parameters_one_by_one(name):
    """Fed a character at a time: the first call's header (id, name, empty arguments) comes as soon as its head is
    written, before any parameter; then one piece per parameter and the closing brace, before the reply ends."""
    syntax, text = REPLIES[name]
    _, feeds = read(syntax, text, 1)
    first = [(i, d) for i, deltas in enumerate(feeds) for d in deltas if d["index"] == 0]
    header = first[0][1]
    assert header["id"].startswith("call_") and header["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["function"]["arguments"] for _, d in first[1:]]
    assert pieces == ['{"city": "Paris"', ', "days": 3', ', "metric": true', "}"]
    assert first[0][0] < text.index("Paris") < first[1][0] < first[-1][0] < len(text)


@pytest.mark.parametrize(("name", "text"), [
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par'),
])
def test_a_call_cut_inside_its_parameters_is_not_whole(name, text):
    syntax = REPLIES[name][0]
    reader = syntax.stream_reader(TOOLS)
    content, deltas = reader.feed(text)
    rest, more = reader.finish()
    assert content + rest == "Checking.\n" and [d["function"]["name"] for d in deltas] == ["get_weather"]
    assert not reader.whole and not more


@pytest.mark.parametrize(("name", "text"), [
    ("glm45", "Checking.\n<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("glm45", "Checking.\n<tool_call>get_weather stray<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "</tool_call>"),
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", "Checking.\n<minimax:tool_call>\nnot an invoke\n</minimax:tool_call>"),
])
def test_a_block_that_is_no_call_of_the_tools_stays_content(name, text):
    syntax = REPLIES[name][0]
    content, feeds = read(syntax, text, 5)
    assert content == text and not calls_of(feeds)
    assert syntax.split(text, TOOLS) is None


def test_minimax_text_after_a_streamed_call_in_its_block_goes_out_as_content():
    """A call once sent stays one; what follows it in the block that is no invoke of the tools is content."""
    syntax = MiniMaxToolSyntax()
    text = MINIMAX_CALL.replace("</invoke>\n</minimax", '</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax')
    content, feeds = read(syntax, text, 4)
    assert [json.loads(c["arguments"]) for c in calls_of(feeds).values()] == [ARGUMENTS]
    assert content == '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'


def test_glm_names_need_their_end_before_they_are_sent():
    """A name is read up to a newline or the first `<arg_key>`: `get` is not sent while `get_weather` may follow,
    and a call with no parameters closed on the name's line goes out whole at its closing tag."""
    reader = GlmToolSyntax().stream_reader(TOOLS)
    assert reader.feed("<tool_call>pin") == ("", [])
    assert reader.feed("g") == ("", [])
    content, deltas = reader.feed("</tool_call>")
    assert content == "" and [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [("ping", "{}")]
    assert reader.finish() == ("", [])
