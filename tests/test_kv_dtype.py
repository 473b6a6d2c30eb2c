"""The KV cache's element type (docs/KV_CACHE.md): bf16 by default, fp16 for fp16 models, fp32 as the reference.

Tolerances of the NumPy backend against its float32 cache, on the shipped model over 400 tokens of source text,
relative to the largest float32-cache logit: the median position within 1e-2 (bf16: 8 significant bits) and 1e-3
(fp16: 11), the argmax equal at 95 % of positions or more. The largest error is not bounded by rounding: at a few
positions a routing near-tie picks another expert (as it does between any two float32 orders of summation), so
it is not asserted. Greedy tokens of the shipped model on the fixed prompt set below are the same with bf16 and
fp16 caches as with float32 (none changed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from colibri_stream.checkpoint import default_model_path
from colibri_stream.cli import _engine_options, build_parser
from colibri_stream.config import EngineConfig
from colibri_stream.engine import EngineCore
from colibri_stream.llm import LLM
from colibri_stream.model import load_model
from colibri_stream.model.paged_kv import kv_bytes_per_token, resolve_kv_dtype
from colibri_stream.request import SamplingParams
from colibri_stream.tokenizer import Tokenizer
from test_parity import colibri_logits
from colibri_stream.errors import ConfigError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n",
           "The quick brown fox", "Q: What is 2 + 2?\nA:", "class Stack:\n    def push(self, item):",
           "In 1969, the first", "Dear Sir or Madam,", "SELECT name FROM users WHERE"]
MEDIAN_TOLERANCE = {"bf16": 1e-2, "fp16": 1e-3}
MIN_ARGMAX_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def shipped():
    return load_model(default_model_path(), device="cpu")


@pytest.fixture(scope="module")
def text_ids() -> np.ndarray:
    text = (Path(__file__).resolve().parents[1] / "colibri_stream" / "kv_cache.py").read_text()
    return np.array(Tokenizer.from_folder(default_model_path()).encode(text)[:400])  # [S]


@pytest.mark.parametrize("kv_dtype", MEDIAN_TOLERANCE)
def test_16_bit_caches_give_the_float32_cache_logits_within_their_rounding(shipped, text_ids, kv_dtype):
    reference = colibri_logits(shipped, text_ids, "fp32")  # [S, V]
    ours = colibri_logits(shipped, text_ids, kv_dtype)
    per_position = np.abs(ours - reference).max(axis=1) / np.abs(reference).max()  # [S]
    assert np.median(per_position) <= MEDIAN_TOLERANCE[kv_dtype]
    assert (ours.argmax(axis=1) == reference.argmax(axis=1)).mean() >= MIN_ARGMAX_AGREEMENT
    assert np.abs(ours - reference).max() > 0  # the cache really held rounded values


def test_greedy_tokens_of_the_shipped_model_are_the_float32_cache_tokens():
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(None, device="cpu", kv_cache_dtype="fp32") as reference, LLM(None, device="cpu") as default:
        assert default.engine.runner.kv_cache.dtype == "bfloat16"
        expected = [r.token_ids for r in reference.generate(PROMPTS, params)]
        assert [r.token_ids for r in default.generate(PROMPTS, params)] == expected


def test_auto_is_the_model_dtype_for_fp16_and_bf16_otherwise(shipped):
    config = shipped.config
    assert config.dtype == "bfloat16" and resolve_kv_dtype("auto", config) == "bfloat16"
    assert resolve_kv_dtype("auto", dataclasses.replace(config, dtype="float16")) == "float16"
    assert resolve_kv_dtype("auto", dataclasses.replace(config, dtype="float32")) == "bfloat16"
    assert resolve_kv_dtype("fp32", config) == "float32"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_kv_dtype("int4", config)
    assert kv_bytes_per_token(config, "bfloat16") == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert kv_bytes_per_token(config, "float32") == 2 * kv_bytes_per_token(config, "bfloat16")


def test_the_cache_stores_rounded_values_and_attention_reads_them_widened(shipped):
    cache = shipped.allocate_kv_cache(2, 4)  # auto: bfloat16
    assert cache.keys[0].dtype == ml_dtypes.bfloat16 and cache.keys[0].shape == (2, 4, 2, 64)
    key, value = np.random.default_rng(0).standard_normal((2, 3, 2, 64)).astype(np.float32)
    shipped.backend.write_kv(cache.keys[0], cache.values[0], key, value, np.array([5, -1, 0]))
    rows = cache.keys[0].reshape(8, 2, 64)
    assert np.array_equal(rows[5].astype(np.float32), key[0].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.array_equal(rows[0].astype(np.float32), key[2].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not rows[[1, 2, 3, 4, 6, 7]].astype(np.float32).any()  # the padding row (-1) stored nothing


def test_the_engine_option_and_the_flag_choose_the_cache_dtype():
    core = EngineCore.from_pretrained(None, device="cpu", kv_cache_dtype="fp16", max_seq_len=64)
    assert core.runner.kv_cache.dtype == "float16" and core.runner.kv_cache.values[3].dtype == np.float16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bf16, fp16, fp32"):
        EngineConfig.from_options("m", kv_cache_dtype="float8")
    for command in ("serve", "generate"):
        argv = [command, "--kv-cache-dtype", "fp32", "--gpu-memory-utilization", "0.5"]
        args = build_parser().parse_args(argv + (["--prompt", "x"] if command == "generate" else []))
        options = _engine_options(args)
        assert options["kv_cache_dtype"] == "fp32" and options["gpu_memory_utilization"] == 0.5
        EngineConfig.from_options("m", **options)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
