"""The slot bookkeeping of one MoE layer: which expert sits in which slot, which of them the running step still
needs, which are still being written, and who leaves when a block needs room.

Pure bookkeeping, no memory and no I/O: the tiered store drives it with real loads, and the offline replay
(`replay.py`) drives it with a routing trace, so both count the same hits and evict in the same order.

A step of the layer goes: `begin_step(needed)` (the distinct experts the step's tokens chose), then for each
needed expert, in the order the compute asks: `lookup` -> on a miss `place` -> `use`. Experts the step needs and
has not used yet are never evicted; when every slot holds one of them (or a block still loading), `place` returns
None and the caller serves the miss from its staging block without caching it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..config import GPU_SLOT_LAYOUTS
from .policies import EvictionPolicy


def layer_slot_counts(per_layer: int, layers: int, experts: int, layout: str) -> list[int]:
    """Each MoE layer's GPU slots for a budget of `per_layer` x `layers` slots. "spread": `per_layer` in every layer
    (each layer keeps its most used experts). "layers": whole layers, the last ones first, then what is left to the
    layer before them, none to the others: a whole layer never misses, so a batch-1 step hands experts to the CPU
    in fewer layers (each hand-off costs about as much host time as a layer's GPU work), as llama.cpp's
    --n-cpu-moe does."""
    if layout not in GPU_SLOT_LAYOUTS:
        raise ValueError(f"slot layout must be one of {', '.join(GPU_SLOT_LAYOUTS)}, got {layout!r}")
    if layout == "spread":
        return [per_layer] * layers
    counts, left = [0] * layers, per_layer * layers
    for rank in reversed(range(layers)):
        counts[rank] = min(experts, left)
        left -= counts[rank]
    return counts


class LayerSlots:
    """The slots of one layer and the eviction policy that manages them."""

    def __init__(self, slot_ids: Iterable[int], policy: EvictionPolicy):
        self.policy = policy
        self.resident: dict[int, int] = {}  # expert -> slot (loaded or loading)
        self.loading: set[int] = set()  # experts whose block is still being written
        self.pending: set[int] = set()  # experts the running step needs and has not used yet
        self._free = list(slot_ids)  # unused slots, taken from the front
        self.num_slots = len(self._free)
        self.now = -1  # the layer's step counter (the policies' clock)

    def warm(self) -> list[tuple[int, int]]:
        """Give the policy's preload choice the free slots; returns the (expert, slot) pairs to load."""
        placed = []
        for expert in self.policy.preload(len(self._free)):
            slot, _ = self.place(expert)
            placed.append((expert, slot))
        return placed

    def begin_step(self, needed: Iterable[int]) -> None:
        self.now += 1
        self.pending = set(needed)

    def lookup(self, expert: int) -> int | None:
        return self.resident.get(expert)

    def use(self, expert: int) -> None:
        """The step computed with `expert` (a hit, a fresh load or a staged read)."""
        self.pending.discard(expert)
        self.policy.on_access(expert, self.now)

    def evictable(self, protected: Iterable[int] = ()) -> list[int]:
        """Residents that may leave: not needed by the running step, not loading, not `protected`."""
        keep = self.pending | self.loading | set(protected)
        return [e for e in self.resident if e not in keep]

    def place(self, expert: int, protected: Iterable[int] = ()) -> tuple[int, int | None] | None:
        """A slot for `expert`: a free one, or the policy's victim's; returns (slot, evicted expert or None),
        or None when no slot may be given (every one is needed or loading, or the policy declines)."""
        if self._free:
            slot, victim = self._free.pop(0), None
        else:
            candidates = self.evictable(protected)
            if not candidates or not self.policy.admit(expert, candidates, self.now):
                return None
            victim = self.policy.victim(candidates, self.now)
            slot = self.resident.pop(victim)
            self.policy.on_evict(victim)
        self.resident[expert] = slot
        self.policy.on_insert(expert, self.now)
        return slot, victim

    def place_ahead(self, ranked: list[int]) -> list[tuple[int, int]]:
        """Slots for the most likely of `ranked` that are not resident yet, at most one per slot and none
        evicting another of them: (expert, slot) pairs, each marked loading (a prefetch)."""
        wanted = ranked[: self.num_slots]
        placed = []
        for expert in wanted:
            if self.lookup(expert) is not None:
                continue
            slot = self.place(expert, protected=wanted)
            if slot is None:
                continue
            self.loading.add(expert)
            placed.append((expert, slot[0]))
        return placed

    def drop(self, expert: int) -> None:
        """Forget `expert` (its load failed): its slot becomes free."""
        self._free.append(self.resident.pop(expert))
        self.loading.discard(expert)
        self.policy.on_evict(expert)
