"""Offline generation: the LLM API and `colibri generate` agree with each other and with the model itself."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from colibri_stream.llm import LLM
from colibri_stream.loader import load_model
from colibri_stream.batch import single_sequence_batch
from colibri_stream.request import SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_stream", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def model_greedy(folder, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy decoding straight on the model, one sequence, no scheduler."""
    model = load_model(folder)
    table = np.arange(8)
    kv = model.allocate_kv_cache(8, 16)
    logits = model.forward(single_sequence_batch(np.array(prompt_ids), 0, table, 16), kv)
    out = []
    for step in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(single_sequence_batch(np.array(out[-1:]), len(prompt_ids) + step, table, 16), kv)
    return out


def test_greedy_generate_equals_model_greedy(llm, tiny_model_dir):
    result = llm.generate("hello world", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert result.token_ids == model_greedy(tiny_model_dir, result.prompt_token_ids, 12)
    assert result.text == llm.tokenizer.decode(result.token_ids)


def test_stream_concatenates_to_generate(llm):
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=11, ignore_eos=True)
    assert "".join(llm.stream("the quick fox", params)) == llm.generate("the quick fox", params).text


def test_batch_equals_single(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["one", "two three", [5, 6, 7, 8]]
    batched = llm.generate(prompts, params)
    assert [r.token_ids for r in batched] == [llm.generate(p, params).token_ids for p in prompts]


def test_cli_json_matches_api(llm, tiny_model_dir):
    done = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "hello world", "--max-tokens", "6",
                   "--temperature", "0.9", "--seed", "3", "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    expected = llm.generate("hello world", SamplingParams(max_tokens=6, temperature=0.9, seed=3))
    assert printed == {"prompt_token_ids": expected.prompt_token_ids, "token_ids": expected.token_ids,
                       "text": expected.text, "finish_reason": expected.finish_reason}


def test_cli_streams_text(tiny_model_dir, llm):
    done = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--max-tokens", "5")
    assert done.returncode == 0, done.stderr
    greedy = llm.generate("abc", SamplingParams(max_tokens=5, temperature=0.0))
    assert done.stdout == greedy.text + "\n"


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/folder"], "error: model folder /no/such/folder does not exist"),
    (["--temperature", "-1"], "error: temperature must be between 0 and 100"),
    (["--max-tokens", "0"], "error: max_tokens must be a positive integer"),
])
def test_cli_bad_input_is_one_line(tiny_model_dir, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    done = run_cli("generate", "--prompt", "x", *args)
    assert done.returncode == 1 and done.stderr.strip() == message and "Traceback" not in done.stderr


def test_empty_prompt_is_refused(llm):
    from colibri_stream.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.generate("", SamplingParams())
