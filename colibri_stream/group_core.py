"""One step of an expert-parallel group (docs/MULTI_GPU.md): rank 0's `GroupCore` and what every rank runs.

Every rank is an `EngineCore` of its own (scheduler, KV cache, runner, sampler, detokenizer) over the rank's
sequences, whose model sends every MoE layer through the group (`ExpertParallelRank`). Rank 0 admits: a new request
goes to the rank `ReplicaRouter` picks (the fewest sequences and prompt tokens in flight, or the rank that cached
its first block) and stays there. Rank 0 also paces the group: each step it sends every other rank a `RankPlan`
(over the control pipes), every rank runs one step of its own sequences (one forward pass: with no sequences, a
forward of no tokens, which still enters every collective), and each rank's outputs (detokenized there) come
back in its `RankReply`.

`GroupCore` has the face of an `EngineCore` that `engine_loop.run_step_loop` drives, so rank 0's engine process
runs the unchanged step loop. A rank whose step fails as a whole (its process died, a collective timed out, its
forward raised) fails the group: the step's requests fail with ExpertParallelError naming the rank, and so does
every later step and request (the group is not rebuilt).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import ForwardBatch
from .engine import EngineCore, EngineStats
from .engine_loop import AddRequest, portable_error
from .engine_router import ReplicaRouter, summed_stats
from .errors import ColibriError, ExpertParallelError, RequestsFailedError, describe
from .experts.expert_parallel import Communicator
from .experts.stats import ExpertStats
from .request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from .config import EngineConfig, ModelConfig


@dataclass
class RankReady:
    """A rank's engine loaded: what rank 0 needs of it."""

    pid: int
    max_seq_len: int
    stats: EngineStats


