"""The tiered expert store on tiny exported models: logits bit-identical to the fully resident model at every
budget, policy and prefetch setting (offline and through the server), batch union, prefetch statistics, checksum
errors from L3 reads, start-up errors for budgets and usage files, routing traces and usage files."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from test_server import LiveServer, async_client, request
from tiny_models import build_hf_model

from colibri_stream.checkpoint import ModelFolder, expert_block_layout, read_config
from colibri_stream.cli import main
from colibri_stream.config import ExpertStoreConfig
from colibri_stream.errors import CheckpointError, ConfigError
from colibri_stream.experts.build import open_expert_store
from colibri_stream.experts.policies import LRUPolicy
from colibri_stream.experts.prefetcher import Prefetcher
from colibri_stream.experts.slots import layer_slot_counts
from colibri_stream.experts.store import Float32ExpertStore, MappedExpertStore
from colibri_stream.experts.tiers import HostTier, TieredExpertStore
from colibri_stream.experts.trace import USAGE_FILE, read_trace, read_usage, write_usage
from colibri_stream.loader import load_model
from colibri_stream.request import Request, SamplingParams
from colibri_stream.runner import build_batch
from colibri_stream.scheduler import ScheduledSeq

PROMPTS = [[5, 17, 99, 3, 42, 8, 250, 11, 7], [200, 1, 64], [33, 34, 35, 36, 37, 38]]
BLOCK = 4


@pytest.fixture(scope="module")
def moe16_dir(tmp_path_factory) -> Path:
    """Qwen2-MoE with 16 experts (top-2), MoE layers 0, 2 and 3 (a dense MLP in layer 1), a shared expert, int8
    experts, and a usage file of made-up counts."""
    from colibri_stream.export import export_model

    hf_dir = tmp_path_factory.mktemp("hf_moe16")
    build_hf_model("qwen2_moe", hf_dir, num_experts=16, num_hidden_layers=4)
    out = tmp_path_factory.mktemp("models") / "moe16"
    export_model(hf_dir, out, dtype="fp32", quantize="int8", progress=False)
    config = read_config(out)
    rng = np.random.default_rng(0)
    write_usage(out / USAGE_FILE, config, rng.integers(0, 100, (len(config.moe_layers), 16)), 10)
    return out


def budget(model_dir: Path, slots: int) -> int:
    """--l2-cache-size for `slots` slots per MoE layer (plus the staging block)."""
    config = read_config(model_dir)
    return (slots * len(config.moe_layers) + 1) * expert_block_layout(config)[1]


def step_logits(model, steps: int = 4) -> list[np.ndarray]:
    """Logits [3, V] of a batched prefill of PROMPTS, then `steps` batched greedy decode steps."""
    per_seq = -(-(max(map(len, PROMPTS)) + steps) // BLOCK)
    kv = model.allocate_kv_cache(per_seq * len(PROMPTS), BLOCK, "fp32")  # the comparisons' tolerances are float32's
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    requests = [Request(str(i), p, SamplingParams()) for i, p in enumerate(PROMPTS)]
    chunks, starts = [list(p) for p in PROMPTS], [0] * len(PROMPTS)
    out = []
    for _ in range(steps + 1):
        seqs = [ScheduledSeq(r, c, s, t, True) for r, c, s, t in zip(requests, chunks, starts, tables)]
        out.append(model.forward(build_batch(seqs, BLOCK), kv))  # [3, V]
        starts = [s + len(c) for s, c in zip(starts, chunks)]
        chunks = [[int(t)] for t in out[-1].argmax(axis=-1)]
    return out


@pytest.fixture(scope="module")
def resident_logits(moe16_dir) -> list[np.ndarray]:
    model = load_model(str(moe16_dir))
    assert isinstance(model.store, Float32ExpertStore)  # resident and small: widened once, read from the map
    return step_logits(model)


@pytest.mark.parametrize("slots", [1, 2, 8, 15])
@pytest.mark.parametrize("policy", ["lru", "lfu", "pinned"])
@pytest.mark.parametrize("prefetch", [(False, 1), (True, 1), (True, 2)], ids=["no-prefetch", "next", "two-ahead"])
def test_logits_are_bit_identical_to_the_resident_model(moe16_dir, resident_logits, slots, policy, prefetch):
    options = ExpertStoreConfig(l2_cache_size=budget(moe16_dir, slots), eviction_policy=policy,
                                prefetch=prefetch[0], prefetch_lookahead=prefetch[1])
    model = load_model(str(moe16_dir), experts=options)
    assert isinstance(model.store, TieredExpertStore)
    for ours, reference in zip(step_logits(model), resident_logits, strict=True):
        assert np.array_equal(ours, reference)
    stats = model.store.stats()
    host, disk = stats.tiers["host"], stats.tiers["disk"]
    assert stats.steps == 5
    assert host.hits + host.misses == int(stats.used.sum())  # one request per distinct expert and layer-step
    assert disk.hits == host.misses and disk.bytes_read >= host.misses * model.store.block_size
    if prefetch[0]:
        assert 0.0 <= stats.prefetch_recall <= 1.0
        assert (stats.prefetch_loads > 0) == (policy != "pinned")  # pinned slots admit no other expert
        assert stats.recall_per_layer()[0] is None  # nothing predicts the first MoE layer
    else:
        assert stats.prefetch_loads == 0 and stats.prefetch_recall is None


def test_batch_union_loads_each_expert_once_per_step(moe16_dir):
    config = read_config(moe16_dir)
    model = load_model(str(moe16_dir), experts=ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 15),
                                                                 prefetch=False))
    step_logits(model, steps=0)  # one batched prefill step of 18 tokens x top-2 routes per MoE layer
    stats = model.store.stats()
    assert stats.tiers["disk"].hits == int(stats.used.sum()) < 18 * config.top_k * len(config.moe_layers)
    assert stats.bypass_loads == 0


def test_fully_resident_budgets_use_the_memory_map(moe16_dir):
    for options in (ExpertStoreConfig(), ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 16))):
        store = load_model(str(moe16_dir), experts=options).store
        assert isinstance(store, Float32ExpertStore) and isinstance(store.inner, MappedExpertStore)


def test_small_resident_experts_are_widened_once_to_the_same_values(moe16_dir):
    folder = ModelFolder(moe16_dir)
    layer = folder.config.moe_layers[0]
    store = Float32ExpertStore(MappedExpertStore(folder.experts))
    first = store.expert(layer, 3)
    assert store.expert(layer, 3) is first  # cached, not widened again
    stored = folder.experts.tensors(layer, 3)
    for name in ("gate", "up", "down"):
        assert first[name].dtype == np.float32
        reference = stored[name].astype(np.float32) * stored[f"{name}_scale"][:, None]  # int8 times its row scales
        np.testing.assert_array_equal(first[name], reference)
    large = ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 2))
    assert isinstance(load_model(str(moe16_dir), experts=large).store, TieredExpertStore)  # tiers are never widened


def corrupt_copy(model_dir: Path, tmp_path: Path, layer: int, expert: int) -> Path:
    folder = tmp_path / "corrupt"
    shutil.copytree(model_dir, folder)
    experts = ModelFolder(folder).experts
    offset = int(experts.entry(layer, expert)["offset"]) + 100
    experts.close()
    with open(folder / "experts.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return folder


def test_a_corrupt_block_read_from_disk_is_reported_with_layer_and_expert(moe16_dir, tmp_path):
    config = read_config(moe16_dir)
    layer = config.moe_layers[-1]
    folder = ModelFolder(corrupt_copy(moe16_dir, tmp_path, layer, 5))
    store = open_expert_store(folder, ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 2), prefetch=False), "cpu")
    store.expert(layer, 4)
    with pytest.raises(CheckpointError, match=f"expert 5 of layer {layer} fails its checksum"):
        store.expert(layer, 5)
    assert store.stats().load_errors == 1
    store.expert(layer, 6)  # the failed slot was freed; the store goes on


class InlineTier(HostTier):
    """Host slots whose background loads run in the caller's thread: done (or failed) when start_load returns."""

    def start_load(self, layer: int, expert: int, slot: int) -> Future:
        future: Future = Future()
        try:
            self.load(layer, expert, slot)
            future.set_result(None)
        except CheckpointError as error:
            future.set_exception(error)
        return future


