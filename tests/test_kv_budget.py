"""The KV cache's size (kv_budget.py, docs/KV_CACHE.md): from free memory by default, max_seq_len lowered with a
warning when the model's full context does not fit, an explicit max_seq_len that does not fit refused; on the CPU
with real engines of real attention shapes."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from colibri_stream.checkpoint import expert_block_layout
from colibri_stream.cli import main
from colibri_stream.config import CacheConfig
from colibri_stream.engine import EngineCore
from colibri_stream.kv_budget import (HOST_KV_SHARE, MIN_ACTIVATION_RESERVE, activation_reserve, default_budget,
                                      size_kv_cache)
from colibri_stream.memory import MemoryInfo, host_memory
from colibri_stream.model.paged_kv import kv_bytes_per_token
from colibri_stream.request import SamplingParams
from colibri_stream.synthetic import shape_config, write_synthetic_folder
from conftest import TOKENIZER_VOCAB_SIZE, write_tokenizer
from colibri_stream.errors import ConfigError

GiB = 1 << 30
H200 = 139 * GiB
QWEN3 = shape_config("qwen3-30b-a3b")  # 48 layers, 4 KV heads of 128, 40960 positions
# Many layers and a long context: Qwen3-235B-A22B's attention (94 layers, 4 KV heads of 128) over 262144 positions
LONG = dataclasses.replace(shape_config("qwen3-30b-a3b", num_layers=94), max_position_embeddings=262144)


def weight_bytes(config) -> int:
    """The GPU memory of a resident model's dense weights (bf16) and routed experts."""
    dense = 2 * (2 * config.vocab_size * config.hidden_size
                 + config.num_layers * (2 * config.num_heads + 2 * config.num_kv_heads) * config.head_dim
                 * config.hidden_size)
    return dense + len(config.moe_layers) * config.num_experts * expert_block_layout(config)[1]


def gpu_after_loading(config, total: int = H200) -> MemoryInfo:
    return MemoryInfo(free=total - weight_bytes(config), total=total, host=False)


def size(config, memory: MemoryInfo, cache: CacheConfig = CacheConfig(), max_seq_len: int | None = None,
         max_batch_size: int = 32):
    budget = default_budget(memory, cache.gpu_memory_utilization, activation_reserve(config, 2048))
    return size_kv_cache(cache, kv_bytes_per_token(config, "bfloat16"), config.max_position_embeddings, max_seq_len,
                         max_batch_size, budget)


def test_qwen3_30b_a3b_gets_its_whole_context_on_an_h200_with_default_flags():
    memory = gpu_after_loading(QWEN3)
    assert 55 * GiB < weight_bytes(QWEN3) < 60 * GiB  # 30.5 B parameters in bf16
    sized = size(QWEN3, memory)
    assert sized.max_seq_len == 40960 and sized.lowered_from is None and sized.warning() is None
    per_seq = 40960 // 16
    assert per_seq <= sized.num_blocks < 32 * per_seq  # budget-bound: fewer than 32 whole sequences
    expected = int(0.9 * H200) - weight_bytes(QWEN3) - activation_reserve(QWEN3, 2048)
    assert sized.budget_bytes == expected
    assert sized.num_blocks == expected // (16 * kv_bytes_per_token(QWEN3, "bfloat16"))
    # the fixed 1 GiB budget of before could not hold one sequence: this is the sizing that makes it start
    assert 1 * GiB < 40960 * kv_bytes_per_token(QWEN3, "bfloat16")


def test_gpu_budget_is_the_utilization_share_less_what_is_in_use_and_the_activation_reserve():
    memory = MemoryInfo(free=100 * GiB, total=140 * GiB, host=False)
    assert default_budget(memory, 0.9, 2 * GiB) == int(0.9 * 140 * GiB) - 40 * GiB - 2 * GiB
    assert default_budget(memory, 0.25, 2 * GiB) == 0  # other processes hold more than the share: nothing left
    assert default_budget(MemoryInfo(free=10 * GiB, total=64 * GiB, host=True), 0.9, 2 * GiB) == int(
        HOST_KV_SHARE * 10 * GiB)  # the CPU: a share of what is available, no utilization, no reserve
    assert activation_reserve(shape_config("mixtral-8x7b"), 16) == MIN_ACTIVATION_RESERVE
    assert activation_reserve(QWEN3, 2048) > activation_reserve(QWEN3, 1024) > MIN_ACTIVATION_RESERVE


def test_a_context_that_does_not_fit_lowers_max_seq_len_and_says_which_flags_change_it():
    memory = gpu_after_loading(QWEN3, total=80 * GiB)  # an 80 GB GPU: 8 GiB or so left for the cache
    sized = size(LONG, memory)
    assert sized.lowered_from == 262144
    assert 0 < sized.max_seq_len < 262144 and sized.max_seq_len == sized.capacity_tokens
    message = sized.warning()
    assert "max_seq_len lowered to" in message and str(sized.max_seq_len) in message
    for flag in ("--max-seq-len", "--kv-cache-memory", "--gpu-memory-utilization", "--kv-cache-dtype"):
        assert flag in message


