"""Expert parallelism's dispatch and combine (`experts/expert_parallel.py`) over N fake ranks on threads: the shard
map is balanced, and the MoE layer with N = 1 .. 4 ranks (E not a multiple of N, a rank without tokens) equals the
NumPy backend's single-rank layer, bit for bit through all-to-all and to rounding through all-gather and
reduce-scatter."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.experts.cpu_executor import CpuExpertExecutor
from colibri_stream.experts.expert_parallel import (DispatchPlan, FakeGroup, ShardMap, moe_all_gather,
                                                    moe_all_to_all)
from colibri_stream.experts.store import ExpertStore

HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 7, 2  # 7 experts: a multiple of no rank count above one


class RandomExperts(ExpertStore):
    """One layer of float32 experts of random weights."""

    def __init__(self, num_experts: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.experts = [{"gate": rng.standard_normal((INTER, HIDDEN), np.float32) * 0.2,
                         "up": rng.standard_normal((INTER, HIDDEN), np.float32) * 0.2,
                         "down": rng.standard_normal((HIDDEN, INTER), np.float32) * 0.2}
                        for _ in range(num_experts)]

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return self.experts[expert]


def routing(num_tokens: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, H], weights [T, k] float32, expert_ids [T, k]: each token's distinct experts."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, HIDDEN), np.float32)
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(num_tokens)]).astype(np.int64)
    weights = rng.random((num_tokens, TOP_K), np.float32)
    return x, weights / weights.sum(axis=1, keepdims=True), ids


def on_ranks(num_ranks: int, rank_main, timeout: float = 60) -> list:
    """rank_main(rank) on a thread per rank; their results by rank (the first error re-raised here)."""
    results: list = [None] * num_ranks
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = rank_main(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(error)

    # daemons: ranks left waiting in a collective by a failed one do not keep the test process alive
    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    return results


def run_ranks(num_ranks: int, slices: list[slice], layer_fn, store: ExpertStore, x, weights, ids) -> np.ndarray:
    """The MoE layer on `num_ranks` fake ranks, rank r holding tokens slices[r]; the outputs concatenated."""
    group, shard = FakeGroup(num_ranks), ShardMap(EXPERTS, num_ranks)

    def rank_main(rank: int) -> np.ndarray:
        backend = NumpyBackend(CpuExpertExecutor(1))  # one per rank, as each rank has its own
        part = slices[rank]
        return layer_fn(group.communicator(rank), x[part], weights[part], ids[part], shard,
                        lambda rows, e: backend.experts.run(rows, store.expert(0, e)))

    return np.concatenate(on_ranks(num_ranks, rank_main))


def test_the_shard_map_is_contiguous_and_balanced():
    shard = ShardMap(7, 3)
    assert [list(shard.experts_of(r)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert shard.rank_of.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert [len(ShardMap(8, 4).experts_of(r)) for r in range(4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="some rank would hold none"):
        ShardMap(3, 4)
    with pytest.raises(ValueError, match="at least one"):
        ShardMap(4, 0)


def test_the_dispatch_plan_sends_each_token_once_per_rank_with_its_local_experts():
    ids = np.array([[0, 6], [3, 4], [2, 1]])  # [T=3, k=2]
    weights = np.array([[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]], np.float32)
    plan = DispatchPlan.build(ids, weights, ShardMap(7, 3))
    to_rank = plan.per_rank
    assert to_rank[0].token_rows.tolist() == [0, 2] and to_rank[0].local_experts.tolist() == [0, 1, 2]
    assert to_rank[0].tokens.tolist() == [0, 2, 2] and to_rank[0].rows.tolist() == [0, 1, 1]
    assert to_rank[0].weights.tolist() == [0.5, np.float32(0.1), np.float32(0.9)]
    assert to_rank[1].token_rows.tolist() == [1] and to_rank[1].local_experts.tolist() == [0, 1]
    assert to_rank[2].token_rows.tolist() == [0] and to_rank[2].local_experts.tolist() == [1]
    with pytest.raises(ValueError, match="outside 0 .. 6"):
        DispatchPlan.build(np.array([[7, 0]]), weights[:1], ShardMap(7, 3))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_expert_parallel_all_to_all_equals_the_single_rank_layer_exactly(num_ranks):
    store, (x, weights, ids) = RandomExperts(EXPERTS), routing(11)
    want = NumpyBackend(CpuExpertExecutor(1)).routed_experts(x, weights, ids, 0, store)  # [T, H]
    cuts = np.linspace(0, len(x), num_ranks + 1).astype(int)
    slices = [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    got = run_ranks(num_ranks, slices, moe_all_to_all, store, x, weights, ids)
    np.testing.assert_array_equal(got, want)
    if num_ranks > 1:  # the last rank holds no tokens, and the rest is the same sum
        slices = [slice(cuts[r], cuts[r + 1] if r < num_ranks - 2 else len(x)) for r in range(num_ranks - 1)]
        slices.append(slice(len(x), len(x)))
        np.testing.assert_array_equal(run_ranks(num_ranks, slices, moe_all_to_all, store, x, weights, ids), want)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_expert_parallel_all_gather_reduce_scatter_equals_the_single_rank_layer(num_ranks):
    store, (x, weights, ids) = RandomExperts(EXPERTS), routing(9, seed=2)
    want = NumpyBackend(CpuExpertExecutor(1)).routed_experts(x, weights, ids, 0, store)
    slices = [slice(0, 5)] + [slice(5 + r, 6 + r) for r in range(num_ranks - 2)]
    slices = ([slice(0, len(x))] if num_ranks == 1 else
              slices + [slice(5 + num_ranks - 2, len(x))])  # consecutive slices; rank 1 of 2 gets the rest
    got = run_ranks(num_ranks, slices, moe_all_gather, store, x, weights, ids)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if num_ranks == 1:
        np.testing.assert_array_equal(got, want)