def test_a_corrupt_prefetched_block_is_dropped_then_reported_when_needed(moe16_dir, tmp_path):
    config = read_config(moe16_dir)
    first, second = config.moe_layers[0], config.moe_layers[1]
    folder = ModelFolder(corrupt_copy(moe16_dir, tmp_path, second, 3))
    router = folder.dense.get(f"layers.{second}.router")  # [E, H]
    x = np.asarray(router[3:4], np.float32) * 50  # a token the next router sends to expert 3 first
    slots, layers = 4, len(config.moe_layers)
    routers = [folder.dense.get(f"layers.{layer}.router") for layer in config.moe_layers]
    inline = TieredExpertStore(folder.experts, InlineTier(folder.experts, slots * layers), slots,
                               [LRUPolicy() for _ in range(layers)], Prefetcher(routers, config.top_k))
    threaded = open_expert_store(folder, ExpertStoreConfig(l2_cache_size=budget(moe16_dir, slots)), "cpu")
    for store in (inline, threaded):
        store.begin_layer(first, x, np.array([[0, 1]]))  # predicts expert 3 for the second layer, loads it
        store.begin_layer(second, x, np.array([[3, 4]]))
        if store is inline:
            assert store.stats().load_errors == 1  # the failed prefetch was noticed and its slot freed
        with pytest.raises(CheckpointError, match=f"expert 3 of layer {second} fails its checksum"):
            store.expert(second, 3)  # the demand read (or the wait for the prefetch) reports it
        store.expert(second, 4)


