"""Where a step computes each routed expert that is not on the GPU: on the CPU where it lies, or after a load.

A pure cost model over bandwidths measured at start-up (or assumed). Computing on the CPU reads the expert's bytes
once from host RAM (after a disk read when the host does not hold it) and takes the routed tokens' arithmetic at
the executor's FLOP rate, whichever is longer; only activations cross PCIe. Loading to a GPU slot moves the bytes
over PCIe (after the same disk read), then the GPU computes at a cost small next to the copy. The CPU and the copy
engine work at the same time, so a step's cost is the later of the two queues: `place_step` divides the experts
between them to make that finish early, and may cut one expert in two by its intermediate rows (the CPU computes
some rows, the GPU the others from a partial copy; the two partial outputs add up): with one or two misses a
layer, whole experts leave one side idle for most of the step. An expert expected in later steps shares its load
with them: the GPU side is charged load / (1 + expected reuse). docs/CPU_EXPERTS.md describes the measurements
behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Bandwidths:
    """Rates in bytes (or FLOP) per second; `measured` says whether start-up measured them or they are assumed."""

    host_read: float  # the CPU expert executor's read of host RAM, all its threads
    h2d: float  # host -> GPU copies from pinned memory
    disk: float  # experts.bin -> host RAM
    cpu_flops: float  # float32 multiply-adds x 2 per second of the CPU expert executor
    measured: bool = False


# Rates assumed where start-up does not measure them: a 16-core GPU host's (docs/CPU_EXPERTS.md).
ASSUMED = Bandwidths(host_read=88e9, h2d=55e9, disk=3e9, cpu_flops=1.0e12)
RATE_LEARNING = 0.25  # the weight of one step's observation in the rates the placement goes on with
# A cut must end the step this much sooner than whole experts: it costs a pass of partial copies and kernels and a
# strided CPU read of down's columns, which the cost model does not count. A smaller margin cuts more experts
# without ending steps sooner (the offload runs of the benchmark record, BENCHMARKS.md).
MIN_CUT_GAIN = 0.1


def corrected(bw: Bandwidths, side: str, predicted: float, observed: float) -> Bandwidths:
    """`bw` with one side's rates ("cpu": host_read and cpu_flops; "copy": h2d) moved toward what a step took:
    observed seconds for work these rates predicted to take `predicted` seconds. Geometric, RATE_LEARNING of the
    way, one observation's factor clamped to [1/2, 2]: the start-up measurement misses per-call costs and the
    other side's pressure on host RAM, and a step's own noise must not swing the split."""
    if predicted <= 0.0 or observed <= 0.0:
        return bw
    factor = min(max(predicted / observed, 0.5), 2.0) ** RATE_LEARNING
    if side == "cpu":
        return replace(bw, host_read=bw.host_read * factor, cpu_flops=bw.cpu_flops * factor)
    if side == "copy":
        return replace(bw, h2d=bw.h2d * factor)
    raise ValueError(f"side must be cpu or copy, got {side!r}")


@dataclass(frozen=True)
class ExpertNeed:
    """One routed expert a step needs that is not in a GPU slot."""

    nbytes: int  # the expert's weight bytes (gate, up, down and scales)
    params: int  # its weights' element count (3 x H x I): the arithmetic per token is 2 x params
    tokens: int  # tokens the step routes to it
    on_disk: bool = False  # not in host RAM: either side first reads it from disk
    in_flight_seconds: float | None = None  # a load to the GPU already under way finishes in this many seconds
    expected_reuse: float = 0.0  # later steps expected to use it while a loaded copy would stay resident
    splittable: bool = True  # its rows may be shared between the CPU and a partial GPU copy (in host memory)


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


def place_step(needs: list[ExpertNeed], bw: Bandwidths, min_cut_gain: float = MIN_CUT_GAIN) -> list[float]:
    """For each need, the share of its intermediate rows the CPU computes now: 1.0 all of it, 0.0 none (it is
    loaded to a GPU slot), in between for at most one need (the rest of its rows are copied and computed on the GPU).

    The CPU and the copies run side by side, so the step finishes with the later queue. Whole experts first:
    largest cost first, each on the side whose queue then ends earlier (ties to the side that is cheaper for it,
    then to the GPU). Then the one splittable need whose split ends the step earliest is cut where both queues end
    together, if that is at least `min_cut_gain` sooner. A load in flight counts with the seconds it has left and is
    never split; neither is an expert whose load later steps are expected to reuse (a partial copy is not kept).
    """
    costs = [expert_cost(n, bw) for n in needs]
    cpu_queue = gpu_queue = 0.0
    share = [0.0] * len(needs)
    for i in sorted(range(len(needs)), key=lambda i: -max(costs[i].cpu, costs[i].gpu)):
        cost = costs[i]
        cpu_end, gpu_end = cpu_queue + cost.cpu, gpu_queue + cost.gpu
        if cpu_end < gpu_end or (cpu_end == gpu_end and cost.cpu_wins):
            share[i], cpu_queue = 1.0, cpu_end
        else:
            gpu_queue = gpu_end
    whole_end = max(cpu_queue, gpu_queue)
    best, best_end = None, whole_end * (1.0 - min_cut_gain)
    for i, need in enumerate(needs):
        if not need.splittable or need.in_flight_seconds is not None or need.expected_reuse:
            continue
        cost = costs[i]
        cpu_rest = cpu_queue - share[i] * cost.cpu  # the queues without this expert
        gpu_rest = gpu_queue - (1.0 - share[i]) * cost.gpu
        cut = min(max((gpu_rest + cost.gpu - cpu_rest) / (cost.cpu + cost.gpu), 0.0), 1.0)  # ends both together
        end = max(cpu_rest + cut * cost.cpu, gpu_rest + (1.0 - cut) * cost.gpu)
        if end < best_end:
            best, best_end = (i, cut), end
    if best is not None:
        share[best[0]] = best[1]
    return share


def gpu_rows(share: float, rows: int, multiple: int) -> int:
    """How many of an expert's `rows` intermediate rows (the first ones) the GPU computes, given the CPU's share: a
    multiple of `multiple` (the GPU kernels read rows in 16-byte vectors); 0 or `rows` when either part would be
    under one multiple."""
    on_gpu = round((1.0 - share) * rows / multiple) * multiple
    if on_gpu < multiple:
        return 0
    return rows if rows - on_gpu < multiple else on_gpu
