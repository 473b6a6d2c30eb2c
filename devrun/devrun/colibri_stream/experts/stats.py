"""Counters of a tiered expert store: per-tier hits, misses and bytes, prefetch recall and waste, stall time.

The step thread updates them; `snapshot()` copies them for another thread (metrics scrape, engine API), so a
reader never sees a counter move under it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TierStats:
    """What one tier did: requests it served (hits), requests it passed down (misses), bytes read out of it."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # bytes moved out of this tier towards the compute (loads into a faster tier, or reads)


@dataclass
class ComputeStats:
    """Where routed experts were computed: on the CPU from host memory, or on the GPU."""

    cpu_experts: int = 0  # expert computations the CPU expert executor ran (one per expert and step)
    gpu_experts: int = 0
    split_experts: int = 0  # experts cut by intermediate rows between the two (counted in both above)
    cpu_seconds: float = 0.0  # wall time inside the CPU expert executor
    cpu_bytes_read: int = 0  # weight bytes the CPU expert executor read from host memory

    def as_dict(self, steps: int) -> dict:
        per_step = (lambda n: n / steps if steps else None)
        return {"cpu_experts": self.cpu_experts, "gpu_experts": self.gpu_experts,
                "split_experts": self.split_experts, "cpu_seconds": self.cpu_seconds,
                "cpu_bytes_read": self.cpu_bytes_read, "cpu_experts_per_step": per_step(self.cpu_experts),
                "gpu_experts_per_step": per_step(self.gpu_experts)}


@dataclass
class ExpertStats:
    """Everything the store counts; layers are indexed by MoE-layer rank (0 .. num_moe_layers - 1)."""

    num_moe_layers: int
    tiers: dict[str, TierStats] = field(default_factory=dict)  # the store's tiers: "gpu" (L1), "host" (L2), "disk"
    steps: int = 0  # model steps seen (a step is one pass over every MoE layer)
    bypass_loads: int = 0  # misses served from the staging block because every slot was needed by the step
    load_errors: int = 0  # blocks whose read failed its checksum
    stall_seconds: float = 0.0  # time the step thread waited for expert loads (demand reads and late prefetches)
    prefetch_loads: int = 0  # blocks the prefetcher loaded
    prefetch_bytes: int = 0
    prefetch_wasted_bytes: int = 0  # prefetched blocks that the step they were loaded for did not use
    predicted: np.ndarray = None  # [layers] int64: experts predicted for a layer's step (summed over steps)
    used: np.ndarray = None  # [layers] int64: distinct experts a layer's step used (summed over steps)
    predicted_used: np.ndarray = None  # [layers] int64: of those used, the ones that had been predicted
    compute: ComputeStats = field(default_factory=ComputeStats)  # where the experts were computed

    def __post_init__(self) -> None:
        for name in ("predicted", "used", "predicted_used"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.num_moe_layers, np.int64))

    def snapshot(self) -> ExpertStats:
        return copy.deepcopy(self)

    def recall_per_layer(self) -> list[float | None]:
        """Prefetch recall of each layer, predicted ∩ used / used (None where nothing was predicted for it)."""
        return [float(p) / u if u and n else None
                for p, u, n in zip(self.predicted_used, self.used, self.predicted)]

    @property
    def prefetch_recall(self) -> float | None:
        """Recall over the layers that get predictions (every MoE layer but the first)."""
        covered = self.predicted > 0
        used = int(self.used[covered].sum())
        return float(self.predicted_used[covered].sum()) / used if used else None

    def hit_rate(self, tier: str) -> float | None:
        stats = self.tiers[tier]
        total = stats.hits + stats.misses
        return stats.hits / total if total else None

    def as_dict(self) -> dict:
        """Plain JSON-ready figures."""
        return {
            "tiers": {name: {"hits": t.hits, "misses": t.misses, "bytes_read": t.bytes_read,
                             "hit_rate": self.hit_rate(name)} for name, t in self.tiers.items()},
            "steps": self.steps,
            "bypass_loads": self.bypass_loads,
            "load_errors": self.load_errors,
            "stall_seconds": self.stall_seconds,
            "prefetch": {"loads": self.prefetch_loads, "bytes": self.prefetch_bytes,
                         "wasted_bytes": self.prefetch_wasted_bytes, "recall": self.prefetch_recall,
                         "recall_per_layer": self.recall_per_layer()},
            "compute": self.compute.as_dict(self.steps),
        }
