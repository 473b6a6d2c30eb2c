"""Streaming detokenization: chunk-split invariance, whole characters only, prefix spaces, stop strings."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_tokenizer import build_byte_level, build_sentencepiece

from colibri_stream.tokenizer import IncrementalDetokenizer, Tokenizer

ALPHABET = list("abcdefgh xyz.,!?\n") + list("éèçñüößøå") + list("你好世界天气中文字") + \
    ["🎉", "👍🏽", "😀", "🇫🇷", "𝄞"] + list("ЖЩ♞ع") + ["e\u0301"]  # a combining accent too

TEXTS = [
    "Hello world! 你好，世界 🎉👍🏽 café naïve — ok",
    "  two leading spaces and trailing  ",
    "新的一天 😀😀 Ж ♞ 𝄞 done",
    "line one\nline two\n\n  indented",
]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        build_byte_level(folder, {"eos_token": "<|im_end|>"})
    else:
        build_sentencepiece(folder, {"bos_token": "<s>", "eos_token": "</s>"})
    return Tokenizer.from_folder(folder)


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(tokenizer, prompt, chunks, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = [detok.add(chunk) for chunk in chunks]
    return deltas + [detok.flush()], detok


def expected_text(tokenizer, prompt, output, skip_special_tokens=True) -> str:
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("prompt_text", ["", "The user said:", "你好"])
def test_deltas_concatenate_to_decode_for_every_split(tokenizer, prompt_text):
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    rng = random.Random(1)
    for text in TEXTS + random_texts(40, seed=len(prompt_text)):
        output = tokenizer.encode(text, add_special_tokens=False)
        want = expected_text(tokenizer, prompt, output)
        if not prompt:
            assert want == tokenizer.decode(output)
        splits = [[[i] for i in output], [output]] + [random_chunks(output, rng) for _ in range(3)]
        for chunks in splits:
            deltas, _ = stream(tokenizer, prompt, chunks)
            assert "".join(deltas) == want, (text, chunks)
            assert "\ufffd" not in "".join(deltas)  # never half a character, at any point


def test_multibyte_characters_are_held_until_complete(tokenizer):
    ids = tokenizer.encode("𝄞", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split over several byte tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(np.int64(ids[-1])) == "𝄞"  # NumPy ids are accepted too


def test_incomplete_tail_is_flushed_as_decode_gives_it(tokenizer):
    ids = tokenizer.encode("ok 𝄞", add_special_tokens=False)[:-1]
    deltas, _ = stream(tokenizer, [], [[i] for i in ids])
    assert "".join(deltas[:-1]) == "ok " or "".join(deltas[:-1]) == "ok"
    assert "".join(deltas) == tokenizer.decode(ids) and deltas[-1].endswith("\ufffd")


def test_prefix_space_after_prompt_context(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    output = tokenizer.encode("Hello world", add_special_tokens=False)[len(prompt):]
    deltas, _ = stream(tokenizer, prompt, [[i] for i in output])
    assert "".join(deltas) == " world"  # the space of "▁world" survives, unlike tokenizer.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = tokenizer.eos_token_ids[0]
    output = tokenizer.encode("done", add_special_tokens=False) + [eos]
    deltas, _ = stream(tokenizer, [], [[i] for i in output], skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=skip)
    assert ("".join(deltas).endswith(tokenizer.special_tokens["eos_token"])) is not skip


def test_stop_string_across_token_boundaries(tokenizer):
    text = "Hello world! STOP here 你好"
    output = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for chunks in [[[i] for i in output], [output]] + [random_chunks(output, rng) for _ in range(5)]:
        deltas, detok = stream(tokenizer, [], chunks, stop=("ST", "STOP", "here"))
        assert detok.stopped and detok.stop_reason == "ST"
        assert "".join(deltas) == "Hello world! "
    deltas, detok = stream(tokenizer, [], [[i] for i in output], stop=("P here", "好"))
    assert detok.stop_reason == "P here" and "".join(deltas) == "Hello world! STO"
    assert detok.add(output[:2]) == "" and detok.flush() == ""  # nothing after a stop


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("world peace",))
    out = "".join(detok.add(i) for i in tokenizer.encode("Hello world", add_special_tokens=False))
    assert out == "Hello " and not detok.stopped  # "world" may still become "world peace"
    assert detok.flush() == "world" and not detok.stopped
    detok = IncrementalDetokenizer(tokenizer, [], stop=("xyz",))
    out = "".join(detok.add(i) for i in tokenizer.encode("abc xy 你好", add_special_tokens=False))
    assert out + detok.flush() == "abc xy 你好"


def test_stop_strings_never_change_unstopped_text(tokenizer):
    rng = random.Random(7)
    for text in random_texts(30, seed=3):
        output = tokenizer.encode(text, add_special_tokens=False)
        stop = ("\u0000never", "zzzz")
        deltas, detok = stream(tokenizer, [], random_chunks(output, rng), stop=stop)
        assert "".join(deltas) == tokenizer.decode(output) and not detok.stopped
        stop_at = rng.randrange(len(text))
        stop_str = text[stop_at:stop_at + 3]
        deltas, detok = stream(tokenizer, [], random_chunks(output, rng), stop=(stop_str,))
        decoded = tokenizer.decode(output)
        cut = decoded.find(stop_str)
        assert detok.stopped == (cut >= 0)
        assert "".join(deltas) == (decoded[:cut] if cut >= 0 else decoded)
