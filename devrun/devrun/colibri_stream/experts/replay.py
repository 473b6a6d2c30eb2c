"""Offline policy evaluation: replay one layer's routing through `LayerSlots` exactly as the store runs a step
(without prefetch), with any policy, Belady's optimum included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .policies import BeladyPolicy, EvictionPolicy, make_policy
from .slots import LayerSlots


@dataclass
class ReplayResult:
    """Hits and misses of one layer's replay; `evictions` lists (step, evicted expert, incoming expert)."""

    hits: int = 0
    misses: int = 0
    bypasses: int = 0  # misses served from the staging block, not cached
    evictions: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def replay(steps: Sequence[Sequence[int]], policy: EvictionPolicy, num_slots: int) -> ReplayResult:
    """Run `steps` (the distinct experts of each step, in the order the compute asks for them) through
    `num_slots` slots managed by `policy`; slots start as the policy's preload leaves them."""
    slots = LayerSlots(range(num_slots), policy)
    slots.warm()
    result = ReplayResult()
    for step, needed in enumerate(steps):
        slots.begin_step(needed)
        for expert in needed:
            if slots.lookup(expert) is not None:
                result.hits += 1
            else:
                result.misses += 1
                placed = slots.place(expert)
                if placed is None:
                    result.bypasses += 1
                elif placed[1] is not None:
                    result.evictions.append((step, placed[1], expert))
            slots.use(expert)
    return result


def replay_policy(name: str, steps: Sequence[Sequence[int]], num_experts: int,
                  usage: np.ndarray | None = None) -> EvictionPolicy:
    """A fresh policy for a replay: a run-time one by name, or "belady" (which reads the whole of `steps`)."""
    if name == "belady":
        return BeladyPolicy(steps, num_experts)
    return make_policy(name, num_experts, usage)
