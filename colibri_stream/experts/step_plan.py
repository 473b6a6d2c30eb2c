"""The plan of one MoE layer's step in the GPU tier, and the planner that decides where its missed experts go.

`GpuTieredStore.begin_layer` makes a `LayerPlan` from the step's routing: the hits, the misses the GPU loads into
its slots, the misses the CPU computes whole, and at most one `Cut` expert whose intermediate rows are shared
between them (the GPU computes rows 0 .. gpu_rows - 1 from a packed copy, cut_layout.py; the CPU the rest). The
planner (`place_misses`) sees each miss only as an `ExpertNeed` (bytes, parameters, tokens, where its block is):
it never looks inside a block, so a new expert format changes nothing here.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from .placement import Bandwidths, ExpertNeed, gpu_rows, place_step

CUT_ROW_MULTIPLE = 16  # a cut expert's GPU rows: whole 16-byte vectors of every expert dtype


@dataclass
class Cut:
    """An expert computed in two parts: intermediate rows 0 .. gpu_rows - 1 on the GPU, the rest on the CPU."""

    expert: int
    gpu_rows: int


@dataclass
class GpuPass:
    """One launch of the MoE kernels over the layer's slots: which local slot each expert is in this pass."""

    table: np.ndarray  # [E] int32 local slot of each expert, -1: not in this pass
    experts: list[int]
    through_staging: bool  # its one expert is in the staging block (every slot holds one the step still needs)


@dataclass
class CpuJob:
    """The CPU's part of a layer's step: its experts' weighted sum into a pinned buffer, then the flag raised."""

    work: list[tuple[int, tuple[int, int] | None]]  # (expert, (first, last) rows the CPU computes; None: all)
    out: np.ndarray  # [T, H] float32, pinned: the weighted sum
    ticket: int  # the flag value raised once `out` is complete
    predicted: float = 0.0  # seconds the placement's rates predict for it
    worker_job: int | None = None  # the CpuLayerWorker's job, where it serves
    releases: list = field(default_factory=list)  # the worker's blocks, released once the job is taken in
    nbytes: int = 0  # the bytes the worker's job reads
    future: Future | None = None  # the CPU thread's run (its seconds), where the worker does not serve


@dataclass
class LayerPlan:
    """One MoE layer's step, from `begin_layer` through `passes` to `finish_layer`."""

    rank: int  # the MoE layer's index among the MoE layers
    layer: int
    resident: bool = False  # every expert in its slot (a layer that never misses): no plan beyond this
    hits: list[int] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # misses the GPU loads, not yet placed in a pass
    on_cpu: list[int] = field(default_factory=list)  # misses the CPU computes whole
    cut: Cut | None = None
    ids: np.ndarray | None = None  # [T, k] the routing, on the host
    x: np.ndarray | None = None  # [T, H] the MoE input, on the host (for the CPU and the prefetcher)
    weights: np.ndarray | None = None  # [T, k] the routing weights, on the host (for the CPU)
    first_pass: GpuPass | None = None
    cut_copy: tuple | None = None  # (CutLayout, the copy's event) of the cut's GPU rows, once queued
    cpu: CpuJob | None = None

    def cpu_work(self, intermediate: int) -> list[tuple[int, tuple[int, int] | None]]:
        """What the CPU computes: each whole expert (None: all rows), then the cut expert's rows past the GPU's."""
        work: list[tuple[int, tuple[int, int] | None]] = [(expert, None) for expert in self.on_cpu]
        if self.cut is not None:
            work.append((self.cut.expert, (self.cut.gpu_rows, intermediate)))
        return work


def place_misses(misses: list[int], needs: list[ExpertNeed], bandwidths: Bandwidths, intermediate: int,
                 every_miss: bool, row_group: int = 1) -> tuple[list[int], Cut | None]:
    """(the misses the CPU computes whole, the one cut by its intermediate rows or None): every miss whole on the
    CPU (`every_miss`), or the cost model's choice (placement.place_step) over `needs` (one per miss). A cut's GPU
    rows are a multiple of CUT_ROW_MULTIPLE and of the format's `row_group` (ExpertCodec.row_group)."""
    if every_miss:
        return list(misses), None
    on_cpu, cut = [], None
    for expert, share in zip(misses, place_step(needs, bandwidths)):
        rows = gpu_rows(share, intermediate, math.lcm(CUT_ROW_MULTIPLE, row_group))
        if rows == 0:
            on_cpu.append(expert)
        elif rows < intermediate:
            cut = Cut(expert, rows)
    return on_cpu, cut
