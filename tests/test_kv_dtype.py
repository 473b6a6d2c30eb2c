"""The KV cache's element type (docs/KV_CACHE.md): bf16 by default, fp16 for fp16 models, fp8 e4m3 with per-layer
scales on request, fp32 as the reference.

Tolerances of the NumPy backend against its float32 cache, on the shipped model over 400 held-out tokens,
relative to the largest float32-cache logit: the median position within 1e-2 (bf16: 8 significant bits), 1e-3
(fp16: 11) and 5e-2 (fp8 e4m3: 4), the argmax equal at 95 % of positions or more (90 % for fp8). The largest error
is not bounded by rounding: at a few positions a routing near-tie picks another expert (as it does between any two
float32 orders of summation), so it is not asserted. Perplexity over 1000 tokens of the model's held-out split (the
first window of benchmarks/data/default_model/traces_test.npz) rises by at most 0.5 % with any of them. Greedy
tokens of the shipped model on the fixed prompt set below are the same with bf16 and fp16 caches as with float32
(none changed).
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
from colibri_stream.batch import single_sequence_batch
from colibri_stream.loader import load_model
from colibri_stream.model.paged_kv import kv_bytes_per_token, resolve_kv_dtype
from colibri_stream.request import SamplingParams
from test_parity import colibri_logits
from colibri_stream.errors import ConfigError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n",
           "The quick brown fox", "Q: What is 2 + 2?\nA:", "class Stack:\n    def push(self, item):",
           "In 1969, the first", "Dear Sir or Madam,", "SELECT name FROM users WHERE"]
MEDIAN_TOLERANCE = {"bf16": 1e-2, "fp16": 1e-3, "fp8": 5e-2}
MIN_ARGMAX_AGREEMENT = {"bf16": 0.95, "fp16": 0.95, "fp8": 0.9}
MAX_PERPLEXITY_RISE = 0.005


@pytest.fixture(scope="module")
def shipped():
    return load_model(default_model_path(), device="cpu")


@pytest.fixture(scope="module")
def text_ids() -> np.ndarray:
    """The first 1000 tokens of the shipped model's first held-out window (its routing traces' tokens)."""
    traces = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "default_model" / "traces_test.npz"
    return np.load(traces)["tokens"][0, :1000].astype(np.int64)  # [S]


@pytest.fixture(scope="module")
def float32_cache_logits(shipped, text_ids) -> np.ndarray:
    return colibri_logits(shipped, text_ids, "fp32")  # [S, V]


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1]."""
    shifted = logits[:-1].astype(np.float64)
    shifted -= shifted.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # [S - 1, V]
    return float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))


@pytest.mark.parametrize("kv_dtype", MEDIAN_TOLERANCE)
def test_smaller_caches_give_the_float32_cache_logits_within_their_rounding(shipped, text_ids, float32_cache_logits,
                                                                           kv_dtype):
    reference, ids = float32_cache_logits[:400], text_ids[:400]
    ours = colibri_logits(shipped, ids, kv_dtype)
    per_position = np.abs(ours - reference).max(axis=1) / np.abs(reference).max()  # [S]
    assert np.median(per_position) <= MEDIAN_TOLERANCE[kv_dtype]
    assert (ours.argmax(axis=1) == reference.argmax(axis=1)).mean() >= MIN_ARGMAX_AGREEMENT[kv_dtype]
    assert np.abs(ours - reference).max() > 0  # the cache really held rounded values


@pytest.mark.parametrize("kv_dtype", MEDIAN_TOLERANCE)
def test_smaller_caches_cost_at_most_half_a_percent_of_perplexity(shipped, text_ids, float32_cache_logits,
                                                                  kv_dtype):
    reference = perplexity(float32_cache_logits, text_ids)
    assert perplexity(colibri_logits(shipped, text_ids, kv_dtype), text_ids) <= reference * (1 + MAX_PERPLEXITY_RISE)


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
    assert resolve_kv_dtype("fp8", config) == "float8_e4m3"
    assert kv_bytes_per_token(config, "float8_e4m3") * 2 == kv_bytes_per_token(config, "bfloat16")
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


def test_an_fp8_cache_stores_scaled_saturated_values_and_attends_to_them_rescaled(shipped):
    """Stored: key / k_scale rounded to e4m3 (saturated at 448); read: stored * k_scale. With scales that keep the
    values in range and exact (powers of two), attention over the fp8 cache equals attention over a float32 cache
    holding the same rounded keys and values."""
    cache = shipped.allocate_kv_cache(2, 4, "fp8")
    assert cache.keys[0].dtype == ml_dtypes.float8_e4m3fn and cache.k_scales == [1.0] * shipped.config.num_layers
    rng = np.random.default_rng(1)
    key, value = rng.standard_normal((2, 8, 2, 64)).astype(np.float32) * 3
    key[0, 0, :2] = [2000.0, -2000.0]
    scales = (0.5, 0.25)
    backend = shipped.backend
    backend.write_kv(cache.keys[0], cache.values[0], key, value, np.arange(8), scales)
    stored = cache.keys[0].reshape(8, 2, 64).astype(np.float32)
    assert stored[0, 0, 0] == 448 and stored[0, 0, 1] == -448  # 4000 saturated
    assert np.array_equal(stored[1], (key[1] / 0.5).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    rounded_keys = (cache.keys[0].astype(np.float32) * scales[0]).reshape(2, 4, 2, 64)
    rounded_values = (cache.values[0].astype(np.float32) * scales[1]).reshape(2, 4, 2, 64)
    batch = single_sequence_batch(np.arange(8), 0, np.arange(2), 4)
    query = rng.standard_normal((8, 4, 64)).astype(np.float32)
    ours = backend.paged_attention(query, cache.keys[0], cache.values[0], batch, {}, 0.125, None, scales)
    plain = backend.paged_attention(query, rounded_keys, rounded_values, batch, {}, 0.125, None)
    np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-6)


def test_the_engine_option_and_the_flag_choose_the_cache_dtype():
    core = EngineCore.from_pretrained(None, device="cpu", kv_cache_dtype="fp16", max_seq_len=64)
    assert core.runner.kv_cache.dtype == "float16" and core.runner.kv_cache.values[3].dtype == np.float16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bf16, fp16, fp8, fp32"):
        EngineConfig.from_options("m", kv_cache_dtype="float8")
    for command in ("serve", "generate"):
        argv = [command, "--kv-cache-dtype", "fp32", "--gpu-memory-utilization", "0.5"]
        args = build_parser().parse_args(argv + (["--prompt", "x"] if command == "generate" else []))
        options = _engine_options(args)
        assert options["kv_cache_dtype"] == "fp32" and options["gpu_memory_utilization"] == 0.5
        EngineConfig.from_options("m", **options)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
