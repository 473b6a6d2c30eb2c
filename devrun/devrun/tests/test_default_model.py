"""The model shipped inside the package: it loads, its checksums verify, and its greedy output is stable.

The golden output is checked in; regenerate it only deliberately (after retraining or a numerics change you
mean to make): `python tests/test_default_model.py --regenerate`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from colibri_stream.checkpoint import ModelFolder, default_model_path
from colibri_stream.llm import LLM
from colibri_stream.request import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "default_model_greedy.json"
PROMPTS = ["def fibonacci(n):", "import os\n\n", "The tuple type is"]
MAX_TOKENS = 24


def greedy_completions() -> list[dict]:
    llm = LLM(None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [{"prompt": p, "token_ids": r.token_ids, "text": r.text} for p, r in zip(PROMPTS, llm.generate(PROMPTS, params))]


def test_shipped_model_verifies():
    folder = ModelFolder(default_model_path(), verify=True)
    assert folder.config.num_experts >= 16 and folder.config.top_k >= 2
    assert folder.experts.config.expert_dtype == "int8"
    size = sum(f.stat().st_size for f in default_model_path().iterdir())
    assert size <= 24 * 1024 * 1024


def test_greedy_output_matches_golden():
    assert greedy_completions() == json.loads(GOLDEN.read_text())


def test_chat_completion_ends_at_end_of_turn():
    llm = LLM()
    result = llm.generate([{"role": "user", "content": "What does len() return?"}],
                          SamplingParams(max_tokens=200, temperature=0.0))
    assert result.finish_reason == "stop" and result.text.strip()


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    GOLDEN.write_text(json.dumps(greedy_completions(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}")
