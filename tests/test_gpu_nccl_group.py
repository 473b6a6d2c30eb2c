"""`NcclCommunicator` (experts/nccl_group.py) on CUDA GPUs: a one-rank group on one GPU returns what it was given;
two ranks on two GPUs give FakeGroup's collectives (all-to-all bit for bit, reduce-scatter to rounding), with
NumPy and CuPy arrays alike; the MoE layer through two NCCL ranks gives the fake group's output; a rank's device
store holds its shard of the experts only; and a group of two expert-parallel rank processes gives one engine's
greedy tokens."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.experts.nccl_group import NcclCommunicator, nccl_unique_id  # noqa: E402

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(cupy.cuda.runtime.getDeviceCount() < 2, reason="needs 2 CUDA GPUs")


def test_a_one_rank_group_returns_what_it_was_given():
    comm = NcclCommunicator(0, 1, nccl_unique_id(), timeout=60)
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.array_equal(comm.all_to_all([rows])[0], rows)
    assert np.array_equal(comm.all_to_all([np.zeros((0, 3), np.float32)])[0], np.zeros((0, 3), np.float32))
    indices = cupy.arange(10, dtype=cupy.int64).reshape(2, 5)
    assert cupy.array_equal(comm.all_to_all([indices])[0], indices)
    assert np.array_equal(comm.all_gather(rows)[0], rows)
    assert np.array_equal(comm.reduce_scatter([rows]), rows)
    plan = {"step": 3, "adds": ["a", "b"]}
    assert comm.broadcast(plan) == plan


def _collectives(rank: int, unique_id: tuple, results) -> None:
    """Rank `rank` of two on GPU `rank`: every collective on NumPy arrays (and the all-to-all on CuPy's)."""
    cupy.cuda.Device(rank).use()
    comm = NcclCommunicator(rank, 2, unique_id, timeout=60)
    rng = np.random.default_rng(rank)
    sends = [rng.standard_normal((rank + d + 1, 5)).astype(np.float32) for d in range(2)]  # each its own rows
    part = rng.standard_normal((3 + rank, 5)).astype(np.float32)
    parts = [rng.standard_normal((2 + d, 5)).astype(np.float32) for d in range(2)]
    device = [cupy.asnumpy(a) for a in comm.all_to_all([cupy.asarray(s) for s in sends])]
    results.put((rank, sends, part, parts, comm.all_to_all(sends), device, comm.all_gather(part),
                 comm.reduce_scatter(parts), comm.broadcast({"plan": rank} if rank == 0 else None)))


@needs_two_gpus
def test_two_ranks_give_the_fake_groups_collectives():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    unique_id = nccl_unique_id()
    ranks = [context.Process(target=_collectives, args=(rank, unique_id, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=120) for _ in range(2)))
    for process in ranks:
        process.join(60)
    for rank in range(2):
        _, _, _, to_all, on_device, gathered, scattered, plan = got[rank]
        expected = [got[source][0][rank] for source in range(2)]  # what each rank sent to this one
        assert all(np.array_equal(a, b) for a, b in zip(to_all, expected))
        assert all(np.array_equal(a, b) for a, b in zip(on_device, expected))
        assert all(np.array_equal(a, got[r][1]) for r, a in enumerate(gathered))
        assert np.allclose(scattered, got[0][2][rank] + got[1][2][rank], atol=1e-6)
        assert plan == {"plan": 0}


def test_a_ranks_device_store_holds_its_shard_only(tiny_model_dir):
    """Rank 1 of two (loading runs no collective, so one GPU does): its device store stacks experts 4-7 of the 8,
    numbered 0-3."""
    from colibri_stream.experts.expert_parallel import FakeGroup
    from colibri_stream.loader import load_model

    whole = load_model(str(tiny_model_dir), device="cuda").store.device_experts()
    shard = load_model(str(tiny_model_dir), device="cuda",
                       expert_group=FakeGroup(2).communicator(1)).store.device_experts()
    assert (whole.num_experts, shard.num_experts) == (8, 4)
    for layer, experts in shard.layers.items():
        everyone = whole.layers[layer].named()
        for name, array in experts.named().items():
            assert array.shape[0] == 4 and cupy.array_equal(array, everyone[name][4:]), (layer, name)


@needs_two_gpus
def test_two_rank_processes_give_one_engines_greedy_tokens(tiny_model_dir):
    from colibri_stream.async_engine import AsyncEngine
    from colibri_stream.request import SamplingParams

    options = dict(device="cuda", max_batch_size=4, max_seq_len=512)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["the quick brown fox jumps over the lazy dog and then " * 4, "hello world", "a b c d e f g"]

    async def tokens(engine, prompt: str) -> list[int]:
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def run(**group) -> list[list[int]]:
        async with AsyncEngine.from_pretrained(str(tiny_model_dir), cuda_graphs=False, **group,
                                               **options) as engine:
            outputs = await asyncio.gather(*(tokens(engine, prompt) for prompt in prompts))
        await engine.close()
        return list(outputs)

    os.environ.setdefault("NCCL_DEBUG", "WARN")
    assert asyncio.run(run(engine_process=True, expert_parallel=2)) == asyncio.run(run())
