"""Structured output (colibri_stream/structured.py): a sequence with a grammar writes only what the grammar allows.

On the tiny model (random weights, so only the grammar keeps its text in shape): greedy and sampled sequences under
a bounded JSON schema end on their own with documents valid under it, laid out as json.dumps writes them; so do
sequences preempted and recomputed, and n sequences of one request; the tokens of an unconstrained request in the
same batch are the ones it gets alone; a schema llguidance cannot use, or a grammar past one of its parser limits,
is refused when the request arrives, and a choice list of thousands of strings is followed. Through
the server and the official client: response_format json_schema and json_object in chat and completions, the
client's `parse` helpers with a pydantic model, text.format in the Responses API, and vLLM's structured_outputs
and guided_* fields (regex, choice, JSON schema, json_object, Lark grammar), with a 400 naming the field for each
bad value.
"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from test_server import API_KEY

from colibri_stream.engine import EngineCore
from colibri_stream.errors import InvalidParameterError
from colibri_stream.request import SamplingParams
from colibri_stream.structured import json_schema_grammar

pytest.importorskip("llguidance")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "kind": {"enum": ["small", "large"]}},
          "required": ["ok", "size", "kind"], "additionalProperties": False}
# A rule of 2500 alternatives: past llguidance's 2000 items in a parser row, which it reports at the first token
WIDE_RULE = "start: " + " | ".join(f'"option {i}"' for i in range(2500))
TIGHT = dict(device="cpu", block_size=4, num_kv_blocks=24, max_seq_len=96, max_num_batched_tokens=16,
             max_batch_size=4)


def valid(text: str) -> bool:
    """Whether `text` is a document of SCHEMA as json.dumps writes it."""
    document = json.loads(text)
    return (set(document) == {"ok", "size", "kind"} and isinstance(document["ok"], bool)
            and isinstance(document["size"], int) and 0 <= document["size"] <= 99
            and document["kind"] in ("small", "large") and json.dumps(document) == text)


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (ids, params) in requests.items():
        core.add_request(request_id, ids, params)
    texts, reasons = {}, {}
    while core.has_unfinished():
        for out in core.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.text
            if out.finished:
                reasons[key] = out.finish_reason
    return {key: (texts[key], reasons[key]) for key in texts}


def test_constrained_sequences_end_with_documents_of_the_schema(tiny_model_dir):
    core = EngineCore.from_pretrained(str(tiny_model_dir), **TIGHT)
    prompts = [core.tokenizer.encode(text) for text in ("Describe the box as JSON:", "The quick brown fox jumps",
                                                         "Mixture of experts route every token")]
    grammar = json_schema_grammar(SCHEMA)
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = run(core, {"plain": (prompts[2], plain)})
    requests = {"greedy": (prompts[0], SamplingParams(max_tokens=60, temperature=0, grammar=grammar)),
                "sampled": (prompts[1], SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=2, grammar=grammar)),
                "plain": (prompts[2], plain)}
    preemptions = core.scheduler.num_preemptions
    results = run(core, requests)
    assert core.scheduler.num_preemptions > preemptions, "the test meant to preempt"
    assert results[("plain", 0)] == alone[("plain", 0)]
    for key in (("greedy", 0), ("sampled", 0), ("sampled", 1)):
        text, reason = results[key]
        assert reason == "stop" and valid(text), (key, text)


def test_any_json_object_and_a_schema_that_cannot_be_used(tiny_model_dir):
    core = EngineCore.from_pretrained(str(tiny_model_dir), device="cpu")
    ids = core.tokenizer.encode("JSON:")
    (text, reason), = run(core, {"o": (ids, SamplingParams(max_tokens=200, temperature=0,
                                                          grammar=json_schema_grammar({"type": "object"})))}).values()
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(InvalidParameterError, match="the schema cannot be used"):
        json_schema_grammar({"type": "nonsense"})
    with pytest.raises(InvalidParameterError, match="grammar"):
        core.validate(ids, SamplingParams(grammar="start: nonsense_rule_that_is_not_defined"))


def test_a_grammars_verdict_is_kept_for_its_next_check(tiny_model_dir):
    from colibri_stream.structured import CHECKED_GRAMMARS, lark_grammar

    constraints = EngineCore.from_pretrained(str(tiny_model_dir), **TIGHT).runner.constraints
    bad, good = lark_grammar("start: <[99999]>", "x"), json_schema_grammar(SCHEMA)
    for _ in range(2):  # the second time from the kept verdict: the same answer
        with pytest.raises(InvalidParameterError, match="tokenizer") as refused:
            constraints.check(bad)
        assert refused.value.param == "grammar"
        constraints.check(good)
    for i in range(2 * CHECKED_GRAMMARS):
        constraints.check(lark_grammar(f'start: "{i}"', "x"))
    assert len(constraints._checked) == CHECKED_GRAMMARS
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        constraints.check(bad)  # checked anew once forgotten


def test_a_grammar_past_a_parser_limit_is_refused_at_its_check_and_a_long_choice_list_is_not(tiny_model_dir):
    """A rule wider than llguidance's 2000 parser items validates, then fails at its first token: the check takes
    that first step, so the grammar is refused when the request arrives rather than failing inside a step. A
    choice list of any length is one terminal (choice_grammar), which a constrained sequence follows to one of
    its strings."""
    from colibri_stream.structured import choice_grammar, lark_grammar

    core = EngineCore.from_pretrained(str(tiny_model_dir), **TIGHT)
    with pytest.raises(InvalidParameterError, match="max is 2000") as refused:
        core.runner.constraints.check(lark_grammar(WIDE_RULE, "guided_grammar"))
    assert refused.value.param == "grammar" and len(str(refused.value)) < 1000  # no grammar dump in the message
    choices = [f"option {i}" for i in range(5000)]
    grammar = choice_grammar(choices, "guided_choice")
    ids = core.tokenizer.encode("Pick:")
    outputs = run(core, {f"{t}": (ids, SamplingParams(max_tokens=24, temperature=t, seed=1, grammar=grammar))
                         for t in (0.0, 1.0)})
    assert all(text in choices and reason == "stop" for text, reason in outputs.values())


class Box(pydantic.BaseModel):
    ok: bool
    size: int = pydantic.Field(ge=0, le=99)
    kind: str = pydantic.Field(pattern="^(small|large)$")


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_response_formats_through_the_official_client(client):
    messages = [{"role": "user", "content": "Describe the box as JSON"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "box", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                          response_format=schema_format)
    assert chat.choices[0].finish_reason == "stop" and valid(chat.choices[0].message.content)
    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           response_format=Box)
    box = parsed.choices[0].message.parsed
    assert isinstance(box, Box) and 0 <= box.size <= 99 and box.kind in ("small", "large")
    completion = client.completions.create(model="tiny", prompt="Box:", max_tokens=60, temperature=0,
                                           extra_body={"response_format": schema_format})
    assert valid(completion.choices[0].text)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                            response_format=schema_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")
    response = client.responses.parse(model="tiny", input="Describe the box as JSON", max_output_tokens=60,
                                      temperature=0, text_format=Box)
    assert isinstance(response.output_parsed, Box)


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "(yes|no), [0-9]{3}"}},
    {"guided_regex": "(yes|no), [0-9]{3}"},
])
def test_vllm_regex_fields_hold_the_text_to_the_pattern(client, fields):
    import re

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer"}],
                                          max_tokens=20, temperature=0, extra_body=fields)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and re.fullmatch("(yes|no), [0-9]{3}", text)
    completion = client.completions.create(model="tiny", prompt="Answer:", max_tokens=20, temperature=0.9, seed=3,
                                           n=3, extra_body=fields)
    assert all(re.fullmatch("(yes|no), [0-9]{3}", c.text) for c in completion.choices)


def test_vllm_choice_json_and_grammar_fields(client):
    messages = [{"role": "user", "content": "Pick one"}]
    choices = ["red \"wine\"", "blue\\sky", "grün"]
    for fields in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        picked = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=1.0,
                                                seed=5, extra_body=fields)
        assert picked.choices[0].message.content in choices
    many = [f"item {i}" for i in range(3000)]  # past llguidance's 2000 items a rule holds: one terminal instead
    for stream in (False, True):
        picked = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, temperature=1.0, seed=5,
                                           stream=stream, extra_body={"guided_choice": many})
        chunks = picked if stream else [picked]
        assert "".join(c.choices[0].text for c in chunks if c.choices) in many
    for schema in (SCHEMA, json.dumps(SCHEMA)):  # the schema as an object or as its JSON text, as vLLM takes it
        for fields in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
            document = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60,
                                                      temperature=0, extra_body=fields)
            assert valid(document.choices[0].message.content)
    obj = client.completions.create(model="tiny", prompt="JSON:", max_tokens=40, temperature=0,
                                    extra_body={"structured_outputs": {"json_object": True}})
    assert obj.choices[0].text.startswith("{")
    lark = 'start: "count: " NUMBER\nNUMBER: /[1-9][0-9]?/'
    for fields in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": lark}):
        counted = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 extra_body=fields)
        text = counted.choices[0].message.content
        assert text.startswith("count: ") and text[7:].isdigit() and 1 <= int(text[7:]) <= 99


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"regex": "((("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: <[99999]>"}}, "structured_outputs.grammar"),  # the tokenizer's check
    ({"guided_grammar": "start: <[99999]>"}, "guided_grammar"),
    ({"guided_grammar": WIDE_RULE}, "guided_grammar"),  # llguidance's limit, reached at the first token
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"structured_outputs": "a"}, "structured_outputs"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
])
def test_bad_vllm_structured_output_fields_are_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body=fields)
    assert refused.value.body["param"] == param
    assert client.models.list().data[0].id == "tiny"  # the server still serves
