"""/v1/completions `echo` through the official openai client on the real server: each choice's text starts with
its prompt; with `logprobs` its logprobs start with the prompt tokens' (the first one null, as OpenAI's legacy
completions gave them); with `max_tokens: 0` the prompt comes alone, scored (what evaluation harnesses ask for).
A prompt's echoed logprobs equal those the same tokens got when they were generated. vLLM's prompt_logprobs field
gives the same figures in vLLM's layout (token id -> logprob, rank, decoded token), in chat and completions, not
streamed."""

from __future__ import annotations

import openai
import pytest
from test_server import API_KEY

from colibri_stream.engine import EngineCore
from colibri_stream.request import SamplingParams

MODEL = "tiny"  # the name conftest.tiny_server serves the model under
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def core(tiny_model_dir) -> EngineCore:
    """An engine over the same model in this process: the tokenizer, and tokens generated with their logprobs."""
    return EngineCore.from_pretrained(str(tiny_model_dir), device="cpu")


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_echo_prepends_the_prompt_to_each_choice(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text] * 2
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + plain.choices[0].text


def test_echo_of_a_token_prompt_is_its_text(client, core):
    ids = core.tokenizer.encode(PROMPT)
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert reply.choices[0].text == core.tokenizer.decode(ids, skip_special_tokens=False)
    assert reply.usage.completion_tokens == 0 and reply.choices[0].finish_reason == "length"
    # greedily, the one token the engine generates (and the reply drops) is eos, which stops it: still max_tokens
    # 0's "length", no stop_reason
    core.add_request("next", ids, SamplingParams(max_tokens=1, temperature=0))
    finished = [out for _ in range(8) if core.has_unfinished() for out in core.step() if out.finished]
    assert finished[0].finish_reason == "stop"
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, temperature=0)
    assert reply.choices[0].text == core.tokenizer.decode(ids, skip_special_tokens=False)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 0
    assert getattr(reply.choices[0], "stop_reason", None) is None


def test_echoed_logprobs_score_the_prompt_as_generation_scored_the_same_tokens(client, core):
    """Greedy tokens generated with their logprobs (by an engine over the same model), then sent as part of the
    prompt with max_tokens 0: the echoed logprobs of those prompt tokens are the ones they had as outputs."""
    ids = core.tokenizer.encode(PROMPT)
    core.add_request("g", ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    generated = [token for out in outputs for token in out.token_ids]
    generated_logprobs = [lp for out in outputs for _, lp, _ in out.logprobs]
    scored = client.completions.create(model=MODEL, prompt=ids + generated, max_tokens=0, echo=True, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert scored.usage.prompt_tokens == len(ids) + 5 and scored.usage.completion_tokens == 0
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(ids) + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # the top 2, and the prompt token
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(generated_logprobs, abs=1e-4)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert scored.choices[0].text == core.tokenizer.decode(ids + generated, skip_special_tokens=False)


def test_echo_type_and_chat_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"echo": "yes"})
    with pytest.raises(openai.BadRequestError, match="echo is not supported in chat"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"echo": True})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 0 only with echo
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_first(client, core):
    ids = core.tokenizer.encode(PROMPT)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1)
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                                               echo=True, logprobs=1, stream=True) if c.choices]
    first = chunks[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(ids)  # the prompt's, then maybe a token
    streamed = [token for c in chunks if c.logprobs for token in c.logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    assert "".join(c.text for c in chunks) == whole.choices[0].text


def test_vllms_prompt_logprobs_field_gives_the_echoed_logprobs_as_vllm_lays_them_out(client, core):
    ids = core.tokenizer.encode(PROMPT)
    core.add_request("scored", ids, SamplingParams(max_tokens=1, prompt_logprobs=3))
    want = [out for out in core.step() if out.prompt_logprobs][0].prompt_logprobs  # (token, logprob, top) each
    while core.has_unfinished():
        core.step()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 3})
    for choice in answer.choices:
        positions = choice.model_extra["prompt_logprobs"]
        assert positions[0] is None and len(positions) == len(ids)
        for (token, logprob, top), entries in zip(want, positions[1:]):
            assert entries[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-5)
            assert entries[str(token)]["decoded_token"] == core.tokenizer.decode([token], skip_special_tokens=False)
            ranked = sorted((int(t), e) for t, e in entries.items() if e["rank"] is not None)
            assert sorted((e["rank"], t) for t, e in ranked) == [(r, t) for r, (t, _) in enumerate(top, start=1)]
            assert [e["logprob"] for _, e in sorted(ranked, key=lambda te: te[1]["rank"])] == pytest.approx(
                [lp for _, lp in top], abs=1e-5)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    positions = chat.model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == chat.usage.prompt_tokens
    assert all(len(entries) == 1 and next(iter(entries.values()))["rank"] is None for entries in positions[1:])
    for fields in ({"prompt_logprobs": 3, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=fields)
        assert refused.value.body["param"] == "prompt_logprobs"
