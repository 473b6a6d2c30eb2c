"""A whole model with its routed experts sharded over N fake ranks on threads (`ExpertParallelRank`): each rank runs
its own sequences (attention and KV cache its own) and every MoE layer through all-to-all; the logits and greedy
tokens equal one rank running every sequence (the NumPy backend)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.batch import flat_batch
from colibri_stream.experts.expert_parallel import FakeGroup
from colibri_stream.export import export_model
from colibri_stream.group_core import empty_batch
from colibri_stream.loader import load_model
from test_expert_parallel import on_ranks
from tiny_models import VOCAB_SIZE, build_hf_model

BLOCK_SIZE, BLOCKS_PER_SEQ, DECODE_STEPS = 4, 8, 4
PROMPTS = [[5, 9, 33, 7, 12], [40, 41], [7, 7, 7, 100, 3, 2, 60, 61, 62], [200, 17, 5]]


@pytest.fixture(scope="module", params=["deepseek_v3", "mixtral"])
def model_folder(request, tmp_path_factory):
    """A tiny exported model: DeepSeek-V3's (latent attention, groups, a shared expert, a dense first layer) and
    Mixtral's."""
    folder = tmp_path_factory.mktemp(request.param)
    build_hf_model(request.param, folder / "hf")
    export_model(folder / "hf", folder / "model", dtype="fp32", progress=False)
    return folder / "model"


def greedy_run(model, prompts: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill `prompts` in one step, then DECODE_STEPS greedy steps of all of them: (each sequence's new tokens,
    each step's logits [B, V])."""
    kv = model.allocate_kv_cache(max(len(prompts), 1) * BLOCKS_PER_SEQ, BLOCK_SIZE, "fp32")
    tables = [list(range(b * BLOCKS_PER_SEQ, (b + 1) * BLOCKS_PER_SEQ)) for b in range(len(prompts))]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits_per_step = []
    for step in range(DECODE_STEPS + 1):
        if not prompts:
            batch = empty_batch(sliding=False)  # a rank without tokens still runs every collective
        elif step == 0:
            batch = flat_batch(prompts, [0] * len(prompts), tables, [True] * len(prompts), BLOCK_SIZE)
        else:
            batch = flat_batch([[t[-1]] for t in tokens], [len(p) + step - 1 for p in prompts], tables,
                               [True] * len(prompts), BLOCK_SIZE)
        logits = model.forward(batch, kv)  # [B, V]
        logits_per_step.append(logits)
        for b, row in enumerate(logits):
            tokens[b].append(int(np.argmax(row)))
    return tokens, logits_per_step


@pytest.mark.parametrize("ranks,split", [(2, [2, 2]), (3, [1, 2, 1]), (3, [3, 1, 0])])
def test_sharded_experts_give_one_ranks_tokens_and_logits(model_folder, ranks, split):
    """Ranks hold consecutive sequences (the last one none in one case); experts sharded by id over them (8
    experts over 3 ranks: 3, 3 and 2)."""
    reference_tokens, reference_logits = greedy_run(load_model(model_folder), PROMPTS)
    group = FakeGroup(ranks)
    bounds = np.cumsum([0, *split])

    def rank_main(rank: int):
        model = load_model(model_folder, expert_group=group.communicator(rank))
        return greedy_run(model, PROMPTS[bounds[rank]:bounds[rank + 1]])

    results = on_ranks(ranks, rank_main, timeout=300)
    assert [t for tokens, _ in results for t in tokens] == reference_tokens
    for step, reference in enumerate(reference_logits):
        ours = np.concatenate([logits[step] for _, logits in results])  # [B, V], ranks in order
        assert ours.shape == reference.shape == (len(PROMPTS), VOCAB_SIZE)
        error = np.abs(ours - reference).max() / np.abs(reference).max()
        assert error < 1e-5, (step, error)


def test_a_ranks_store_holds_its_shard_only(model_folder):
    """Two ranks of 8 experts: each store holds its 4 experts of every MoE layer, numbered 0-3, refuses any other
    number, and after the group's steps holds the widened experts its tokens' routing used there: together the
    single engine's, each rank at most half of every expert's bytes."""
    reference = load_model(model_folder)
    greedy_run(reference, PROMPTS)
    group = FakeGroup(2)

    def rank_main(rank: int):
        model = load_model(model_folder, expert_group=group.communicator(rank))
        greedy_run(model, PROMPTS[2 * rank:2 * rank + 2])
        return model

    ranks = on_ranks(2, rank_main, timeout=300)
    layer, layers = reference.config.moe_layers[0], len(reference.config.moe_layers)
    one_expert = sum(a.nbytes for a in reference.store.expert(layer, 0).values())  # widened to float32
    held = set()  # (layer, the model's expert id) held by some rank
    for rank, model in enumerate(ranks):
        shard = model.expert_parallel.experts
        assert shard == range(4 * rank, 4 * rank + 4)
        cached = model.store._cache  # (layer, number in the shard) -> widened tensors, filled on first use
        assert all(0 <= number < 4 for _, number in cached)
        assert sum(a.nbytes for tensors in cached.values() for a in tensors.values()) <= 4 * layers * one_expert
        held |= {(moe_layer, shard[number]) for moe_layer, number in cached}
        assert np.array_equal(model.store.expert(layer, 1)["down"], reference.store.expert(layer, shard[1])["down"])
    assert held == set(reference.store._cache)  # the same routing: the same experts used, each on its rank
    assert len(held) > 4 * layers  # more than one shard's: no rank could hold them all
    with pytest.raises(ValueError, match="expert 4 of layer .* outside this store's shard: it holds the model's "
                                         "experts 4-7, numbered 0-3"):
        ranks[1].store.expert(layer, 4)