def test_budget_and_usage_problems_fail_at_start(moe16_dir, tmp_path):
    config = read_config(moe16_dir)
    block = expert_block_layout(config)[1]
    with pytest.raises(ConfigError, match=r"--l2-cache-size .* is too small: one expert slot per MoE layer needs"):
        load_model(str(moe16_dir), experts=ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 1) - 1))
    load_model(str(moe16_dir), experts=ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 1)))
    missing = ExpertStoreConfig(l2_cache_size=4 * block * 4, eviction_policy="pinned",
                                usage_file=str(tmp_path / "none" / "usage.json"))
    with pytest.raises(ConfigError, match="cannot|does not exist"):
        load_model(str(moe16_dir), experts=missing)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "colibri-expert-usage", "num_experts": 8, "layers": {}}))
    with pytest.raises(ConfigError, match="does not describe this model"):
        load_model(str(moe16_dir), experts=ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 2),
                                                             eviction_policy="pinned", usage_file=str(wrong)))
    layers = {str(layer): [1] * config.num_experts for layer in config.moe_layers}
    first = str(config.moe_layers[0])
    for damaged in ([], {"format": "colibri-expert-usage", "num_experts": 16, "layers": []},
                    {"format": "colibri-expert-usage", "num_experts": 16, "layers": {**layers, first: ["a"] * 16}},
                    {"format": "colibri-expert-usage", "num_experts": 16, "layers": {**layers, "x": [1] * 16}},
                    {"format": "colibri-expert-usage", "num_experts": 16, "layers": {**layers, first: [-1] * 16}}):
        wrong.write_text(json.dumps(damaged))
        with pytest.raises(ConfigError, match="does not describe this model"):
            read_usage(wrong, config)
    wrong.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="not readable JSON"):
        read_usage(wrong, config)
    with pytest.raises(ConfigError, match="eviction_policy"):
        ExpertStoreConfig(eviction_policy="fifo")
    folder = ModelFolder(moe16_dir)
    dense = (moe16_dir / config.dense_file).stat().st_size
    with pytest.raises(ConfigError, match="does not even hold the dense weights"):
        open_expert_store(folder, ExpertStoreConfig(gpu_memory_limit=dense), "cuda")
    with pytest.raises(ConfigError, match="cpu_experts must be one of auto, off, all"):
        ExpertStoreConfig(cpu_experts="sometimes")
    with pytest.raises(ConfigError, match="gpu_slot_layout must be one of spread, layers"):
        ExpertStoreConfig(gpu_slot_layout="diagonal")
    for threads in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="cpu_threads must be a positive integer"):
            ExpertStoreConfig(cpu_threads=threads)


def test_cpu_threads_bound_the_numpy_backends_expert_executor(moe16_dir):
    from colibri_stream.experts.cpu_executor import CpuExpertExecutor

    every = CpuExpertExecutor().num_threads
    assert load_model(str(moe16_dir), device="cpu").backend.experts.num_threads == every
    model = load_model(str(moe16_dir), device="cpu", experts=ExpertStoreConfig(cpu_threads=1))
    assert model.backend.experts.num_threads == 1


@pytest.mark.parametrize(("per_layer", "layers", "experts", "layout", "want"), [
    (4, 8, 8, "spread", [4] * 8),
    (4, 8, 8, "layers", [0, 0, 0, 0, 8, 8, 8, 8]),  # whole layers, the last ones
    (3, 3, 8, "layers", [0, 1, 8]),  # the remainder to the layer before the whole ones
    (2, 4, 8, "layers", [0, 0, 0, 8]),
    (0, 4, 8, "layers", [0, 0, 0, 0]),
])
def test_gpu_slot_layouts_share_the_same_budget(per_layer, layers, experts, layout, want):
    counts = layer_slot_counts(per_layer, layers, experts, layout)
    assert counts == want and sum(counts) == per_layer * layers
    with pytest.raises(ValueError, match="slot layout"):
        layer_slot_counts(per_layer, layers, experts, "diagonal")


