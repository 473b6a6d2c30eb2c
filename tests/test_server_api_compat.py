"""OpenAI API compatibility, second audit: what the openai client and users of vLLM's server send that the first
audit (tests/test_server_edge_cases.py) did not cover: logit_bias, a full queue's Retry-After, audio output and
assistant prefill, refusals in the history, both token limits at once, and streamed completions with several
choices, stop strings, logprobs and usage equal to the whole response."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from test_server import API_KEY, CHAT, COMPLETIONS, LiveServer, _error, metric, post, request, sse_events

from colibri_stream.errors import InvalidParameterError
from colibri_stream.request import SamplingParams
from colibri_stream.sampling import Sampler, SamplingState
from colibri_stream.server.state import STATE

MODEL = "tiny-mixtral"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Two sequences running and one waiting at most, so a third long stream fills the queue."""
    live = LiveServer(tiny_model_dir, dict(max_batch_size=2, max_queue=1, max_seq_len=512), api_key=API_KEY)
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def user(content: Any) -> list[dict]:
    return [{"role": "user", "content": content}]


def refused(server: LiveServer, path: str, body: dict, param: str) -> dict:
    """`body` is a 400 naming `param`; returns the error."""
    status, reply = post(server, path, body)
    assert status == 400, reply
    error = _error(reply)
    assert error["param"] == param, error
    return error


# --------------------------------------------------------------------------------------------------- logit_bias

def test_logit_bias_adds_to_the_logits_before_sampling():
    logits = np.array([[3.0, 1.0, 0.0, -1.0]], dtype=np.float32)
    for bias, token in ((((2, 100.0),), 2), (((0, -100.0),), 1), (((1, 1.0), (1, 1.5)), 1)):
        params = SamplingParams(temperature=0, logit_bias=bias)
        assert Sampler().sample(logits, [SamplingState.from_params(params, [])]).token_ids[0] == token, bias
    for bias in (((0, 100.5),), ((0, -101.0),), ((-1, 1.0),)):
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(logit_bias=bias)
        assert info.value.param == "logit_bias"


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_steers_the_tokens(server, client, stream):
    """OpenAI and vLLM take {"<token id>": bias}; it was refused as unsupported. +100 forces a token (greedy or
    sampled), -100 bans it; logprobs stay those of the model (vLLM's default)."""
    tokenizer = server.app[STATE].engine.tokenizer
    [forced] = tokenizer.encode("_")

    def complete(bias: dict, **options: Any) -> Any:
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logit_bias=bias, stream=stream,
                                          **{"extra_body": {"ignore_eos": True}, **options})
        if not stream:
            return reply.choices[0].text, reply.choices[0].logprobs
        chunks = list(reply)
        return "".join(c.choices[0].text for c in chunks), None

    for options in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        assert complete({str(forced): 100}, **options)[0] == "_" * 4, options
    greedy, _ = complete({}, temperature=0)
    first = tokenizer.encode(greedy)[0]
    assert complete({str(first): -100}, temperature=0)[0] != greedy
    chunks = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_completion_tokens=3,
                                            temperature=0, logit_bias={str(forced): 100}, stream=stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks) if stream else chunks.choices[0].message.content
    assert content == "___"
    if not stream:
        _, logprobs = complete({str(forced): 100}, temperature=0, logprobs=1)
        assert all(lp < -0.5 for lp in logprobs.token_logprobs)  # not the biased distribution's ~0


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_logit_bias_bad_keys_and_values_are_400(server, path):
    base = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": user("Hi")}
    vocab = server.app[STATE].engine.model_config.vocab_size
    for bias in ({"abc": 1}, {"-1": 1}, {"+5": 1}, {"05": 1}, {"5_0": 1}, {" 5": 1}, {"٥": 1}, {"9" * 5000: 1},
                 {"5": "1"}, {"5": True}, {"5": None}, {"5": 100.5}, {"5": -101}, {str(vocab): 1}, [5], "5"):
        error = refused(server, path, {**base, "max_tokens": 2, "logit_bias": bias}, "logit_bias")
        assert error["code"] is None and len(error["message"]) < 200, (bias, error)  # a bad value, not "unsupported"
    status, reply = post(server, path, {**base, "max_tokens": 2, "logit_bias": {str(vocab - 1): -100, "0": 0.5}})
    assert status == 200, reply


# ----------------------------------------------------------------------------------------------- a full queue

