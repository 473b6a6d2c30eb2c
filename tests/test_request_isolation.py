"""A failure that belongs to one request ends that request alone: the real server, a running batch of two
streams, and a third, hostile request injected while they decode. The two finish with the outputs they get alone,
the hostile one gets a 500 naming the cause (an error event once its stream is open), and /health reads 200.

Injected through real inputs, no monkeypatching: a grammar that leaves no token to draw (guided_choice with
min_tokens past the choice's end), and logits that are not finite in one row (a model whose embedding of one token
is NaN, with valid checksums: a prompt holding that token gets NaN logits, the other sequences do not)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import openai
import orjson
import pytest
from conftest import linked_model
from test_server import LiveServer, request

from colibri_stream.checkpoint import DenseFile, DenseFileWriter, read_config
from colibri_stream.tokenizer import Tokenizer

MODEL = "tiny"
BATCH_PROMPTS = ("The quick brown fox", "Mixture of experts models route")
BATCH_TOKENS = 160  # long enough that the hostile request comes and goes while both decode
NAN_TOKEN = 7  # the token whose embedding the NaN model holds as NaN


def nan_weights_model(model_dir: Path, folder: Path, tensor: str, index) -> Path:
    """`folder`: `model_dir`'s files (linked) but dense.safetensors, rewritten with `tensor`[index] NaN and every
    tensor's checksum recomputed (so the folder is intact, only its numbers are not)."""
    linked_model(model_dir, folder, leave_out="dense.safetensors")
    config = read_config(model_dir)
    dense = DenseFile(model_dir / config.dense_file, config)
    arrays = {name: dense.get(name) for name in dense.names}
    arrays[tensor] = arrays[tensor].copy()
    arrays[tensor][index] = np.nan
    writer = DenseFileWriter(folder / config.dense_file, {n: (a.shape, config.dtype) for n, a in arrays.items()})
    for name, array in arrays.items():
        writer.write(name, array)
    writer.close()
    return folder


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    """The tiny model with a NaN embedding for NAN_TOKEN, served with room for the batch and the hostile request."""
    folder = nan_weights_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny-nan", "embed_tokens",
                               NAN_TOKEN)
    server = LiveServer(folder, dict(max_batch_size=4, max_seq_len=512), served_model_name=MODEL)
    yield server
    server.close()


def client_of(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def stream_text(client: openai.AsyncOpenAI, prompt: str, first_token: asyncio.Event | None = None) -> str:
    """A greedy completion streamed to its end; `first_token` is set when its first text arrives."""
    text = ""
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=BATCH_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        text += chunk.choices[0].text
        if first_token is not None and text:
            first_token.set()
    return text


async def alone_outputs(live: LiveServer) -> list[str]:
    client = client_of(live)
    return [await stream_text(client, prompt) for prompt in BATCH_PROMPTS]


async def batch_with(live: LiveServer, hostile) -> tuple[list[str], object, bool]:
    """The batch's texts when `hostile(client)` runs once both streams are decoding; its result, and whether both
    streams were still running when it returned."""
    client = client_of(live)
    started = [asyncio.Event() for _ in BATCH_PROMPTS]
    tasks = [asyncio.create_task(stream_text(client, p, e)) for p, e in zip(BATCH_PROMPTS, started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    result = await hostile(client)
    overlapped = not any(task.done() for task in tasks)
    return await asyncio.gather(*tasks), result, overlapped


async def refused(call) -> openai.APIStatusError:
    """The error an openai client call raises."""
    with pytest.raises(openai.APIStatusError) as caught:
        await call
    return caught.value


def assert_healthy(live: LiveServer) -> None:
    status, _, raw = request(live, "GET", "/health", key=None)
    assert (status, orjson.loads(raw)) == (200, {"status": "ok"})


def test_a_grammar_that_leaves_no_token_ends_its_request_alone(live):
    """guided_choice ["yes"] with min_tokens 6: after "yes" the grammar allows only the end of sequence, which
    min_tokens bans, so nothing can be drawn: that request fails, in JSON (a 400: the request contradicts itself)
    and in its open stream (an error event), while the two running streams go on to their own outputs."""
    alone = live.call(alone_outputs(live), timeout=300)
    hostile_body = dict(model=MODEL, prompt="Answer:", max_tokens=12, extra_body={"guided_choice": ["yes"],
                                                                                 "min_tokens": 6})

    async def hostile(client):
        error = await refused(client.completions.create(**hostile_body))
        with pytest.raises(openai.APIError) as in_stream:  # the client raises the stream's error event
            async for _ in await client.completions.create(stream=True, **hostile_body):
                pass
        return error, in_stream.value

    texts, (error, in_stream), overlapped = live.call(batch_with(live, hostile), timeout=300)
    assert overlapped and texts == alone
    assert error.status_code == 400 and "no token is allowed next" in error.message
    assert "no token is allowed next" in in_stream.message
    assert_healthy(live)


def test_the_error_event_of_a_hostile_stream_names_the_cause(live):
    """The same failure once the stream's 200 is out: an error event naming the cause, then the stream ends."""
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 12, "stream": True, "guided_choice": ["yes"],
            "min_tokens": 6}
    status, _, raw = request(live, "POST", "/v1/completions", body, key=None)
    events = [orjson.loads(block[len(b"data: "):]) for block in raw.split(b"\n\n")
              if block.startswith(b"data: ") and block != b"data: [DONE]"]
    assert status == 200 and "no token is allowed next" in events[-1]["error"]["message"]
    assert_healthy(live)


def test_non_finite_logits_in_one_row_end_that_request_alone(live, tiny_model_dir):
    """A prompt holding the token whose embedding is NaN: its logits are NaN from its first step, sampled or
    scored (echo with logprobs computes the prompt's logprobs), and it fails alone with a 500 naming the cause."""
    alone = live.call(alone_outputs(live), timeout=300)
    tokenizer = Tokenizer.from_folder(str(tiny_model_dir))
    assert all(NAN_TOKEN not in tokenizer.encode(p + t) for p, t in zip(BATCH_PROMPTS, alone))  # the premise
    poisoned = tokenizer.encode("Hello") + [NAN_TOKEN] + tokenizer.encode(" world")

    async def hostile(client):
        sampled = await refused(client.completions.create(model=MODEL, prompt=poisoned, max_tokens=4,
                                                          temperature=0.7))
        scored = await refused(client.completions.create(model=MODEL, prompt=poisoned, max_tokens=0, echo=True,
                                                         logprobs=2))
        return sampled, scored

    texts, errors, overlapped = live.call(batch_with(live, hostile), timeout=300)
    assert overlapped and texts == alone
    for error in errors:
        assert error.status_code == 500 and "not finite" in error.message
    assert_healthy(live)
