"""A whole model with its routed experts sharded over N fake ranks on threads (`ExpertParallelRank`): each rank runs
its own sequences (attention and KV cache its own) and every MoE layer through all-to-all; the logits and greedy
tokens equal one rank running every sequence (the NumPy backend)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.batch import flat_batch
from colibri_stream.experts.expert_parallel import ExpertParallelRank, FakeGroup
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
        model = load_model(model_folder)
        model.expert_parallel = ExpertParallelRank(group.communicator(rank), model.config.num_experts)
        return greedy_run(model, PROMPTS[bounds[rank]:bounds[rank + 1]])

    results = on_ranks(ranks, rank_main, timeout=300)
    assert [t for tokens, _ in results for t in tokens] == reference_tokens
    for step, reference in enumerate(reference_logits):
        ours = np.concatenate([logits[step] for _, logits in results])  # [B, V], ranks in order
        assert ours.shape == reference.shape == (len(PROMPTS), VOCAB_SIZE)
        error = np.abs(ours - reference).max() / np.abs(reference).max()
        assert error < 1e-5, (step, error)