def test_a_full_queue_is_429_with_retry_after(server, client):
    """The openai client honours Retry-After on a 429 (else it backs off blindly); we sent none."""
    async def fill_then_ask() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            body = {"prompt": "Busy", "max_tokens": 400, "stream": True, "ignore_eos": True}
            streams = [await session.post(server.url + COMPLETIONS, json=body) for _ in range(3)]
            while await asyncio.to_thread(metric, server, "colibri_num_requests_waiting") < 1:
                await asyncio.sleep(0.005)
            with pytest.raises(openai.RateLimitError) as info:
                await asyncio.to_thread(client.completions.create, model=MODEL, prompt="Third", max_tokens=2)
            assert info.value.response.headers["Retry-After"] == "1"
            assert info.value.body["code"] == "queue_full"
            for stream in streams:
                stream.close()

    asyncio.run(fill_then_ask())
    deadline = time.monotonic() + 30  # the closed streams are cancelled once the server sees the disconnects
    while metric(server, "colibri_num_requests_waiting") + metric(server, "colibri_num_requests_running") > 0:
        assert time.monotonic() < deadline, "the closed streams were not cancelled"
        time.sleep(0.01)
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------------------------------ chat: what is refused

def test_audio_output_and_continue_final_message_are_refused(server):
    for fields, param in ((dict(modalities=["text", "audio"]), "modalities"),
                          (dict(audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"]), "audio"),
                          (dict(continue_final_message=True), "continue_final_message")):
        error = refused(server, CHAT, {"messages": user("Hi"), "max_tokens": 2, **fields}, param)
        assert error["code"] == "unsupported_parameter"
    for fields in (dict(modalities=["text"]), dict(continue_final_message=False), dict(audio=None)):
        status, reply = post(server, CHAT, {"messages": user("Hi"), "max_tokens": 2, **fields})
        assert status == 200, (fields, reply)


def test_a_last_assistant_message_is_answered_in_a_new_turn(server):
    """A decision, as OpenAI: an assistant message at the end is history, not a prefix to continue (vLLM's
    continue_final_message is refused above)."""
    tokenizer = server.app[STATE].engine.tokenizer
    messages = [*user("Hi"), {"role": "assistant", "content": "Sure, "}]
    status, reply = post(server, CHAT, {"messages": messages, "max_tokens": 2})
    assert status == 200, reply
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.endswith("Sure, <|im_end|>\n<|im_start|>assistant\n")
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_assistant_refusals_in_the_history_are_read_as_text(server):
    """OpenAI's assistant content parts are text or refusal; a conversation replayed from OpenAI holds refusals."""
    def reply_to(content: Any) -> dict:
        status, reply = post(server, CHAT, {"messages": [*user("Hi"), {"role": "assistant", "content": content},
                                                         *user("Why?")], "max_tokens": 4, "temperature": 0})
        assert status == 200, reply
        return reply

    as_string = reply_to("I can't help with that.")
    as_part = reply_to([{"type": "refusal", "refusal": "I can't help with that."}])
    details = as_part["usage"].pop("prompt_tokens_details")  # the second took the first's prompt from the cache
    assert details["cached_tokens"] > as_string["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert as_part["choices"] == as_string["choices"] and as_part["usage"] == as_string["usage"]
    refused(server, CHAT, {"messages": user([{"type": "refusal", "refusal": "no"}]), "max_tokens": 2},
            "messages[0].content[0]")


def test_max_tokens_is_range_checked_when_max_completion_tokens_wins(server):
    for max_tokens in (0, -5):
        refused(server, CHAT, {"messages": user("Hi"), "max_completion_tokens": 2, "max_tokens": max_tokens},
                "max_tokens")
    status, reply = post(server, CHAT, {"messages": user("Hi"), "max_completion_tokens": 2, "max_tokens": 9,
                                        "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------- streams equal the whole reply

def test_streamed_completion_choices_equal_the_whole_response(server):
    """n = 2 with a seed, a stop string, logprobs and include_usage: each choice's streamed text, logprobs (text
    offsets running on across chunks) and finish equal the non-streamed response; usage equals the sum."""
    body = {"prompt": "Stream me", "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 2,
            "ignore_eos": True}
    status, whole = post(server, COMPLETIONS, body)
    assert status == 200, whole
    text = whole["choices"][0]["text"]
    stop = text[3:5] if len(text) >= 5 and "\ufffd" not in text[3:5] else "never"
    status, whole = post(server, COMPLETIONS, {**body, "stop": [stop]})
    assert status == 200, whole
    status, _, raw = request(server, "POST", COMPLETIONS, {**body, "stop": [stop], "stream": True,
                                                           "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in events[:-2] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert stop not in choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert not any(c["finish_reason"] for c in mine[:-1])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in mine for v in c["logprobs"][key]] == choice["logprobs"][key], key

