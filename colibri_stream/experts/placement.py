"""Where a step computes each routed expert that is not on the GPU: on the CPU where it lies, or after a load.

A pure cost model over bandwidths measured at start-up (or assumed). Computing on the CPU reads the expert's bytes
once from host RAM (after a disk read when the host does not hold it) and takes the routed tokens' arithmetic at
the executor's FLOP rate, whichever is longer; only activations cross PCIe. Loading to a GPU slot moves the bytes
over PCIe (after the same disk read), then the GPU computes at a cost small next to the copy. The CPU and the copy
engine work at the same time, so a step's cost is the later of the two queues: `place_step` splits the experts
between them to make that finish early. An expert expected in later steps shares its load with them: the GPU side
is charged load / (1 + expected reuse). docs/CPU_EXPERTS.md describes the measurements behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bandwidths:
    """Rates in bytes (or FLOP) per second; `measured` says whether start-up measured them or they are assumed."""

    host_read: float  # the CPU expert executor's read of host RAM, all its threads
    h2d: float  # host -> GPU copies from pinned memory
    disk: float  # experts.bin -> host RAM
    cpu_flops: float  # float32 multiply-adds x 2 per second of the CPU expert executor
    measured: bool = False


# The 16-core H200 host (docs/CPU_EXPERTS.md): 88 GB/s read with 16 threads, pinned copies 55 GB/s.
ASSUMED = Bandwidths(host_read=88e9, h2d=55e9, disk=3e9, cpu_flops=1.0e12)


@dataclass(frozen=True)
class ExpertNeed:
    """One routed expert a step needs that is not in a GPU slot."""

    nbytes: int  # the expert's weight bytes (gate, up, down and scales)
    params: int  # its weights' element count (3 x H x I): the arithmetic per token is 2 x params
    tokens: int  # tokens the step routes to it
    on_disk: bool = False  # not in host RAM: either side first reads it from disk
    in_flight_seconds: float | None = None  # a load to the GPU already under way finishes in this many seconds
    expected_reuse: float = 0.0  # later steps expected to use it while a loaded copy would stay resident


@dataclass(frozen=True)
class ExpertCost:
    """Seconds each way for one expert: `cpu` computing it where it lies, `gpu` bringing it to a GPU slot."""

    cpu: float
    gpu: float

    @property
    def cpu_wins(self) -> bool:
        return self.cpu < self.gpu


def expert_cost(need: ExpertNeed, bw: Bandwidths) -> ExpertCost:
    """Seconds of each way for one expert; the GPU side is charged a reused load's share of its cost."""
    disk = need.nbytes / bw.disk if need.on_disk else 0.0
    cpu = disk + max(need.nbytes / bw.host_read, 2.0 * need.params * need.tokens / bw.cpu_flops)
    if need.in_flight_seconds is not None:
        gpu = need.in_flight_seconds
    else:
        gpu = disk + need.nbytes / bw.h2d
    return ExpertCost(cpu=cpu, gpu=gpu / (1.0 + need.expected_reuse))


def place_step(needs: list[ExpertNeed], bw: Bandwidths) -> list[bool]:
    """For each need, True: compute it on the CPU now; False: load it to a GPU slot.

    The CPU and the copies run side by side, so the step finishes with the later queue. Experts are placed largest
    cost first, each on the side whose queue then ends earlier (ties to the side that is cheaper for it, then to the
    GPU). A load in flight counts with the seconds it has left.
    """
    costs = [expert_cost(n, bw) for n in needs]
    cpu_queue = gpu_queue = 0.0
    on_cpu = [False] * len(needs)
    for i in sorted(range(len(needs)), key=lambda i: -max(costs[i].cpu, costs[i].gpu)):
        cost = costs[i]
        cpu_end, gpu_end = cpu_queue + cost.cpu, gpu_queue + cost.gpu
        if cpu_end < gpu_end or (cpu_end == gpu_end and cost.cpu_wins):
            on_cpu[i], cpu_queue = True, cpu_end
        else:
            gpu_queue = gpu_end
    return on_cpu
