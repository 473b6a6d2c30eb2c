"""Sliding-window layers' KV bounded by the window (sliding_blocks.py, docs/KV_CACHE.md): a sequence holds a
bounded number of sliding blocks however long it grows, a cached prefix whose last window of sliding blocks was
evicted is cut back, and engines with the pool compute the tokens and logprobs of engines without it, through
chunked prefill, preemption, prefix-cache hits and cut-back hits, steps launched ahead, and a model whose every
layer has a window."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from colibri_stream.block_pool import ROOT
from colibri_stream.cli import main
from colibri_stream.config import CacheConfig
from colibri_stream.engine import EngineCore
from colibri_stream.kv_budget import SlidingPool, size_kv_cache, sliding_pool_blocks
from colibri_stream.kv_cache import KVCacheManager
from colibri_stream.model.paged_kv import SlidingLayers
from colibri_stream.request import SamplingParams
from colibri_stream.sliding_blocks import sliding_blocks_per_seq
from colibri_stream.synthetic import write_synthetic_folder
from conftest import write_tokenizer
from test_synthetic import gpt_oss_config, small

WINDOW, BLOCK = 8, 4  # gpt_oss_config's window
TOKENS = list(range(100, 400))


def step_through(kv: KVCacheManager, seq: str, chunks: list[int], computed: int = 0) -> int:
    """Allocate and cache `seq`'s chunks one step each, as the scheduler does; returns its computed tokens."""
    for n in chunks:
        assert kv.allocate_slots(seq, computed + n, num_computed=computed) is not None
        table = kv.sliding_block_ids(seq)
        held = [block for block in table if block != kv.sliding.placeholder]
        assert len(table) == len(kv.block_ids(seq))
        assert len(held) <= sliding_blocks_per_seq(WINDOW, BLOCK, n)
        assert kv.sliding.placeholder not in table[kv.sliding.first_block_read(computed):]  # what the step reads
        computed += n
        kv.cache_blocks(seq, TOKENS, computed)
    return computed


def evict_unheld(kv: KVCacheManager) -> None:
    """Evict every cached sliding block no sequence holds (allocated all at once, given back uncached)."""
    pool = kv.sliding.pool
    pool.free(pool.allocate(pool.num_free))


def test_a_long_sequence_holds_a_bounded_number_of_sliding_blocks():
    kv = KVCacheManager(64, BLOCK, sliding_window=WINDOW, num_sliding_blocks=8)
    assert step_through(kv, "a", [20, 16] + [1] * 200) == 236  # 59 blocks of context in 8 sliding blocks
    kv.free("a")
    assert (kv.num_free_blocks, kv.sliding.pool.num_free) == (64, 8)


def test_a_prefix_whose_last_window_was_evicted_is_cut_back():
    kv = KVCacheManager(64, BLOCK, sliding_window=WINDOW, num_sliding_blocks=16)
    step_through(kv, "a", [20, 20])
    kv.free("a")
    prompt = TOKENS[:41]  # 10 cached blocks at most
    assert len(kv.find_cached_prefix(prompt).block_ids) == 10  # its last window (blocks 8, 9) is cached
    shorter = kv.find_cached_prefix(prompt[:21])
    assert len(shorter.block_ids) == 5
    assert shorter.sliding_block_ids[:3] == [kv.sliding.placeholder] * 3  # blocks 3, 4: the window of position 20
    assert kv.allocate_slots("b", 21, shorter, num_computed=20) is not None  # b holds them while the rest goes
    evict_unheld(kv)
    kv.free("b")
    hit = kv.find_cached_prefix(prompt)
    assert (hit.block_ids, hit.sliding_block_ids) == (shorter.block_ids, shorter.sliding_block_ids)
    evict_unheld(kv)
    assert kv.find_cached_prefix(prompt).block_ids == []  # no window left: nothing served
    assert kv.pool.lookup((ROOT, tuple(prompt[:4]))) is not None  # the full layers' blocks stay cached


def test_the_sliding_pool_is_sized_for_the_batch_and_taken_off_the_budget_first():
    blocks = sliding_pool_blocks(WINDOW, BLOCK, max_batch_size=3, max_num_batched_tokens=16, prefix_caching=True)
    assert blocks == 3 * (2 + 2) + 4 + 3 * (2 + 1)  # windows and a step's tokens running, as many windows cached
    pool = SlidingPool(blocks, bytes_per_token=100)
    cache = CacheConfig(block_size=BLOCK, kv_cache_memory=pool.bytes(BLOCK) + 50 * BLOCK * 200)
    sized = size_kv_cache(cache, 200, 128, 64, 3, 0, pool)
    assert (sized.num_blocks, sized.num_sliding_blocks) == (50, blocks)
    every_layer = size_kv_cache(CacheConfig(block_size=BLOCK), 0, 128, 64, 3, pool.bytes(BLOCK), pool)
    assert every_layer.num_blocks == 3 * 16  # tables and prefix-cache keys only: max_batch_size sequences
    assert SlidingLayers.of(gpt_oss_config(), max_seq_len=WINDOW) is None  # a window as long as any sequence


