"""Expert parallelism over processes (`expert_group.py`, `group_core.py`, `experts/pipe_group.py`): the pipes'
collectives equal FakeGroup's and fail at once on a gone or silent peer; a group of two rank processes behind the
real server gives one engine's greedy tokens; a dead rank fails the group's requests instead of hanging; groups
that cannot be are refused with one line each."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import numpy as np
import openai
import pytest
from test_engine_process import wait_until
from test_expert_parallel import EXPERTS, RandomExperts, on_ranks, routing, run_ranks
from test_server import LiveServer

from colibri_stream.async_engine import AsyncEngine
from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.checkpoint import read_config
from colibri_stream.cli import main
from colibri_stream.engine_router import replica_environments
from colibri_stream.errors import ConfigError, EngineStepError, ExpertParallelError
from colibri_stream.expert_group import ExpertParallelProcess, check_expert_parallel
from colibri_stream.experts.cpu_executor import CpuExpertExecutor
from colibri_stream.experts.expert_parallel import ShardMap, moe_all_gather, moe_all_to_all
from colibri_stream.experts.pipe_group import PipeCommunicator, pipe_mesh
from colibri_stream.replicas import load_engine
from colibri_stream.request import SamplingParams
from colibri_stream.server.state import STATE

OPTIONS = dict(device="cpu", max_batch_size=4, max_seq_len=512, num_kv_blocks=64)
PROMPTS = ["the quick brown fox jumps over the lazy dog and then " * 4, "hello world", "a b c d e f g"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def tokens(engine: AsyncEngine, prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    return [t async for out in engine.generate(prompt, params) for t in out.token_ids]


# ---- the pipes' collectives, ranks on threads --------------------------------------------------------------------

@pytest.mark.parametrize("layer_fn", [moe_all_to_all, moe_all_gather])
def test_the_pipes_collectives_give_the_fake_groups_layer(layer_fn):
    """Three ranks (one without tokens) over pipes: the fake group's outputs, bit for bit (the same additions in
    the same order)."""
    store, (x, weights, ids) = RandomExperts(EXPERTS), routing(9)
    slices = [slice(0, 4), slice(4, 4), slice(4, 9)]
    mesh = pipe_mesh(3, multiprocessing.get_context("spawn"))
    shard = ShardMap(EXPERTS, 3)

    def rank_main(rank: int) -> np.ndarray:
        backend, part = NumpyBackend(CpuExpertExecutor(1)), slices[rank]
        return layer_fn(PipeCommunicator(rank, mesh[rank], timeout=30), x[part], weights[part], ids[part], shard,
                        lambda rows, e: backend.experts.run(rows, store.expert(0, e)))

    ours = np.concatenate(on_ranks(3, rank_main))
    assert np.array_equal(ours, run_ranks(3, slices, layer_fn, store, x, weights, ids))


def test_a_gone_or_silent_peer_fails_the_collective_at_once():
    spawn = multiprocessing.get_context("spawn")
    mesh = pipe_mesh(3, spawn)
    PipeCommunicator(1, mesh[1]).abort("left")  # rank 1 leaves: its pipes close, as a dead process's do
    start = time.monotonic()
    with pytest.raises(ExpertParallelError, match="rank 1 is gone"):
        PipeCommunicator(0, mesh[0], timeout=60).all_gather(np.zeros(2, np.float32))
    assert time.monotonic() - start < 5  # at once, whatever the timeout
    pair = pipe_mesh(2, spawn)  # rank 1's end held open here, and never written
    silent = PipeCommunicator(0, pair[0], timeout=0.3)
    with pytest.raises(ExpertParallelError, match="rank 1 sent nothing for 0.3 s"):
        silent.all_gather(np.zeros(2, np.float32))
    with pytest.raises(ExpertParallelError, match="failed earlier: rank 1 sent nothing"):  # and stays failed
        silent.broadcast("plan")


# ---- a group of two rank processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def group_server(tiny_model_dir):
    """The tiny model (8 experts) over two rank processes behind a live server."""
    live = LiveServer(tiny_model_dir, dict(OPTIONS, expert_parallel=2))
    yield live
    live.close()


def test_two_ranks_give_one_engines_greedy_tokens(group_server, tiny_model_dir):
    async def one_engine() -> list[list[int]]:
        async with AsyncEngine.from_pretrained(str(tiny_model_dir), **OPTIONS) as engine:
            return [await tokens(engine, prompt) for prompt in PROMPTS]

    async def through_the_group() -> list[list[int]]:
        engine = group_server.app[STATE].engine
        return list(await asyncio.gather(*(tokens(engine, prompt) for prompt in PROMPTS)))

    expected = asyncio.run(one_engine())
    assert group_server.call(through_the_group(), timeout=120) == expected
    stats = group_server.app[STATE].engine.stats()
    assert stats.kv_blocks_total == 2 * OPTIONS["num_kv_blocks"]  # each rank its own cache
    assert stats.num_generated_tokens >= len(PROMPTS) * GREEDY.max_tokens


def test_a_completion_through_the_server(group_server):
    client = openai.OpenAI(base_url=group_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    replies = [client.completions.create(model=group_server.model_dir.name, prompt=prompt, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True}) for prompt in PROMPTS[1:]]
    assert [reply.usage.completion_tokens for reply in replies] == [6, 6]
    assert all(reply.choices[0].text for reply in replies)


def test_a_dead_rank_fails_the_groups_requests(tiny_model_dir):
    engine = AsyncEngine.from_pretrained(str(tiny_model_dir), engine_process=True, expert_parallel=2, **OPTIONS)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[list[BaseException], BaseException]:
        await engine.start()
        streams = [asyncio.ensure_future(tokens(engine, prompt, long)) for prompt in PROMPTS[1:]]
        assert await asyncio.to_thread(wait_until, lambda: engine.stats().num_generated_tokens > 4)
        os.kill(engine._transport.pids[1], signal.SIGKILL)
        failures = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 60)
        with pytest.raises(ExpertParallelError) as later:  # the group does not serve again
            await tokens(engine, PROMPTS[2])
        await asyncio.wait_for(engine.close(), 60)
        return failures, later.value

    failures, later = asyncio.run(scenario())
    assert all(isinstance(failure, EngineStepError) for failure in failures), failures
    assert all("rank 1" in str(failure) and "is gone" in str(failure) for failure in failures), failures
    assert "the expert-parallel group failed" in str(later)


# ---- refused ----------------------------------------------------------------------------------------------------

def test_groups_that_cannot_be_are_refused(tiny_model_dir):
    config = read_config(str(tiny_model_dir))
    with pytest.raises(ConfigError, match="--expert-parallel 9 exceeds the model's 8 routed experts"):
        ExpertParallelProcess(str(tiny_model_dir), dict(OPTIONS), 9)
    dense = type(config)(**{**vars(config), "moe_layers": (), "intermediate_size": 64})
    with pytest.raises(ConfigError, match="needs a model with routed experts"):
        check_expert_parallel(2, dense, {})
    with pytest.raises(ConfigError, match="with --l2-cache-size is not supported"):
        check_expert_parallel(2, config, {"l2_cache_size": 1 << 30})
    with pytest.raises(ConfigError, match="--expert-parallel 3 needs 3 GPUs, one per rank; 2 are visible"):
        replica_environments(3, "cuda", None, ["0", "1"], option="expert_parallel", unit="rank")
    with pytest.raises(ConfigError, match="expert_parallel must be a whole number of at least 1"):
        ExpertParallelProcess(str(tiny_model_dir), dict(OPTIONS), 0)
    with pytest.raises(ConfigError, match="with --data-parallel is not supported"):
        load_engine(data_parallel=2, expert_parallel=2, path=str(tiny_model_dir), **OPTIONS)
    with pytest.raises(ConfigError, match="drop --no-engine-process"):
        AsyncEngine.from_pretrained(str(tiny_model_dir), expert_parallel=2, **OPTIONS)


def test_the_cli_refuses_zero_ranks(capsys):
    assert main(["serve", "--expert-parallel", "0", "--device", "cpu"]) == 1
    assert "expert_parallel must be a whole number of at least 1" in capsys.readouterr().err
