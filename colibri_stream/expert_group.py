"""Expert parallelism's processes on one host (`colibri serve --expert-parallel N`, docs/MULTI_GPU.md).

`ExpertParallelProcess` is the engine process of an `AsyncEngine` whose model's routed experts are sharded over N
ranks: rank 0 is the engine process itself, its step loop driving a `GroupCore` (group_core.py); ranks 1 .. N-1
are worker processes that answer rank 0's plans. All N are spawned by the server's process, which hands each its
pipes:
- control: a duplex pipe between rank 0 and each other rank (plans down, replies up; at start, the NCCL id down
  and the rank's RankReady, or its load error, up);
- data: on the CPU a pipe per pair of ranks (`PipeCommunicator`); on GPUs NCCL (`NcclCommunicator`), one GPU per
  rank (CUDA_VISIBLE_DEVICES as for data-parallel replicas), the id made by rank 0.

Lifetime: rank 0 fails to load when any rank does (with that rank's error); the workers leave when their control
pipe ends (rank 0 closed or died) and `close` joins them. A worker that dies fails the group (group_core.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .checkpoint import default_model_path, read_config
from .config import ModelConfig
from .engine import EngineCore
from .engine_process import CLOSE_TIMEOUT_SECONDS, EngineProcess, LoadFailed
from .engine_router import on_gpus, replica_environments, visible_gpus
from .errors import ConfigError, ExpertParallelError
from .experts.expert_parallel import Communicator
from .experts.pipe_group import COLLECTIVE_TIMEOUT_SECONDS, PipeCommunicator, pipe_mesh
from .group_core import GroupCore, RankReady, answer_plan, rank_options

logger = logging.getLogger(__name__)

EXPERT_OFFLOAD_OPTIONS = ("gpu_memory_limit", "l2_cache_size")  # budgets of a tiered expert store


def check_expert_parallel(ranks: int, config: ModelConfig, options: dict[str, Any]) -> None:
    """Raise ConfigError where `ranks` cannot shard this model's experts with these engine options."""
    if not config.moe_layers:
        raise ConfigError("--expert-parallel needs a model with routed experts; this one has none")
    if ranks > config.num_experts:
        raise ConfigError(f"--expert-parallel {ranks} exceeds the model's {config.num_experts} routed experts: "
                          f"every rank needs at least one")
    offload = [name for name in EXPERT_OFFLOAD_OPTIONS if options.get(name) is not None]
    if offload:
        flags = " and ".join("--" + name.replace("_", "-") for name in offload)
        raise ConfigError(f"--expert-parallel with {flags} is not supported: each rank keeps its shard of the "
                          f"experts resident")


@dataclass
class _Links:
    """One rank's pipes: to rank 0 (`control`, rank 0: to every other rank by rank), to every peer (`peers`, on
    the CPU; None over NCCL)."""

    rank: int
    size: int
    control: Connection | dict[int, Connection]
    peers: dict[int, Connection] | None
    timeout: float


