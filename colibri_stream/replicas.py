"""Data-parallel replicas: N engine processes behind one server (`colibri serve --data-parallel N`).

`ReplicaSet` offers the server the interface of one `AsyncEngine`. Prompts are tokenized once, in this process
(the replicas load the same model and tokenizer, so replica 0's checks serve all); each request then goes to one
replica (`ReplicaRouter`): the least loaded, unless its prompt's first KV block was last sent to a replica whose
load is within `PREFIX_AFFINITY_SLACK` of the least, where its prefix is likely still cached.

Devices: on cuda, replica i sees the i-th visible GPU only (CUDA_VISIBLE_DEVICES in its process), and N may not
exceed the visible GPUs (replicas sharing a GPU would each size their KV cache from the same free memory); on the
CPU the host's cores are split between the replicas (`cpu_threads`).

A replica whose process dies fails its own requests only (its AsyncEngine fails them with EngineStoppedError);
new requests go to the others. The set is healthy while at least one replica is.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .async_engine import AsyncEngine
from .checkpoint import default_model_path
from .config import EngineConfig
from .engine import EngineStats
from .engine_router import ReplicaRouter, replica_environments, summed_stats, visible_gpus
from .errors import ConfigError, InvalidParameterError
from .experts.stats import ExpertStats
from .request import RequestOutput, SamplingParams
from .timing import StepRecord, StepSink

logger = logging.getLogger(__name__)


def load_engine(data_parallel: int = 1, **options: Any) -> AsyncEngine | ReplicaSet:
    """The server's engine: one AsyncEngine (data_parallel=1), else a ReplicaSet of that many. options: those of
    `AsyncEngine.from_pretrained` (expert_parallel among them: one engine over a group of that many ranks, which
    does not compose with replicas yet)."""
    if data_parallel == 1:
        return AsyncEngine.from_pretrained(**options)
    if options.get("expert_parallel", 1) != 1:
        raise ConfigError("--expert-parallel with --data-parallel is not supported yet: use one of them")
    return ReplicaSet.from_pretrained(data_parallel=data_parallel, **options)


class ReplicaSet:
    """N AsyncEngines, each in an engine process of its own, behind the interface of one.

    Build it with `ReplicaSet.from_pretrained(path, data_parallel=N, **options)` (the options of
    `AsyncEngine.from_pretrained`); the replicas load in parallel. `generate` tokenizes here and streams from the
    replica `ReplicaRouter` picks; `abort` reaches the replica running the request. `stats()` sums the replicas'
    snapshots; `replica_stats()` and `replica_health()` are per replica (metrics label them by replica).
    """

    def __init__(self, replicas: list[AsyncEngine], block_size: int):
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.model_name = first.model_name
        self.max_seq_len = min(replica.max_seq_len for replica in replicas)
        self.router = ReplicaRouter(len(replicas), block_size)
        self._owner: dict[str, int] = {}  # request id in flight -> its replica
        self._reported_down: set[int] = set()

    @classmethod
    def from_pretrained(cls, path: str | None = None, data_parallel: int = 2, engine_process: bool = True,
                        **options: Any) -> ReplicaSet:
        """Load `data_parallel` replicas of a model folder (blocking: call it outside a running event loop, as
        `run_server` does), each in an engine process (engine_process=False is
        refused: replicas in one process would share its GIL and device). Raises ConfigError for a bad count or
        more replicas than GPUs, and what loading raised (the replicas that loaded are closed)."""
        if not engine_process:
            raise ConfigError("data-parallel replicas run in engine processes of their own; drop "
                             "--no-engine-process or use --data-parallel 1")
        environments, threads = replica_environments(data_parallel, options.get("device", "auto"),
                                                     options.get("cpu_threads"), visible_gpus())
        if threads is not None:
            options = dict(options, cpu_threads=threads)
        engine_config = EngineConfig.from_options(str(default_model_path() if path is None else path), **options)
        with ThreadPoolExecutor(len(environments), thread_name_prefix="colibri-replica-load") as pool:
            loading = [pool.submit(AsyncEngine.from_pretrained, path, engine_process=True, process_env=env,
                                   **options) for env in environments]
        replicas, errors = [], []
        for future in loading:
            try:
                replicas.append(future.result())
            except BaseException as error:  # noqa: BLE001 - raised below, once the loaded ones are closed
                errors.append(error)
        if errors:
            for replica in replicas:
                asyncio.run(replica.close())
            raise errors[0]
        return cls(replicas, engine_config.cache.block_size)

    @property
    def pids(self) -> list[int]:
        """The engine processes' ids, by replica."""
        return [replica.pid for replica in self.replicas]

    async def start(self) -> None:
        await asyncio.gather(*(replica.start() for replica in self.replicas))

    async def stop(self, drain: bool = True) -> None:
        await asyncio.gather(*(replica.stop(drain) for replica in self.replicas))

    async def close(self) -> None:
        """Close every replica (`AsyncEngine.close`), each whether or not another's close failed."""
        results = await asyncio.gather(*(replica.close() for replica in self.replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> ReplicaSet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def encode(self, prompt: str | list[int] | list[dict], *args: Any, **kwargs: Any) -> list[int]:
        """`AsyncEngine.encode`, here in the server's process."""
        return await self.replicas[0].encode(prompt, *args, **kwargs)

    async def check_grammar(self, grammar: str) -> None:
        await self.replicas[0].check_grammar(grammar)

    async def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams,
                       request_id: str | None = None, add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """`AsyncEngine.generate` on the replica `ReplicaRouter` picks among the healthy ones (all of them where
        none is: the chosen one raises why)."""
        prompt_token_ids = await self.encode(prompt, add_special_tokens)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._owner:
            raise InvalidParameterError(f"request_id {request_id!r} is already in use", param="request_id")
        index = self.router.choose(prompt_token_ids, self._candidates())
        load = self.router.loads[index]
        self._owner[request_id] = index
        load.sequences += params.n
        load.prompt_tokens += len(prompt_token_ids)
        prefilling, finished = True, 0
        try:
            async for out in self.replicas[index].generate(prompt_token_ids, params, request_id):
                if prefilling:
                    prefilling = False
                    load.prompt_tokens -= len(prompt_token_ids)
                finished += out.finished
                load.sequences -= out.finished
                yield out
        finally:
            del self._owner[request_id]
            if prefilling:
                load.prompt_tokens -= len(prompt_token_ids)
            load.sequences -= params.n - finished

    def _candidates(self) -> list[int]:
        healthy = [i for i, replica in enumerate(self.replicas) if replica.healthy]
        for i in set(range(len(self.replicas))) - set(healthy) - self._reported_down:
            logger.warning("replica %d (engine process %d) is unhealthy; requests go to the others", i,
                           self.replicas[i].pid)
        self._reported_down = set(range(len(self.replicas))) - set(healthy)
        return healthy or list(range(len(self.replicas)))

    async def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            await self.replicas[index].abort(request_id)

    @property
    def healthy(self) -> bool:
        """Whether at least one replica is healthy (`replica_health` says which)."""
        return any(self.replica_health())

    def replica_health(self) -> list[bool]:
        return [replica.healthy for replica in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' snapshots summed (the last step's time: the longest)."""
        return summed_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        return [replica.stats() for replica in self.replicas]

    def add_step_sink(self, sink: StepSink) -> None:
        """Hand every replica's StepRecords to `sink`, on the replicas' reader threads one record at a time (a
        sink expects one engine's thread: the step histograms count without a lock)."""
        lock = threading.Lock()

        def one_at_a_time(record: StepRecord) -> None:
            with lock:
                sink(record)

        for replica in self.replicas:
            replica.add_step_sink(one_at_a_time)

    def store_stats(self) -> ExpertStats | None:
        """None: each replica's expert store counts for itself, and those counters are not merged."""
        return None

    @property
    def capacity(self) -> int | None:
        """Sequences all replicas hold at once (None: a queue is unbounded)."""
        capacities = [replica.capacity for replica in self.replicas]
        return None if None in capacities else sum(capacities)