def test_an_explicit_max_seq_len_that_does_not_fit_is_an_error():
    memory = gpu_after_loading(QWEN3, total=80 * GiB)
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of max_seq_len 262144: lower --max-seq-len"):
        size(LONG, memory, max_seq_len=262144)
    assert size(LONG, memory, max_seq_len=16384).max_seq_len == 16384  # one that fits is kept
    with pytest.raises(ConfigError, match="exceeds the model's 262144 positions"):
        size(LONG, memory, max_seq_len=262145)


def test_given_sizes_are_taken_as_given():
    memory = gpu_after_loading(QWEN3)
    per_token = kv_bytes_per_token(QWEN3, "bfloat16")
    assert size(QWEN3, memory, CacheConfig(num_kv_blocks=5000)).num_blocks == 5000
    sized = size(QWEN3, memory, CacheConfig(kv_cache_memory=20 * GiB))
    assert sized.num_blocks == 20 * GiB // (16 * per_token) and sized.budget_bytes == 20 * GiB
    small = size(QWEN3, memory, CacheConfig(kv_cache_memory=1 * GiB))  # the model's context, lowered to fit
    assert small.lowered_from == 40960 and small.max_seq_len == 1 * GiB // (16 * per_token) * 16
    with pytest.raises(ConfigError, match="no memory is left for one KV-cache block"):
        size(QWEN3, MemoryInfo(free=0, total=H200, host=False))
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be a number in"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_small_models_reserve_only_what_a_full_batch_can_use():
    memory = gpu_after_loading(QWEN3)
    tiny = dataclasses.replace(QWEN3, max_position_embeddings=1024)
    assert size(tiny, memory, max_batch_size=8).num_blocks == 8 * 1024 // 16


def attention_shaped(config, tmp_path):
    """A model folder with `config`'s attention (layers, heads, context) and tiny everything else, and a tokenizer."""
    small = dataclasses.replace(config, hidden_size=64, vocab_size=TOKENIZER_VOCAB_SIZE, num_experts=4, top_k=2,
                                moe_intermediate_size=32, num_heads=8)
    write_synthetic_folder(tmp_path, small, device="cpu")
    write_tokenizer(tmp_path)
    return tmp_path


def test_a_qwen3_30b_a3b_shaped_model_starts_on_the_cpu_with_default_flags(tmp_path, caplog):
    folder = attention_shaped(QWEN3, tmp_path)
    with caplog.at_level(logging.INFO, logger="colibri_stream.engine"):
        core = EngineCore.from_pretrained(str(folder), device="cpu")
    per_token = kv_bytes_per_token(QWEN3, "bfloat16")
    if 40960 * per_token <= HOST_KV_SHARE * host_memory().free:  # this host holds one sequence of the context
        assert core.max_seq_len == 40960
    assert core.kv.num_blocks * 16 >= core.max_seq_len
    assert any(r.message.startswith(f"KV cache: {core.kv.num_blocks * 16} tokens") for r in caplog.records)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    core.close()


def test_many_layers_with_a_long_context_start_with_max_seq_len_lowered(tmp_path, caplog):
    need = 262144 * kv_bytes_per_token(LONG, "bfloat16")  # 47 GiB
    if need <= HOST_KV_SHARE * host_memory().total:
        pytest.skip("this host's memory holds the whole context")
    folder = attention_shaped(LONG, tmp_path)
    with caplog.at_level(logging.WARNING, logger="colibri_stream.engine"):
        core = EngineCore.from_pretrained(str(folder), device="cpu")
    assert core.max_seq_len < 262144 and core.max_seq_len == core.kv.num_blocks * 16
    warning = next(r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert f"max_seq_len lowered to {core.max_seq_len}" in warning and "--max-seq-len" in warning
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    core.close()
    with pytest.raises(ConfigError, match="cannot hold one sequence of max_seq_len 262144"):
        EngineCore.from_pretrained(str(folder), device="cpu", max_seq_len=262144)


def test_plan_shows_kv_bytes_per_token_and_the_tokens_that_fit(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir), "--device", "cuda", "--gpu-total-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV cache in float32" not in out  # auto is bf16 for this fp32 export
    assert "KV cache in bfloat16:" in out and " per token (" in out
    assert "of 80.0 GiB GPU memory" in out and "holds " in out and " tokens: " in out
    assert main(["plan", "--model", str(tiny_model_dir), "--kv-cache-dtype", "fp32"]) == 0
    assert "KV cache in float32:" in capsys.readouterr().out


def test_plan_counts_the_tokens_the_engine_allocates(tiny_model_dir, capsys):
    """On the CPU the default cache holds at most max_batch_size sequences of the model's context, however much
    host memory is free: `colibri plan` counts what the engine allocates."""
    assert main(["plan", "--model", str(tiny_model_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    core = EngineCore.from_pretrained(str(tiny_model_dir), device="cpu")
    try:
        assert f"holds {core.kv.num_blocks * 16:,} tokens" in out, out
    finally:
        core.close()