class ExpertParallelProcess(EngineProcess):
    """An engine process running rank 0 of an expert-parallel group of `ranks`, and a worker process for each
    other rank. path and options: those of `EngineCore.from_pretrained` (every rank loads the same folder);
    env: environment variables of every rank's process; timeout: seconds a rank waits for a peer in a collective.
    Raises ConfigError for a group that cannot be (see `check_expert_parallel`, and one GPU per rank on cuda)."""

    def __init__(self, path: str | None, options: dict[str, Any], ranks: int, env: dict[str, str] | None = None,
                 timeout: float = COLLECTIVE_TIMEOUT_SECONDS):
        device, gpus = options.get("device", "auto"), visible_gpus()
        environments, threads = replica_environments(ranks, device, options.get("cpu_threads"), gpus,
                                                     option="expert_parallel", unit="rank")
        check_expert_parallel(ranks, read_config(str(default_model_path() if path is None else path)), options)
        if threads is not None:
            options = dict(options, cpu_threads=threads)
        context = multiprocessing.get_context("spawn")
        controls = {rank: context.Pipe(duplex=True) for rank in range(1, ranks)}  # rank 0's end, the rank's end
        mesh = None if on_gpus(device, gpus) else pipe_mesh(ranks, context)
        links = [_Links(rank, ranks, controls[rank][1] if rank else {r: ends[0] for r, ends in controls.items()},
                        None if mesh is None else mesh[rank], timeout) for rank in range(ranks)]
        log_level = logging.getLogger().getEffectiveLevel()
        self._workers = [context.Process(target=_worker_main, name=f"colibri-rank-{rank}",
                                         args=(path, options, {**(env or {}), **environments[rank]}, links[rank],
                                               log_level), daemon=True)
                         for rank in range(1, ranks)]
        for worker in self._workers:
            worker.start()
        for link in links[1:]:  # theirs now: the parent keeps no copy, so a rank's death is end of file
            for end in (link.control, *(link.peers or {}).values()):
                end.close()
        try:
            super().__init__(path, options, {**(env or {}), **environments[0]},
                             load=functools.partial(_load_rank_zero, links=links[0]),
                             handed=(*links[0].control.values(), *(links[0].peers or {}).values()))
        except BaseException:
            self._join_workers()
            raise

    @property
    def pids(self) -> list[int]:
        """The processes' ids, by rank."""
        return [self.pid, *(worker.pid for worker in self._workers)]

    def close(self) -> None:
        """Close rank 0 (its engine, then its control pipes: the workers close theirs and exit) and join all."""
        try:
            super().close()
        finally:
            self._join_workers()

    def _join_workers(self) -> None:
        for worker in self._workers:
            worker.join(CLOSE_TIMEOUT_SECONDS)
            if worker.is_alive():
                logger.warning("expert-parallel rank process %d did not exit in %g s; killing it", worker.pid,
                               CLOSE_TIMEOUT_SECONDS)
                worker.kill()
                worker.join()


def _communicator(links: _Links) -> Communicator:
    """The rank's data communicator: its pipes to its peers, or NCCL with rank 0's id (sent over the control
    pipes)."""
    if links.peers is not None:
        return PipeCommunicator(links.rank, links.peers, links.timeout)
    from .experts.nccl_group import NcclCommunicator, nccl_unique_id

    if links.rank == 0:
        unique_id = nccl_unique_id()
        for connection in links.control.values():
            connection.send(unique_id)
    else:
        unique_id = links.control.recv()
    return NcclCommunicator(links.rank, links.size, unique_id, links.timeout)


def _load_rank(path: str | None, options: dict[str, Any], comm: Communicator) -> EngineCore:
    """A rank's engine: the model loaded (eager steps) with its routed experts sharded over the group, its store
    holding the rank's shard only."""
    return EngineCore.from_pretrained(path, expert_group=comm, **rank_options(options))


def _load_rank_zero(path: str | None, *, links: _Links, **options: Any) -> GroupCore:
    """Rank 0's engine (in its engine process): loaded once every other rank has loaded its own."""
    comm = _communicator(links)
    core = _load_rank(path, options, comm)
    readies: dict[int, RankReady] = {}
    try:
        for rank, connection in links.control.items():
            try:
                message = connection.recv()
            except (EOFError, OSError):
                raise ExpertParallelError(f"expert-parallel rank {rank} ended while loading the model") from None
            if isinstance(message, LoadFailed):
                raise message.error
            readies[rank] = message
    except BaseException:
        core.close()
        raise
    return GroupCore(core, comm, links.control, readies, links.timeout)


def _worker_main(path: str | None, options: dict[str, Any], env: dict[str, str], links: _Links,
                 log_level: int) -> None:
    """A rank other than 0: load, report ready, then answer rank 0's plans until its control pipe ends."""
    os.environ.update(env)  # before the model loads: CUDA_VISIBLE_DEVICES, the thread counts
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the engine process: the server's process ends the group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    control = links.control
    try:
        comm = _communicator(links)
        core = _load_rank(path, options, comm)
    except BaseException as error:  # noqa: BLE001 - rank 0 raises it as the group's load error
        with contextlib.suppress(OSError):
            control.send(LoadFailed(error))
        return
    try:
        control.send(RankReady(os.getpid(), core.max_seq_len, core.stats()))
        while True:
            control.send(answer_plan(core, comm, control.recv()))
    except (EOFError, OSError):
        pass  # rank 0 closed the group, or is gone
    finally:
        core.close()
