"""Data-parallel replicas (`replicas.py`): N engine processes behind one server give one engine's greedy tokens,
share concurrent requests, send a resent prompt back to the replica that cached its prefix, survive the death of
one replica (its requests fail, the others serve), and refuse a bad count of replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import openai
import pytest
from test_engine_process import wait_until
from test_server import LiveServer, request

from colibri_stream.async_engine import AsyncEngine
from colibri_stream.errors import ConfigError
from colibri_stream.replicas import ReplicaSet, load_engine
from colibri_stream.engine_router import (PREFIX_AFFINITY_SLACK, PROMPT_TOKENS_PER_SEQUENCE, ReplicaRouter,
                                    replica_environments)
from colibri_stream.request import SamplingParams
from colibri_stream.server.app import create_app
from colibri_stream.server.serving import serve
from colibri_stream.server.state import STATE

OPTIONS = dict(device="cpu", max_batch_size=4, max_seq_len=512)
PROMPT = "the quick brown fox jumps over the lazy dog and then " * 4  # over one KV block of tokens
FRESH_PROMPT = "a prefix no other test sends, long enough to fill a whole block of the cache " * 3


class ReplicaServer(LiveServer):
    """A real server on loopback over a ReplicaSet of `replicas` engine processes."""

    def __init__(self, model_dir: Path, replicas: int):
        # loaded before the event loop runs, as run_server loads it (loading blocks)
        self._engine = load_engine(data_parallel=replicas, path=str(model_dir), engine_process=True, **OPTIONS)
        super().__init__(model_dir, OPTIONS)

    def _start(self, model_dir: Path, engine_options: dict, app_options: dict, serve_options: dict):
        return self._serve(self._engine)

    @staticmethod
    async def _serve(engine: ReplicaSet) -> tuple:
        app = create_app(engine)
        return (app, *await serve(app, "127.0.0.1", 0))

    @property
    def engine(self) -> ReplicaSet:
        return self.app[STATE].engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def generated(self) -> list[int]:
        return [stats.num_generated_tokens for stats in self.engine.replica_stats()]

    def cache_hits(self) -> list[int]:
        return [stats.prefix_cache_hit_tokens for stats in self.engine.replica_stats()]


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    server = ReplicaServer(tiny_model_dir, 2)
    yield server
    server.close()


def complete(server: ReplicaServer, prompt: str, max_tokens: int) -> openai.types.Completion:
    return server.client().completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body={"ignore_eos": True})


# ---- routing, without engines ---------------------------------------------------------------------------------

def test_the_least_loaded_replica_gets_a_new_prompt():
    router = ReplicaRouter(3, block_size=4)
    router.loads[0].sequences = 2
    router.loads[1].prompt_tokens = PROMPT_TOKENS_PER_SEQUENCE  # as much as one sequence
    assert router.choose([1, 2, 3, 4, 5], [0, 1, 2]) == 2
    assert router.choose([1, 2], [0, 1]) == 1  # replica 2 is not a candidate (unhealthy)


def test_a_prefix_goes_back_to_its_replica_within_the_slack_only():
    router = ReplicaRouter(2, block_size=4)
    router.loads[0].sequences = 1
    assert router.choose([7, 7, 7, 7, 1], [0, 1]) == 1
    router.loads[0].sequences = 0
    router.loads[1].sequences = int(PREFIX_AFFINITY_SLACK)  # at the bound: still back to replica 1
    assert router.choose([7, 7, 7, 7, 2, 3], [0, 1]) == 1
    router.loads[1].sequences += 1  # past it: the least loaded, which now holds the prefix
    assert router.choose([7, 7, 7, 7], [0, 1]) == 0
    assert router.choose([7, 7, 7, 7], [0, 1]) == 0
    router.loads[0].sequences = router.loads[1].sequences + 1
    assert router.choose([7, 7, 7], [0, 1]) == 1  # shorter than a block: no prefix key, by load alone


def test_a_bad_count_of_replicas_is_refused():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="at least 1"):
            replica_environments(bad, "cpu", None, [])
    with pytest.raises(ConfigError, match="needs 3 GPUs, one per replica; 2 are visible"):
        replica_environments(3, "cuda", None, ["0", "1"])
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        replica_environments(2, "auto", None, ["GPU-abc"])
    with pytest.raises(ConfigError, match="engine processes"):
        ReplicaSet.from_pretrained(None, data_parallel=2, engine_process=False)
    with pytest.raises(ConfigError, match="max_batch_size"):  # the options are checked before any replica loads
        ReplicaSet.from_pretrained(None, data_parallel=2, device="cpu", max_batch_size=0)


def test_each_replica_sees_one_gpu_or_a_share_of_the_cores():
    envs, threads = replica_environments(2, "cuda", None, ["3", "5", "7"])
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3", "5"]
    envs, threads = replica_environments(2, "auto", None, [])
    assert threads == max(1, os.cpu_count() // 2)
    assert all(env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == str(threads) for env in envs)
    assert replica_environments(2, "cpu", 3, ["0", "1"])[1] == 3


def test_the_cli_refuses_zero_replicas(capsys):
    from colibri_stream.cli import main

    assert main(["serve", "--data-parallel", "0", "--device", "cpu"]) == 1
    assert "data_parallel must be a whole number of at least 1" in capsys.readouterr().err


# ---- replicas behind a live server ----------------------------------------------------------------------------

def test_greedy_tokens_through_two_replicas_equal_one_engines(pair, tiny_model_dir):
    prompts = [PROMPT, "hello world", "a b c d e f g"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def tokens(engine, prompt: str) -> list[int]:
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def one_engine() -> list[list[int]]:
        async with AsyncEngine.from_pretrained(str(tiny_model_dir), **OPTIONS) as engine:
            return [await tokens(engine, prompt) for prompt in prompts]

    async def through_replicas() -> list[list[int]]:
        return list(await asyncio.gather(*(tokens(pair.engine, prompt) for prompt in prompts)))

    expected = asyncio.run(one_engine())
    before = pair.generated()
    assert pair.call(through_replicas(), timeout=120) == expected
    assert all(after > b for after, b in zip(pair.generated(), before))  # both replicas ran some of them


def test_concurrent_requests_land_on_both_replicas(pair):
    before = pair.generated()
    replies: list = []
    threads = [threading.Thread(target=lambda p=p: replies.append(complete(pair, p, 200)))
               for p in ("one two three", "four five six")]
    threads[0].start()
    assert wait_until(lambda: pair.engine.router.loads[0].sequences == 1)  # the first one runs on replica 0
    threads[1].start()
    for thread in threads:
        thread.join()
    assert [reply.usage.completion_tokens for reply in replies] == [200, 200]
    assert [after - b for after, b in zip(pair.generated(), before)] == [200, 200]
    assert pair.engine.stats().num_generated_tokens == sum(pair.generated())  # the server's figure sums them


def test_a_resent_prompt_goes_back_to_the_replica_that_cached_its_prefix(pair):
    busy = threading.Thread(target=complete, args=(pair, "keep replica zero busy", 200))
    busy.start()
    assert wait_until(lambda: pair.engine.router.loads[0].sequences == 1)
    before = pair.generated()
    complete(pair, FRESH_PROMPT + "first", 2)  # replica 0 is busy: the least loaded, replica 1, caches the prefix
    assert pair.generated()[1] - before[1] == 2
    busy.join()
    hits = pair.cache_hits()
    complete(pair, FRESH_PROMPT + "again", 2)  # both idle: the least loaded would be replica 0, the prefix says 1
    after = pair.cache_hits()
    assert after[0] == hits[0] and after[1] > hits[1]


def test_a_dead_replica_fails_its_own_requests_only(tiny_model_dir):
    server = ReplicaServer(tiny_model_dir, 2)
    try:
        failed: list[BaseException] = []

        def long_stream() -> None:
            try:
                complete(server, "this stream dies with its replica", 400)
            except openai.APIError as error:
                failed.append(error)

        doomed = threading.Thread(target=long_stream)
        doomed.start()
        assert wait_until(lambda: server.engine.router.loads[0].sequences == 1 and server.generated()[0] > 0)
        os.kill(server.engine.pids[0], signal.SIGKILL)
        doomed.join(60)
        assert len(failed) == 1
        assert wait_until(lambda: server.engine.replica_health() == [False, True])
        for prompt in ("still serving", "and again"):  # both go to the live replica
            assert complete(server, prompt, 4).usage.completion_tokens == 4
        status, _, body = request(server, "GET", "/health", key=None)
        assert status == 200 and b'"ok"' in body
        _, _, metrics = request(server, "GET", "/metrics", key=None)
        assert b'colibri_replica_healthy{replica="0"} 0.0' in metrics
        assert b'colibri_replica_healthy{replica="1"} 1.0' in metrics
        assert b'colibri_num_requests_running{replica="1"}' in metrics
    finally:
        server.close()