def test_pinned_policy_preloads_the_most_used_experts(moe16_dir):
    config = read_config(moe16_dir)
    usage, _ = read_usage(moe16_dir / USAGE_FILE, config)
    model = load_model(str(moe16_dir), experts=ExpertStoreConfig(l2_cache_size=budget(moe16_dir, 3),
                                                                 eviction_policy="pinned", prefetch=False))
    stats = model.store.stats()
    assert stats.tiers["disk"].bytes_read == 3 * len(config.moe_layers) * model.store.block_size
    top = np.argsort(-usage[0], kind="stable")[:3]
    for expert in top:
        model.store.expert(config.moe_layers[0], int(expert))
    assert model.store.stats().tiers["host"].hits == 3


def test_routing_trace_and_usage_file_are_recorded(moe16_dir, tmp_path):
    config = read_config(moe16_dir)
    trace, usage_file = tmp_path / "trace.jsonl", tmp_path / "usage.json"
    options = ExpertStoreConfig(routing_trace=str(trace), usage_file=str(usage_file))
    for run in range(2):  # the second run adds its routes to the first's
        model = load_model(str(moe16_dir), experts=options)
        step_logits(model, steps=2)
        model.store.flush()
    steps = read_trace(trace, config)
    assert len(steps) == len(config.moe_layers) and all(len(layer) == 3 for layer in steps)
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["step"] == 0 and first["layer"] == config.moe_layers[0]
    assert len(first["experts"]) == sum(map(len, PROMPTS)) and len(first["experts"][0]) == config.top_k
    counts, recorded_steps = read_usage(usage_file, config)
    tokens = sum(map(len, PROMPTS)) + 2 * len(PROMPTS)
    assert recorded_steps == 6 and (counts.sum(axis=1) == 2 * tokens * config.top_k).all()


def answers(live: LiveServer, prompts: list[str]) -> list[dict]:
    """Greedy completions with logprobs, one prompt at a time, then 4 seeded samples of one prompt in one request
    (4 sequences batched in every step, deterministically)."""
    client = async_client(live)

    async def ask() -> list:
        replies = [await client.completions.create(model="tiny-mixtral", prompt=p, max_tokens=6, temperature=0,
                                                   logprobs=3) for p in prompts]
        replies.append(await client.completions.create(model="tiny-mixtral", prompt=prompts[0], max_tokens=8, n=4,
                                                       temperature=1.0, seed=7, logprobs=2))
        return replies

    return [choice.model_dump() for reply in asyncio.run(ask()) for choice in reply.choices]


def test_server_with_one_slot_per_layer_answers_like_the_resident_server(tiny_model_dir):
    prompts = ["Mixture of experts", "The quick brown fox", "你好"]
    tiered = {"l2_cache_size": budget(tiny_model_dir, 1), "eviction_policy": "lfu"}
    results = {}
    for name, options in {"resident": {}, "tiered": tiered}.items():
        live = LiveServer(tiny_model_dir, {"max_batch_size": 4, **options})
        try:
            results[name] = answers(live, prompts)
            _, _, metrics = request(live, "GET", "/metrics", key=None)
        finally:
            live.close()
        assert (b'colibri_expert_tier_hits_total{tier="host"}' in metrics) == (name == "tiered")
    assert results["tiered"] == results["resident"]
    assert len(results["tiered"]) == 7 and len({c["text"] for c in results["tiered"][3:]}) > 1


def test_generate_flags_reach_the_store(tiny_model_dir, tmp_path, capsys):
    command = ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "Mixture of experts",
               "--max-tokens", "5", "--json"]
    assert main(command) == 0
    resident = capsys.readouterr().out
    trace = tmp_path / "trace.jsonl"
    assert main(command + ["--l2-cache-size", "300KiB", "--eviction-policy", "lfu", "--prefetch-lookahead", "2",
                           "--routing-trace", str(trace)]) == 0
    assert capsys.readouterr().out == resident
    assert len(read_trace(trace, read_config(tiny_model_dir))[0]) == 5  # the prefill step and 4 decode steps
    assert main(command + ["--l2-cache-size", "1KiB"]) == 1
    assert "--l2-cache-size 1.0 KiB is too small" in capsys.readouterr().err


def test_expert_metrics_report_where_experts_ran_and_the_cut_ones():
    from types import SimpleNamespace

    from colibri_stream.experts.stats import ExpertStats, TierStats
    from colibri_stream.metrics import ExpertStoreCollector

    stats = ExpertStats(2, tiers={"gpu": TierStats(hits=5, misses=3)})
    stats.compute.gpu_experts, stats.compute.cpu_experts, stats.compute.split_experts = 7, 4, 2
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in ExpertStoreCollector(SimpleNamespace(store_stats=lambda: stats)).collect()
               for s in family.samples}
    assert samples[("colibri_expert_computed_total", (("device", "gpu"),))] == 7
    assert samples[("colibri_expert_computed_total", (("device", "cpu"),))] == 4
    assert samples[("colibri_expert_split_total", ())] == 2
