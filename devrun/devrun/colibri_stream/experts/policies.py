"""Eviction policies of one MoE layer's expert slots.

A policy sees events (`on_insert` when a block enters a slot, `on_access` when the layer's step uses an expert,
`on_evict`) and answers two questions when a block needs a slot and none is free: `admit` (is it worth a slot at
all, or should it be served once from the staging block) and `victim` (which resident expert leaves). `now` is the
layer's step counter. Candidates are the residents the step does not need and no load is writing; they are never
empty when `victim` is called. Ties always break the same way, so an eviction order is reproducible.

    lru      least recently used (accesses and insertions ordered by one counter)
    lfu      frequency with exponential decay: score = count · decay^(now − last access); lowest score leaves
    pinned   static ranks from a usage file of earlier runs: the layer's most used experts hold the slots (loaded
             at start), any other expert is served from the staging block
    belady   Belady's MIN with bypass, offline only: needs the future trace; evicts the expert used farthest ahead
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from ..config import EVICTION_POLICIES

LFU_DECAY = 0.95  # per step of the layer: the best of 0.5 .. 1.0 on the default model's traces (policy_eval.py)


class EvictionPolicy(ABC):
    """Chooses which expert of one layer leaves its slot."""

    def preload(self, num_slots: int) -> list[int]:
        """Experts to load into the free slots at start, best first (none: slots fill on demand)."""
        return []

    def on_insert(self, expert: int, now: int) -> None:
        """A block entered a slot (a demand load or a prefetch)."""

    def on_access(self, expert: int, now: int) -> None:
        """The layer's step used `expert` (a hit, a fresh load, or a read through the staging block)."""

    def on_evict(self, expert: int) -> None:
        """`expert` left its slot."""

    def admit(self, expert: int, candidates: Sequence[int], now: int) -> bool:
        """Whether `expert` may take a slot from one of `candidates`; False serves it once without caching."""
        return True

    @abstractmethod
    def victim(self, candidates: Sequence[int], now: int) -> int:
        """The expert among `candidates` (resident, unused by the running step) that leaves."""


class LRUPolicy(EvictionPolicy):
    """Least recently used; an insertion counts as a use, so a fresh prefetch is not the first to go."""

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[int, int] = {}  # expert -> tick of its last use or insertion

    def _touch(self, expert: int) -> None:
        self._tick += 1
        self._last[expert] = self._tick

    def on_insert(self, expert: int, now: int) -> None:
        self._touch(expert)

    def on_access(self, expert: int, now: int) -> None:
        self._touch(expert)

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return min(candidates, key=lambda e: self._last[e])


class LFUDecayPolicy(EvictionPolicy):
    """Least frequently used with exponential decay; counts outlive eviction, so an expert keeps its history."""

    def __init__(self, num_experts: int, decay: float = LFU_DECAY):
        self.decay = decay
        self._count = np.zeros(num_experts)  # [E] decayed use count as of _last
        self._last = np.zeros(num_experts, np.int64)  # [E] step of the last use

    def score(self, expert: int, now: int) -> float:
        return float(self._count[expert]) * self.decay ** (now - int(self._last[expert]))

    def on_access(self, expert: int, now: int) -> None:
        self._count[expert] = self.score(expert, now) + 1.0
        self._last[expert] = now

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return min(candidates, key=lambda e: (self.score(e, now), int(self._last[e]), e))


class PinnedPolicy(EvictionPolicy):
    """Static placement from routing statistics: the layer's most used experts hold the slots."""

    def __init__(self, usage: np.ndarray):
        self.usage = np.asarray(usage, np.float64)  # [E] routes per expert in earlier runs

    def _rank(self, expert: int) -> tuple[float, int]:
        return (self.usage[expert], -expert)  # larger ranks higher; the lower id first among equals

    def preload(self, num_slots: int) -> list[int]:
        return sorted(range(len(self.usage)), key=self._rank, reverse=True)[:num_slots]

    def admit(self, expert: int, candidates: Sequence[int], now: int) -> bool:
        return self._rank(expert) > self._rank(self.victim(candidates, now))

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return min(candidates, key=self._rank)


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN with bypass, the offline optimum: evicts the expert whose next use is farthest away, and does
    not cache a block whose own next use is farther than every candidate's. `steps` is the layer's whole future:
    the experts of each of its steps."""

    def __init__(self, steps: Sequence[Sequence[int]], num_experts: int):
        self._uses: list[list[int]] = [[] for _ in range(num_experts)]  # expert -> increasing steps that use it
        for step, experts in enumerate(steps):
            for e in experts:
                self._uses[e].append(step)

    def next_use(self, expert: int, now: int) -> float:
        steps = self._uses[expert]
        i = bisect.bisect_right(steps, now)
        return steps[i] if i < len(steps) else math.inf

    def admit(self, expert: int, candidates: Sequence[int], now: int) -> bool:
        return self.next_use(expert, now) < max(self.next_use(c, now) for c in candidates)

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return max(candidates, key=lambda e: (self.next_use(e, now), e))


def make_policy(name: str, num_experts: int, usage: np.ndarray | None = None) -> EvictionPolicy:
    """A run-time policy by name; "pinned" needs `usage` [E] (routes per expert in earlier runs)."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUDecayPolicy(num_experts)
    if name == "pinned":
        if usage is None:
            raise ValueError("the pinned policy needs routing statistics")
        return PinnedPolicy(usage)
    raise ValueError(f"unknown eviction policy {name!r}: use {', '.join(EVICTION_POLICIES)}")
