"""The split of a thinking model's reply into reasoning and content (server/reasoning.py): streamed in any pieces it
gives what the whole reply gives, sends nothing of a tag, and holds back only what may still become one."""

from __future__ import annotations

import pytest

from colibri_stream.server.reasoning import ThinkingStream, opens_thinking

CASES = [  # (reply, the prompt opened the tag, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "Paris."),
    ("Paris.", False, None, "Paris."),
    ("  <think>a</think>b", False, "a", "b"),
    ("<think>\n</think>\n\n", False, "\n", ""),
    ("<think>still thinking when cut", False, "still thinking when cut", ""),
    ("<thin", False, None, "<thin"),  # a tag never finished is content
    ("I see.\n</think>\n\nParis.", True, "I see.\n", "Paris."),
    ("cut inside", True, "cut inside", ""),
    ("Answer with </think> later", False, None, "Answer with </think> later"),
    ("<think>x</think>\n\nA <think> in the answer", False, "x", "A <think> in the answer"),
    ("", False, None, ""),
]


@pytest.mark.parametrize(("reply", "started", "reasoning", "content"), CASES)
def test_a_whole_reply_splits_into_reasoning_and_content(reply, started, reasoning, content):
    stream = ThinkingStream(started)
    pieces = [stream.feed(reply), stream.finish(), stream.finish()]  # a second finish adds nothing
    assert ("".join(r for r, _ in pieces) if stream.thought else None, "".join(c for _, c in pieces)) == \
        (reasoning, content)


@pytest.mark.parametrize(("reply", "started", "reasoning", "content"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_a_streamed_reply_gives_the_same_split_in_any_pieces(reply, started, reasoning, content, size):
    stream = ThinkingStream(started)
    pieces = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)] + [stream.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content
    assert stream.thought == (reasoning is not None)


def test_only_what_may_become_a_tag_is_held():
    stream = ThinkingStream()
    assert stream.feed("<thi") == ("", "")  # may open the tag
    assert stream.feed("nk>Hmm, </th") == ("Hmm, ", "")  # may close it
    assert stream.feed("e best") == ("</the best", "")
    assert stream.feed("</think>") == ("", "")
    assert stream.feed("\n\n") == ("", "")  # the blank line before the answer is dropped
    assert stream.feed("Yes") == ("", "Yes")


def test_a_prompt_that_ends_in_the_opening_tag_starts_the_reply_inside_it():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_reasoning_tokens_count_the_pieces_inside_the_tag_and_the_tags():
    stream = ThinkingStream()
    for piece in ["<", "think", ">", "a", "b", "</think>", "\n\n", "Yes", "."]:
        stream.feed(piece, tokens=1)
    assert stream.reasoning_tokens == 6  # "<", "think", ">", "a", "b", "</think>"
    plain = ThinkingStream()
    for piece in ["<", "b", ">", "hi"]:
        plain.feed(piece, tokens=1)
    assert plain.reasoning_tokens == 0 and not plain.thought
    opened = ThinkingStream(started=True)
    for piece in ["x", "</think>", "y"]:
        opened.feed(piece, tokens=2)
    assert opened.reasoning_tokens == 4