MODELS = {"gpt-oss": gpt_oss_config(),  # sliding and full layers
          "mixtral-window": dataclasses.replace(small("mixtral-8x7b"), sliding_windows=(WINDOW, WINDOW))}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    out = {}
    for name, config in MODELS.items():
        out[name] = tmp_path_factory.mktemp("sliding") / name
        write_synthetic_folder(out[name], config, device="cpu")
    write_tokenizer(out["gpt-oss"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out["mixtral-window"] / name).write_bytes((out["gpt-oss"] / name).read_bytes())
    return out


# Three prompts longer than the window in chunks of at most 16 tokens, in a cache too small for all three at once
TIGHT = dict(device="cpu", block_size=BLOCK, max_seq_len=64, max_num_batched_tokens=16, max_batch_size=3,
             num_kv_blocks=24)


def run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, tuple]:
    """Every prompt at once, stepped until done: request id -> (tokens, logprobs); checks after every step that
    each running sequence holds at most a window and a step of sliding blocks."""
    for request_id, ids in prompts.items():
        core.add_request(request_id, ids, params)
    got: dict[str, tuple] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            tokens += out.token_ids
            logprobs += out.logprobs or []
        sliding = core.kv.sliding
        held_in_all = 0
        for request in core.scheduler.running if sliding is not None else ():
            held = [b for b in sliding.block_ids(request.seq_id) if b != sliding.placeholder]
            assert len(held) <= sliding_blocks_per_seq(WINDOW, BLOCK, TIGHT["max_num_batched_tokens"] + 1)
            held_in_all += len(held)
        assert core.stats().sliding_blocks_used == held_in_all  # what /metrics reports
    return got


def workload(core: EngineCore, params: SamplingParams) -> list[dict]:
    """Three prompts that preempt one another; one sharing the prefix of the last to finish (a hit); then, every
    sliding block no sequence holds evicted, one sharing the first's (a hit cut back to nothing where the pool
    is). Returns each round's results."""
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(3, 300, n).tolist() for n in (30, 22, 35))
    results = [run(core, {"a": a, "b": b, "c": c}, params), run(core, {"c2": c + [5, 6, 7, 8, 9]}, params)]
    a2 = a + [11, 12, 13, 14, 15]
    if core.kv.sliding is not None:
        evict_unheld(core.kv)
        assert core.kv.find_cached_prefix(a2).block_ids == []
    return results + [run(core, {"a2": a2}, params)]


@pytest.mark.parametrize("model, ahead", [("gpt-oss", False), ("gpt-oss", True), ("mixtral-window", False)])
def test_engines_with_the_sliding_pool_compute_what_engines_without_it_compute(folders, model, ahead):
    # logprobs keep a step from being launched ahead: with it, tokens alone
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=None if ahead else 2)
    pooled, whole = (EngineCore.from_pretrained(str(folders[model]), **TIGHT, async_scheduling=ahead,
                                                sliding_window_pool=on) for on in (True, False))
    assert pooled.kv.sliding is not None and whole.kv.sliding is None
    *same, cut = workload(pooled, params)
    *expected, whole_hit = workload(whole, params)
    assert same == expected  # the same steps: tokens and logprobs bit for bit
    # a2 computed whole against from a cached prefix: the same tokens; logprobs within float32 rounding (NumPy's
    # products round rows differently with the row count)
    assert cut["a2"][0] == whole_hit["a2"][0]
    for ours, theirs in zip(cut["a2"][1], whole_hit["a2"][1]):
        assert ours[1] == pytest.approx(theirs[1], abs=1e-5)
    stats = pooled.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.sliding_blocks_total == pooled.kv.sliding.pool.num_blocks and stats.sliding_blocks_used == 0
    assert whole.stats().sliding_blocks_total == 0
    assert stats.num_steps_launched_ahead > 0 if ahead else stats.num_steps_launched_ahead == 0
    assert stats.prefix_cache_hit_tokens < whole.stats().prefix_cache_hit_tokens  # the cut-back hit
    for core in (pooled, whole):
        assert core.kv.num_used_blocks == 0
        core.close()
    assert pooled.kv.sliding.pool.num_free == pooled.kv.sliding.pool.num_blocks


def test_plan_counts_the_sliding_layers_per_sequence(folders, capsys):
    assert main(["plan", "--model", str(folders["gpt-oss"])]) == 0
    out = capsys.readouterr().out
    assert "KV cache in bfloat16: 128 B per token (1 layers x keys and values x 2 KV heads x 16 dims)" in out
    # blocks of 16: a decoding sequence holds two, 32 tokens of 128 B
    assert "and 4.0 KiB per sequence, whatever its length, in 1 sliding-window layers (window 8)" in out


@pytest.mark.gpu
def test_the_sliding_pool_on_the_gpu(folders):
    """The workload on the GPU (kernels reading the second tables, decode steps captured in graphs with them):
    with the pool the tokens of the engine without it, the cut-back hit's included."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy finds no CUDA GPU")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    gpu = dict(TIGHT, device="cuda")
    pooled, whole = (EngineCore.from_pretrained(str(folders["gpt-oss"]), **gpu, sliding_window_pool=on)
                     for on in (True, False))
    assert pooled.kv.sliding is not None and pooled.runner.graphs is not None
    tokens = [[{request: got[0] for request, got in result.items()} for result in workload(core, params)]
              for core in (pooled, whole)]
    assert tokens[0] == tokens[1]
    assert pooled.stats().num_preemptions > 0
    for core in (pooled, whole):
        core.close()
