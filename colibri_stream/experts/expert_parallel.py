"""Expert parallelism's dispatch and combine: routed experts sharded by id across ranks, each rank's tokens sent
to the ranks holding their experts and their weighted outputs summed back (docs/MULTI_GPU.md).

Pieces, each usable alone:
- `ShardMap`: expert id -> rank, contiguous and balanced (the first E % N ranks hold one expert more).
- `DispatchPlan`: for one rank's tokens and their routing, per destination rank the token rows to send, and per
  assignment (token, expert) the row, the local expert and the routing weight; `combine` sums the weighted
  expert outputs back in token order.
- `Communicator`: the collectives the MoE block needs; `FakeGroup` runs N ranks on threads of one process over
  NumPy buffers (tests, and the reference an NCCL communicator must agree with).
- `moe_all_to_all` and `moe_all_gather`: the MoE layer over a communicator with either collective.
- `ExpertParallelRank`: one rank's routed experts for a whole model (`MoETransformer.expert_parallel`): every MoE
  layer of the rank's forward step goes through `moe_all_to_all`, the rank's experts run by its backend over a
  store holding the rank's shard only (`shard_config`: the config that store is built for).

Exactness: the single-rank MoE layer (`NumpyBackend.routed_experts`) runs each expert once over every token that
chose it, in token order, and adds the weighted outputs into a zeroed [T, H] in ascending expert order.
`moe_all_to_all` does the same float32 operations in the same order: ranks hold consecutive slices of the batch,
so the rows an expert's rank receives, concatenated by source rank, are that expert's rows in batch order; each
assignment's weighted output comes back on its own and `combine` adds them in ascending expert order (the shards
are contiguous, so rank order is expert order). `moe_all_gather` reduce-scatters per-rank partial sums, which
regroups the additions: equal to rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..config import ModelConfig

RunExpert = Callable[[np.ndarray, int], np.ndarray]  # (rows [n, H] float32, global expert id) -> [n, H] float32


@dataclass(frozen=True)
class ShardMap:
    """Which rank holds each routed expert: contiguous ranges, sizes differing by one at most."""

    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_experts < 1:
            raise ValueError(f"a shard map needs at least one expert and one rank, got {self.num_experts} "
                             f"experts over {self.num_ranks} ranks")
        if self.num_ranks > self.num_experts:
            raise ValueError(f"{self.num_ranks} ranks for {self.num_experts} experts: some rank would hold none")

    def first_expert(self, rank: int) -> int:
        """The lowest expert id of `rank` (the rank's experts are first_expert(rank) .. first_expert(rank + 1) - 1)."""
        base, extra = divmod(self.num_experts, self.num_ranks)
        return rank * base + min(rank, extra)

    def experts_of(self, rank: int) -> range:
        return range(self.first_expert(rank), self.first_expert(rank + 1))

    @property
    def rank_of(self) -> np.ndarray:
        """[E] int64: each expert's rank."""
        return np.repeat(np.arange(self.num_ranks), [len(self.experts_of(r)) for r in range(self.num_ranks)])


@dataclass
class RankDispatch:
    """What one rank's tokens send to one destination rank. Assignments are ordered by expert, then token."""

    token_rows: np.ndarray  # [n] int64: rows of the sender's batch to send (ascending, each once)
    rows: np.ndarray  # [m] int64: per assignment, its row in token_rows
    local_experts: np.ndarray  # [m] int64: per assignment, the expert's id on the destination rank
    weights: np.ndarray  # [m] float32: per assignment, the routing weight
    tokens: np.ndarray  # [m] int64: per assignment, its token in the sender's batch (for the combine)


@dataclass
class DispatchPlan:
    """One step's dispatch for one rank's tokens: `per_rank[d]` is what goes to rank d."""

    shard: ShardMap
    num_tokens: int
    per_rank: list[RankDispatch]

    @classmethod
    def build(cls, expert_ids: np.ndarray, weights: np.ndarray, shard: ShardMap) -> DispatchPlan:
        """expert_ids [T, k] int, weights [T, k] float32: the router's choice for the sender's T tokens."""
        if expert_ids.shape != weights.shape or expert_ids.ndim != 2:
            raise ValueError(f"routing of shapes {expert_ids.shape} and {weights.shape}; expected two [T, k]")
        tokens, slots = np.indices(expert_ids.shape).reshape(2, -1)  # [T * k] each: every (token, slot)
        experts = expert_ids[tokens, slots].astype(np.int64)
        if experts.size and (experts.min() < 0 or experts.max() >= shard.num_experts):
            raise ValueError(f"expert ids outside 0 .. {shard.num_experts - 1}")
        order = np.lexsort((tokens, experts))  # by expert, then token: the single-rank layer's order
        tokens, slots, experts = tokens[order], slots[order], experts[order]
        destination = shard.rank_of[experts]
        per_rank = []
        for rank in range(shard.num_ranks):
            mine = destination == rank
            token_rows, rows = np.unique(tokens[mine], return_inverse=True)
            per_rank.append(RankDispatch(token_rows.astype(np.int64), rows.astype(np.int64).reshape(-1),
                                         experts[mine] - shard.first_expert(rank),
                                         weights[tokens[mine], slots[mine]].astype(np.float32), tokens[mine]))
        return cls(shard, expert_ids.shape[0], per_rank)

    def combine(self, outputs: list[np.ndarray], hidden: int) -> np.ndarray:
        """outputs[d] [m_d, H] float32: the weighted output of each assignment sent to rank d -> [T, H], summed
        per token in ascending expert order."""
        out = np.zeros((self.num_tokens, hidden), np.float32)
        for sent, weighted in zip(self.per_rank, outputs):
            bounds = _segments(sent.local_experts)
            for start, end in zip(bounds[:-1], bounds[1:]):
                out[sent.tokens[start:end]] += weighted[start:end]  # a token picks an expert once: no repeats
        return out


def _segments(sorted_ids: np.ndarray) -> np.ndarray:
    """[s + 1] int64: the bounds of the runs of equal values in `sorted_ids` [m]."""
    changes = np.nonzero(np.diff(sorted_ids))[0] + 1
    return np.concatenate(([0], changes, [len(sorted_ids)])).astype(np.int64)


class Communicator(ABC):
    """The collectives of an expert-parallel group, seen from one rank. Every rank calls each operation, in the
    same order. An NCCL communicator implements these over device buffers (docs/MULTI_GPU.md)."""

    rank: int
    size: int

    @abstractmethod
    def all_to_all(self, sends: list[np.ndarray]) -> list[np.ndarray]:
        """sends[d] goes to rank d; returns what each rank sent to this one, by source rank."""

    @abstractmethod
    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        """Every rank's `part`, by rank."""

    @abstractmethod
    def reduce_scatter(self, parts: list[np.ndarray]) -> np.ndarray:
        """parts[d] [*] float32 is this rank's contribution to rank d; returns the sum over ranks (in rank order)
        of their contributions to this rank."""

    @abstractmethod
    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """`obj` of rank `root` (the step plan from the scheduler's rank), on every rank."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail the group from this rank (it left a step midway): every later collective here raises, and the
        peers' collectives with this rank fail instead of waiting for it."""


class FakeGroup:
    """N ranks in one process: `communicator(rank)` gives rank's Communicator, to be used on a thread of its own.
    Each collective is a post to a mailbox, a barrier, a read of the others' posts, and a barrier."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self._barrier = threading.Barrier(size)
        self._mailbox: list[Any] = [None] * size

    def communicator(self, rank: int) -> Communicator:
        return _FakeCommunicator(self, rank)

    def exchange(self, rank: int, post: Any) -> list[Any]:
        """Every rank's post, by rank."""
        self._mailbox[rank] = post
        self._barrier.wait()
        posts = list(self._mailbox)
        self._barrier.wait()  # nobody posts the next collective's value before all have read this one's
        return posts

    def abort(self) -> None:
        """Break the barrier: every rank waiting in a collective, or entering one, raises BrokenBarrierError."""
        self._barrier.abort()


class _FakeCommunicator(Communicator):
    def __init__(self, group: FakeGroup, rank: int):
        self._group, self.rank, self.size = group, rank, group.size

    def all_to_all(self, sends: list[np.ndarray]) -> list[np.ndarray]:
        return [np.array(posted[self.rank]) for posted in self._group.exchange(self.rank, sends)]

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        return [np.array(posted) for posted in self._group.exchange(self.rank, part)]

    def reduce_scatter(self, parts: list[np.ndarray]) -> np.ndarray:
        posts = self._group.exchange(self.rank, parts)
        total = np.array(posts[0][self.rank])
        for posted in posts[1:]:
            total += posted[self.rank]
        return total

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self._group.exchange(self.rank, obj if self.rank == root else None)[root]

    def abort(self, reason: str) -> None:
        self._group.abort()


def _run_local_experts(rows: np.ndarray, local_experts: np.ndarray, weights: np.ndarray, first_expert: int,
                       run_expert: RunExpert) -> np.ndarray:
    """rows [m, H]: each assignment's input, ordered by local expert -> [m, H]: each expert run once over its
    rows, times the assignment's weight."""
    out = np.empty_like(rows)
    bounds = _segments(local_experts)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            y = run_expert(rows[start:end], first_expert + int(local_experts[start]))  # [n, H]
            out[start:end] = y * weights[start:end][:, None]
    return out


def moe_all_to_all(comm: Communicator, x: np.ndarray, weights: np.ndarray, expert_ids: np.ndarray,
                   shard: ShardMap, run_expert: RunExpert) -> np.ndarray:
    """The routed experts' output [T, H] for this rank's tokens x [T, H] (routing weights, expert_ids [T, k]):
    token rows all-to-all to the experts' ranks, weighted outputs all-to-all back, combined here. Ranks must hold
    consecutive slices of the batch, by rank, for the result to equal the single-rank layer bit for bit."""
    plan = DispatchPlan.build(expert_ids, weights, shard)
    token_rows = comm.all_to_all([x[sent.token_rows] for sent in plan.per_rank])  # by source: [n_s, H]
    indices = comm.all_to_all([np.stack([sent.rows, sent.local_experts]) for sent in plan.per_rank])  # [2, m_s]
    routing_weights = comm.all_to_all([sent.weights for sent in plan.per_rank])  # [m_s] float32
    # One batch per expert across sources, in source order: the expert's rows in batch order.
    inputs = np.concatenate([rows_in[index[0]] for rows_in, index in zip(token_rows, indices)])  # [m, H]
    experts = np.concatenate([index[1] for index in indices])  # [m]
    routing = np.concatenate(routing_weights)  # [m]
    source = np.concatenate([np.full(index.shape[1], s) for s, index in enumerate(indices)])  # [m]
    order = np.argsort(experts, kind="stable")  # by expert, sources in rank order within one
    weighted = np.empty_like(inputs)
    weighted[order] = _run_local_experts(inputs[order], experts[order], routing[order],
                                         shard.first_expert(comm.rank), run_expert)
    replies = comm.all_to_all([weighted[source == s] for s in range(comm.size)])  # replies[d]: [m_d, H]
    return plan.combine(replies, x.shape[1])


def moe_all_gather(comm: Communicator, x: np.ndarray, weights: np.ndarray, expert_ids: np.ndarray,
                   shard: ShardMap, run_expert: RunExpert) -> np.ndarray:
    """As `moe_all_to_all`, by all-gather of the batch and its routing, every rank computing its experts over
    the whole batch, and reduce-scatter of the partial sums (fewer, larger messages: the small-batch choice)."""
    counts = [int(count[0]) for count in comm.all_gather(np.array([len(x)]))]  # tokens per rank
    batch = np.concatenate(comm.all_gather(x))  # [T_all, H]
    plan = DispatchPlan.build(np.concatenate(comm.all_gather(expert_ids)),
                              np.concatenate(comm.all_gather(weights)), shard)
    mine = plan.per_rank[comm.rank]
    weighted = _run_local_experts(batch[mine.token_rows][mine.rows], mine.local_experts, mine.weights,
                                  shard.first_expert(comm.rank), run_expert)
    partial = np.zeros_like(batch)
    bounds = _segments(mine.local_experts)
    for start, end in zip(bounds[:-1], bounds[1:]):
        partial[mine.tokens[start:end]] += weighted[start:end]
    offsets = np.cumsum([0, *counts])
    return comm.reduce_scatter([partial[offsets[r]:offsets[r + 1]] for r in range(comm.size)])


class ExpertParallelRank:
    """One rank of an expert-parallel group running a whole model: the routed experts of every MoE layer sharded
    by id over the group (`ShardMap`), this rank's tokens sent to the ranks holding their experts and the weighted
    outputs summed back (`moe_all_to_all`). Everything else of the model (attention and its KV cache, dense
    weights, routers, shared experts) is the rank's own: it runs its own sequences end to end. Every rank calls
    each MoE layer in the same order, a rank without tokens this step too (with zero rows).

    The experts a rank receives run through its backend's `routed_experts`, one expert at a time with weight 1
    (exact: the weighting follows in `moe_all_to_all`), over the rank's store, which holds the rank's shard only
    (`experts`), numbered 0 .. len(experts) - 1 (the dispatch plan's local ids). The dispatch and combine run on host
    arrays: a device backend's rows are copied to the host and back (`Backend.to_host`, `upload`) around the
    collectives and around each expert (docs/MULTI_GPU.md: the dispatch on device arrays is the next step)."""

    def __init__(self, comm: Communicator, num_experts: int):
        self.comm = comm
        self.shard = ShardMap(num_experts, comm.size)

    @property
    def experts(self) -> range:
        """The model's expert ids this rank holds, in every MoE layer."""
        return self.shard.experts_of(self.comm.rank)

    def routed_experts(self, backend: Any, x: np.ndarray, weights: np.ndarray, expert_ids: np.ndarray, layer: int,
                       store: Any, activation: Any = None) -> np.ndarray:
        """`Backend.routed_experts`' result for this rank's tokens x [T, H] (weights, expert_ids [T, k]) -> [T, H]."""
        id_dtype = expert_ids.dtype  # the backend's routing ids (int64 on the host, int32 on the GPU)
        first = self.experts.start

        def run_expert(rows: np.ndarray, expert: int) -> np.ndarray:
            n = rows.shape[0]
            out = backend.routed_experts(backend.upload(rows), backend.upload(np.ones((n, 1), np.float32)),
                                         backend.upload(np.full((n, 1), expert - first, id_dtype)), layer, store,
                                         activation)  # [n, H]; the store numbers the shard's experts from 0
            return backend.to_host(out)

        out = moe_all_to_all(self.comm, np.asarray(backend.to_host(x), np.float32),
                             np.asarray(backend.to_host(weights), np.float32), backend.to_host(expert_ids),
                             self.shard, run_expert)  # [T, H]
        return backend.upload(out)


def shard_config(config: ModelConfig, experts: range) -> ModelConfig:
    """The model's config as the expert store of a rank holding `experts` sees it: that many routed experts per MoE
    layer, numbered 0 .. len(experts) - 1 (the store's plan, its bytes and its device arrays are sized by it). The
    routing fields, which a store never reads (the rank routes with the model's config), are cut to what that many
    experts allow."""
    count = len(experts)
    return dataclasses.replace(config, num_experts=count, top_k=min(config.top_k, count), n_group=1, topk_group=1)
