"""Eviction policies on small traces, with the eviction order worked out by hand; Belady as the upper bound; the
store at run time evicting exactly like the offline replay."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.checkpoint import ModelFolder, expert_block_layout
from colibri_stream.config import ExpertStoreConfig
from colibri_stream.experts.build import open_expert_store
from colibri_stream.experts.policies import BeladyPolicy, LFUDecayPolicy, LRUPolicy, PinnedPolicy
from colibri_stream.experts.replay import replay, replay_policy

# Distinct experts of each step of one layer, in the order the compute asks for them; 2 slots, 4 experts.
TRACE = [[0, 1], [0, 2], [0, 3], [1], [2], [0], [3], [1]]


def test_lru_evicts_the_least_recently_used():
    result = replay(TRACE, LRUPolicy(), 2)
    # step 1: 0 was just used, 1 leaves; step 2: 2 (used at step 1) leaves, 0 was used this step; and so on.
    assert result.evictions == [(1, 1, 2), (2, 2, 3), (3, 0, 1), (4, 3, 2), (5, 1, 0), (6, 2, 3), (7, 0, 1)]
    assert (result.hits, result.misses, result.bypasses) == (2, 9, 0)


def test_lfu_evicts_the_lowest_decayed_count():
    # decay 0.5: at step 3, expert 0 scores 1.75 * 0.5 = 0.875 and expert 3 scores 1 * 0.5: 3 leaves (LRU: 0).
    # step 4: 0 scores 1.75 * 0.25 = 0.44, 1 scores (1 * 0.5^3 + 1) * 0.5 = 0.56: 0 leaves.
    result = replay(TRACE, LFUDecayPolicy(4, decay=0.5), 2)
    assert result.evictions == [(1, 1, 2), (2, 2, 3), (3, 3, 1), (4, 0, 2), (5, 1, 0), (6, 2, 3), (7, 0, 1)]
    policy = LFUDecayPolicy(4, decay=0.5)
    for now in (0, 1, 2):
        policy.on_access(0, now)
    assert policy.score(0, 4) == pytest.approx((1 * 0.5 * 0.5 + 0.5 + 1) * 0.25)


def test_pinned_keeps_the_most_used_experts_and_serves_the_rest_through_staging():
    usage = np.array([10, 5, 1, 8])  # 0 and 3 are preloaded; 1 and 2 never take their slots
    result = replay(TRACE, PinnedPolicy(usage), 2)
    assert result.evictions == []
    assert (result.hits, result.misses, result.bypasses) == (6, 5, 5)
    # among equal counts the lower id ranks first
    assert PinnedPolicy(np.array([3, 7, 7, 1])).preload(2) == [1, 2]


def test_belady_evicts_the_farthest_next_use_and_bypasses_blocks_used_later_still():
    steps = [[0], [1], [2], [0], [2], [1]]
    result = replay(steps, BeladyPolicy(steps, 3), 2)
    # step 2: 0 is next used at 3, 1 at 5, 2 itself at 4: 1 leaves; step 5: 1 is never used again, nor are 0 and 2.
    assert result.evictions == [(2, 1, 2)]
    assert (result.hits, result.bypasses) == (2, 1)
    assert replay(steps, LRUPolicy(), 2).evictions == [(2, 0, 2), (3, 1, 0), (5, 0, 1)]


def test_slots_the_step_still_needs_are_never_evicted():
    # One slot, a step that needs 0 then 1 while 1 is resident: 0 must not take 1's slot (1 is still needed),
    # so 0 goes through the staging block and 1 hits.
    result = replay([[1], [0, 1]], LRUPolicy(), 1)
    assert (result.hits, result.bypasses, result.evictions) == (1, 1, [])


def test_belady_is_an_upper_bound_of_every_policy():
    rng = np.random.default_rng(0)
    popularity = rng.dirichlet(np.full(16, 0.3))  # skewed routing
    steps = [sorted(set(rng.choice(16, 3, replace=False, p=popularity).tolist())) for _ in range(400)]
    usage = np.bincount(np.concatenate(steps), minlength=16)
    for slots in (1, 2, 4, 8):
        best = replay(steps, replay_policy("belady", steps, 16), slots).hits
        for name in ("lru", "lfu", "pinned"):
            assert replay(steps, replay_policy(name, steps, 16, usage), slots).hits <= best


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_store_evicts_like_the_replay(tiny_model_dir, policy):
    folder = ModelFolder(tiny_model_dir)
    config = folder.config
    block = expert_block_layout(config)[1]
    slots = 2
    store = open_expert_store(folder, ExpertStoreConfig(l2_cache_size=(slots * len(config.moe_layers) + 1) * block,
                                                        eviction_policy=policy, prefetch=False), "cpu")
    rng = np.random.default_rng(1)
    routes = rng.integers(0, config.num_experts, (30, len(config.moe_layers), config.top_k))  # [steps, layers, k]
    for step in routes:
        for layer, ids in zip(config.moe_layers, step):
            store.begin_layer(layer, None, ids[None])
            for expert in sorted(set(ids.tolist())):
                tensors = store.expert(layer, expert)
                assert all(np.array_equal(tensors[k], v) for k, v in folder.experts.tensors(layer, expert).items())
    expected = [replay([sorted(set(s.tolist())) for s in routes[:, rank]], replay_policy(policy, [], 8), slots)
                for rank in range(len(config.moe_layers))]
    stats = store.stats()
    assert stats.tiers["host"].hits == sum(r.hits for r in expected)
    assert stats.tiers["host"].misses == sum(r.misses for r in expected)
    assert stats.bypass_loads == sum(r.bypasses for r in expected)