@dataclass
class RankPlan:
    """What rank 0 asks of another rank: requests to add, requests to abort, and whether to run one step."""

    adds: list[AddRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    step: bool = False


@dataclass
class RankReply:
    """A rank's answer to a RankPlan: the outputs (of its step and its aborts), the requests that failed alone
    (refused or failed in the step), a whole-step failure, and its engine's state after it."""

    outputs: list[RequestOutput]
    failed: dict[str, BaseException]
    error: BaseException | None
    unfinished: bool
    stats: EngineStats

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["failed"] = {request_id: portable_error(e) for request_id, e in self.failed.items()}
        state["error"] = None if self.error is None else portable_error(self.error)
        return state


def empty_batch(sliding: bool) -> ForwardBatch:
    """A step of no sequences (sliding: with the sliding-window pool's tables): a rank without tokens still runs
    every layer, and so every collective of the group's step."""
    none = np.zeros(0, np.int64)  # [0]
    tables = np.zeros((0, 1), np.int64)  # [0, 1]
    return ForwardBatch(token_ids=none, positions=none, query_start=np.zeros(1, np.int64), context_lens=none,
                        block_tables=tables, slot_mapping=none, logits_indices=none,
                        sliding_block_tables=tables if sliding else None,
                        sliding_slot_mapping=none if sliding else None)


def step_rank(core: EngineCore, comm: Communicator) -> tuple[list[RequestOutput], dict[str, BaseException]]:
    """One step of this rank's sequences, or a forward of no tokens where it has none: (outputs, requests that
    failed alone). A failure of the step as a whole aborts the communicator first (the peers' collectives then
    fail at once instead of waiting for this rank) and is raised."""
    try:
        if core.has_unfinished():
            return core.step(), {}
        timer, runner = core.timer, core.runner
        enabled, timer.enabled = timer.enabled, False  # not a step of this rank's: no step record
        try:
            runner.model.forward(empty_batch(core.kv.sliding is not None), runner.kv_cache)
        finally:
            timer.enabled = enabled
        return [], {}
    except RequestsFailedError as failed:  # after the forward: the collectives are all done
        return failed.outputs, dict(failed.errors)
    except Exception as error:
        comm.abort(f"rank {comm.rank}'s step failed: {describe(error)}")
        raise


def answer_plan(core: EngineCore, comm: Communicator, plan: RankPlan) -> RankReply:
    """Carry out a RankPlan on a rank other than 0."""
    outputs: list[RequestOutput] = []
    failed: dict[str, BaseException] = {}
    error = None
    for add in plan.adds:
        try:
            core.add_request(add.request_id, add.prompt_token_ids, add.params, add.arrival_time, validated=True)
        except (ColibriError, ValueError) as refused:
            failed[add.request_id] = refused
    for request_id in plan.aborts:
        outputs += core.abort(request_id)
    if plan.step:
        try:
            stepped, step_failed = step_rank(core, comm)
            outputs += stepped
            failed.update(step_failed)
        except Exception as step_error:  # noqa: BLE001 - rank 0 fails the group with it
            error = step_error
    return RankReply(outputs, failed, error, core.has_unfinished(), core.stats())


@dataclass
class _Placed:
    """A request admitted to a rank, and its sequences' progress as their outputs came back."""

    rank: int
    n: int
    prompt_tokens: int
    prefilled: bool = False  # an output came: its prompt no longer counts in the rank's load
    completion_tokens: dict[int, int] = field(default_factory=dict)  # sequence index -> output tokens so far
    finished: set[int] = field(default_factory=set)  # sequence indices

    def aborted_outputs(self, request_id: str) -> list[RequestOutput]:
        """The final outputs of its unfinished sequences, aborted where their rank can no longer say."""
        return [RequestOutput(request_id, index, "", [], True, "abort", None, self.prompt_tokens,
                              self.completion_tokens.get(index, 0))
                for index in range(self.n) if index not in self.finished]


class GroupCore:
    """Rank 0 of an expert-parallel group, driven as an `EngineCore` by the step loop (see the module's docstring).

    core: rank 0's own engine; ranks: the control pipe to each other rank; readies: their RankReady, by rank;
    comm: the group's communicator. `max_seq_len` is the least of the ranks' (each sizes its own KV cache); stats
    sum the ranks' (the steps: the group's)."""

    def __init__(self, core: EngineCore, comm: Communicator, ranks: dict[int, Connection],
                 readies: dict[int, RankReady], reply_timeout: float):
        self.core, self.comm = core, comm
        self.config: EngineConfig = core.config
        self.model_config: ModelConfig = core.model_config
        self.tokenizer = core.tokenizer
        self.timer = core.timer
        self.max_seq_len = min([core.max_seq_len, *(ready.max_seq_len for ready in readies.values())])
        self._ranks = ranks
        self._pids = {rank: ready.pid for rank, ready in readies.items()}
        self._stats = {rank: ready.stats for rank, ready in readies.items()}
        self._unfinished = dict.fromkeys(ranks, False)
        self._reply_timeout = reply_timeout
        self.router = ReplicaRouter(len(ranks) + 1, core.kv_size.block_size)
        self._placed: dict[str, _Placed] = {}
        self._failure: str | None = None

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, validated: bool = False) -> None:
        """Queue a request on the rank the router picks; raises as `EngineCore.add_request` (there)."""
        self._check()
        if request_id in self._placed:
            raise ValueError(f"request {request_id!r} is already running")
        rank = self.router.choose(prompt_token_ids, list(range(len(self._ranks) + 1)))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if rank == 0:
            self.core.add_request(request_id, prompt_token_ids, params, arrival, validated)
        else:
            if not validated:
                self.core.validate(prompt_token_ids, params)
            reply = self._ask(rank, RankPlan(adds=[AddRequest(request_id, prompt_token_ids, params, arrival)]))
            if request_id in reply.failed:
                raise reply.failed[request_id]
        self._placed[request_id] = _Placed(rank, params.n, len(prompt_token_ids))
        load = self.router.loads[rank]
        load.sequences += params.n
        load.prompt_tokens += len(prompt_token_ids)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every sequence of `request_id` on its rank and free its blocks; returns their final outputs."""
        placed = self._placed.get(request_id)
        if placed is None:
            return []
        if placed.rank == 0:
            outputs = self.core.abort(request_id)
        elif self._failure is None:
            outputs = self._ask(placed.rank, RankPlan(aborts=[request_id])).outputs
        else:  # the rank is gone or out of step: nothing to free there
            outputs = placed.aborted_outputs(request_id)
        self._count(outputs)
        self._release(request_id)
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        return [out for request_id in list(self._placed) for out in self.abort(request_id)]

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished() or any(self._unfinished.values())

    # ---- steps ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every rank; returns the outputs of all of them. Raises RequestsFailedError for requests that
        failed alone (as `EngineCore.step`), ExpertParallelError where a rank failed the step as a whole."""
        self._check()
        for rank in self._ranks:
            self._send(rank, RankPlan(step=True))
        errors: dict[int, str] = {}
        failed: dict[str, BaseException] = {}
        try:
            outputs, local_failed = step_rank(self.core, self.comm)
            failed.update(local_failed)
        except Exception as error:  # noqa: BLE001 - the group fails with it, below
            outputs, errors[0] = [], describe(error)
        for rank in self._ranks:
            try:
                reply = self._receive(rank)
            except ExpertParallelError as error:
                errors[rank] = describe(error)
                continue
            if reply.error is not None:
                errors[rank] = describe(reply.error)
            outputs += reply.outputs
            failed.update(reply.failed)
        if errors:
            self._failure = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(errors.items()))
            self._unfinished = dict.fromkeys(self._ranks, False)  # the other ranks step no more
            raise ExpertParallelError(f"the expert-parallel group failed: {self._failure}")
        for request_id in failed:
            self._release(request_id)
        self._count(outputs)
        if failed:
            raise RequestsFailedError([out for out in outputs if out.request_id not in failed], failed)
        return outputs

    def close(self) -> None:
        """Close rank 0's engine and the control pipes (the other ranks then close theirs and exit)."""
        try:
            self.core.close()
        finally:
            for connection in self._ranks.values():
                connection.close()

    def stats(self) -> EngineStats:
        """The ranks' snapshots summed; steps, steps launched ahead and the last step's time: the group's."""
        return summed_stats([self.core.stats(), *self._stats.values()],
                            greatest=("num_steps", "num_steps_launched_ahead", "last_step_time"))

    def store_stats(self) -> ExpertStats | None:
        """Rank 0's expert store's counters (each rank's store counts for itself)."""
        return self.core.store_stats()

    # ---- bookkeeping --------------------------------------------------------------------------------------------
    def _count(self, outputs: list[RequestOutput]) -> None:
        """Take the outputs' progress off their ranks' loads."""
        for out in outputs:
            placed = self._placed.get(out.request_id)
            if placed is None:
                continue
            load = self.router.loads[placed.rank]
            if not placed.prefilled:
                placed.prefilled = True
                load.prompt_tokens -= placed.prompt_tokens
            placed.completion_tokens[out.index] = out.completion_tokens
            if out.finished:
                load.sequences -= 1
                placed.finished.add(out.index)
                if len(placed.finished) == placed.n:
                    del self._placed[out.request_id]

    def _release(self, request_id: str) -> None:
        """Forget an ended request (aborted or failed) and what it still counted in its rank's load."""
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            load = self.router.loads[placed.rank]
            load.prompt_tokens -= 0 if placed.prefilled else placed.prompt_tokens
            load.sequences -= placed.n - len(placed.finished)

    def _check(self) -> None:
        if self._failure is not None:
            raise ExpertParallelError(f"the expert-parallel group failed: {self._failure}")

    def _ask(self, rank: int, plan: RankPlan) -> RankReply:
        """Send a plan without a step to one rank and wait for its reply."""
        self._send(rank, plan)
        try:
            return self._receive(rank)
        except ExpertParallelError as error:
            self._failure = describe(error)
            raise

    def _send(self, rank: int, plan: RankPlan) -> None:
        try:
            self._ranks[rank].send(plan)
        except (OSError, ValueError):
            pass  # a rank that is gone: its reply reports it

    def _receive(self, rank: int) -> RankReply:
        connection = self._ranks[rank]
        try:
            if not connection.poll(self._reply_timeout):
                raise ExpertParallelError(f"rank {rank} (process {self._pids[rank]}) did not answer in "
                                          f"{self._reply_timeout:g} s")
            reply: RankReply = connection.recv()
        except (EOFError, OSError):
            raise ExpertParallelError(f"rank {rank} (process {self._pids[rank]}) is gone") from None
        self._unfinished[rank] = reply.unfinished
        self._stats[rank] = reply.stats
        return reply


def rank_options(options: dict[str, Any]) -> dict[str, Any]:
    """A rank's engine options: every step run eagerly, one forward pass per step (no CUDA graphs, no step
    launched ahead), so that every rank enters the same collectives in the same order."""
    return dict(options, cuda_graphs=False, async_scheduling=False)
