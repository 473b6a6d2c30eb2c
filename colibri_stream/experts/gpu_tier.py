"""Routed experts in a bounded set of GPU slots (L1), fed from pinned host memory (L2) or experts.bin (L3).

`GpuTieredStore` is the CuPy backend's store when `--gpu-memory-limit` leaves room for fewer experts than the
model has. It moves blocks and never looks inside one; its parts, a module each:
- slot_arena.DeviceSlots: one device arena of each MoE layer's slots (`slots.layer_slot_counts`: the same number in
  every layer, or whole layers) plus a staging block, in experts.bin's block layout;
- block_sources.BlockSource: where a block comes from (every block pinned, a pinned host tier holding some, or
  experts.bin through a staging ring: kvikio parallel reads when kvikio is installed, CRC32 on every block);
- step_plan: the LayerPlan of a layer's step and the planner that places its misses (GPU, CPU, or one cut);
- cpu_dispatch.CpuDispatch: the CPU's part of a layer, on a compiled worker or the CPU thread.
All copies run on one non-blocking copy stream; the compute stream waits on the copy's CUDA event, never the
host.

A layer's step (the backend drives it): `begin_layer` copies the routing and the MoE input to the host (the one
synchronisation per MoE layer that offloading needs: the host must know which blocks to move; a layer whose slots
hold every expert skips it, below), counts hits, decides where each missing expert is computed
(`step_plan.place_misses`, when a CPU expert executor is given: on the GPU, on the CPU, or one cut by rows between
them), queues the copies of the first pass's missing blocks and of the cut expert's GPU rows, and hands the CPU's
part to the CPU (cpu_dispatch.py); `passes` yields one kernel launch per group of experts that fit the layer's
slots (a later pass's copies wait for the earlier pass's kernels), then the cut expert's GPU rows; `finish_layer`
starts the predicted next layer's loads (prefetch) and returns the CPU's
weighted sum as a device array that the compute stream fills once the CPU thread raises a flag in pinned memory
(`handoff.HostFlag`): the host goes on to queue the next layer's attention and router while the CPU computes, and
takes in the CPU's end (its error, its time) at the next `begin_layer`. What the CPU work and the cut copies take
corrects the rates the placement uses (`placement.corrected`).

A layer whose slots hold all its experts (`--gpu-slot-layout layers` gives whole layers) never misses, so it needs
no placement and no synchronisation: its routing goes to the host in a copy that nothing waits for and is counted
at the layer's next step, and the host goes straight on to queue the next layers while the CPU still works on an
earlier layer's experts (as llama.cpp's resident layers run between its CPU layers). Where a prefetcher predicts
from the layer's input for a layer that can miss, the layer synchronises as the others do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..checkpoint import ExpertFile
from ..errors import CheckpointError
from ..expert_codecs import expert_codec
from .block_sources import LOADER_THREADS, BlockSource, block_source
from .cpu_dispatch import CpuDispatch
from .cpu_executor import CpuExpertExecutor
from .cut_layout import CutLayout
from .device import DeviceExperts, LayerExperts
from .handoff import PinnedReadback
from .pinned import PinnedExperts
from .placement import ASSUMED, Bandwidths, ExpertNeed, corrected, expert_cost
from .policies import EvictionPolicy
from .prefetcher import Prefetcher
from .rates import FLOP_PROBE_TOKENS, cpu_expert_rates, pinned_copy_rate, shared_rates
from .slot_arena import DeviceSlots
from .slots import LayerSlots
from .stats import ComputeStats, ExpertStats, TierStats
from .step_plan import Cut, GpuPass, LayerPlan, place_misses
from .tiers import BlockReader, TieredExpertStore

logger = logging.getLogger(__name__)


def _done(event) -> Future:
    future: Future = Future()
    future.set_result(event)
    return future


class GpuTieredStore(DeviceExperts):
    """Routed experts computed from GPU slots: `slots` per MoE layer, or a list of each layer's count; see the module
    docstring.

    host: PinnedExperts (L2 holds all), a TieredExpertStore over a pinned HostTier (L2 holds some) or None (L3
    only): block_sources.block_source makes the store's BlockSource of it. prefetcher: predicts later layers'
    experts from the host copy of the MoE input. cpu_executor: computes misses on the CPU where the cost model says
    so (`cpu_experts` "auto"), for every miss ("all"), or never (None).
    """

    resident = False

    def __init__(self, expert_file: ExpertFile, slots: int | list[int], policies: list[EvictionPolicy],
                 host: PinnedExperts | TieredExpertStore | None, reader: BlockReader,
                 prefetcher: Prefetcher | None = None, cpu_executor: CpuExpertExecutor | None = None,
                 cpu_experts: str = "auto", bandwidths: Bandwidths | None = None):
        import cupy

        self.cp = cupy
        config = expert_file.config
        self.file, self.prefetcher = expert_file, prefetcher
        self.source: BlockSource = block_source(expert_file, host, reader)
        self.executor, self.cpu_experts = cpu_executor, cpu_experts
        self.num_experts = config.num_experts
        self.block_size = expert_file.block_size
        self._params = 3 * config.hidden_size * config.moe_intermediate_size
        # whether a miss may be cut by rows (_place_misses): not where each part would need the down bias once
        self._cuttable = config.plain_experts()
        self._row_group = expert_codec(config).row_group(config.moe_intermediate_size)  # a cut keeps whole groups
        self._layer_ids = list(config.moe_layers)
        self._rank = {layer: rank for rank, layer in enumerate(self._layer_ids)}
        counts = [slots] * len(self._layer_ids) if isinstance(slots, int) else list(slots)
        if len(counts) != len(self._layer_ids) or not all(0 <= n <= self.num_experts for n in counts):
            raise ValueError(f"GPU slots per MoE layer must be {len(self._layer_ids)} counts of 0 .. "
                             f"{self.num_experts}, got {counts}")
        self.device = DeviceSlots(expert_file, counts)
        self._layers = [LayerSlots(range(n), policy) for n, policy in zip(counts, policies)]
        self._slot_events: list[dict[int, object]] = [{} for _ in policies]  # per rank: slot -> last copy's event
        self._inflight: list[dict[int, Future]] = [{} for _ in policies]  # per rank: expert -> prefetch (event)
        self._prefetched: list[set[int]] = [set() for _ in policies]
        self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="colibri-gpu-io")
        self._pass_done = None  # CUDA event after the latest pass's kernels
        self._staging_free = None  # CUDA event after the latest pass that read the staging block
        self._stats = self._fresh_stats()
        self._current = len(policies)
        self._plan: LayerPlan | None = None  # the running layer's (begin_layer -> passes -> finish_layer)
        self._predictions: list[tuple[int, list[int]]] = []
        self._warm_start()
        self._stats = self._fresh_stats()  # count the model's requests, not the warm start
        self.bandwidths = bandwidths or (self._measure_bandwidths() if cpu_executor is not None else ASSUMED)
        # Measured rates are corrected by what the steps' CPU work and cut copies take (placement.corrected).
        self.adapt_rates = bandwidths is None and cpu_executor is not None
        self._copy_probe = None  # (start, end) timing events of the latest cut copy, and its predicted seconds
        self._readback = PinnedReadback()  # routing and MoE input to the host, one synchronisation a layer
        self.cpu = None if cpu_executor is None else CpuDispatch(
            expert_file, self.source, cpu_executor, cupy.cuda.get_current_stream(), self._layer_ids[0])
        self._sync_free = self._sync_free_ranks(counts)  # per rank: every expert resident, nothing to predict from it
        self._untallied: dict[int, tuple[np.ndarray, object]] = {}  # per sync-free rank: routing copy [T, k], event
        for rank in (r for r, free in enumerate(self._sync_free) if free):
            table = np.full(self.num_experts, -1, np.int32)  # [E] the fixed expert -> local slot map
            for expert, slot in self._layers[rank].resident.items():
                table[expert] = slot
            self.device.tables[rank].set(table)

    def _sync_free_ranks(self, counts: list[int]) -> list[bool]:
        """Per MoE-layer rank: whether its steps skip the read-back (its slots hold every expert, and no layer that
        can miss takes predictions from its input)."""
        whole = [n == self.num_experts for n in counts]
        ahead = self.prefetcher.lookahead if self.prefetcher is not None else 0
        return [whole[rank] and all(whole[rank + 1: rank + 1 + ahead]) for rank in range(len(counts))]

    # ---- start ---------------------------------------------------------------------------------------------
    def _fresh_stats(self) -> ExpertStats:
        stats = ExpertStats(len(self._layers), tiers={name: TierStats() for name in ("gpu", *self.source.tier_names)})
        self.source.counts = stats.tiers
        return stats

    def _warm_start(self) -> None:
        """Fill every slot: the policy's preload choice first, then the lowest expert ids (a GPU slot left empty
        only costs a miss later)."""
        for rank, slots in enumerate(self._layers):
            wanted = slots.policy.preload(slots.num_slots)
            wanted += [e for e in range(self.num_experts) if e not in wanted]
            for expert in wanted[: slots.num_slots]:
                slot, _ = slots.place(expert)
                self._slot_events[rank][slot] = self._copy(self._layer_ids[rank], expert,
                                                           self.device.pointer(rank, slot))
        self._copy_stream.synchronize()

    def _measure_bandwidths(self) -> Bandwidths:
        """Pinned host -> GPU copies and the CPU executor's read and arithmetic rates, measured on two blocks; the
        placement uses the read and copy rates measured while both run at once (they share host RAM, and the
        experts it cuts between them are worked on at the same time). The copies read another block than the
        executor, as in a step: both reading the same block at once would serve part of the reads from the CPU's
        caches."""
        layer, other = self._layer_ids[0], min(1, self.num_experts - 1)
        computed, copied = self.source.sample_blocks(layer, 0, other)
        destination = self.device.pointer(0, self.device.staging(0))
        tensors = self.file.unpack(computed)
        h2d = pinned_copy_rate(copied, destination, self._copy_stream)
        host_read, cpu_flops = cpu_expert_rates(self.executor, tensors, self._params)
        host_shared, h2d_shared = shared_rates(self.executor, tensors, copied, destination, self._copy_stream)
        self.executor.stats = ComputeStats()  # the measurement is not work the model asked for
        logger.info("expert placement: host -> GPU %.1f GB/s (%.1f while the CPU reads), CPU expert read %.1f GB/s "
                    "(%.1f while copies run) and %.0f GFLOP/s at %d tokens (%d threads)", h2d / 1e9, h2d_shared / 1e9,
                    host_read / 1e9, host_shared / 1e9, cpu_flops / 1e9, FLOP_PROBE_TOKENS, self.executor.num_threads)
        return Bandwidths(host_read=host_shared, h2d=h2d_shared, disk=ASSUMED.disk, cpu_flops=cpu_flops,
                          measured=True)

    # ---- moving blocks -------------------------------------------------------------------------------------
    def _copy(self, layer: int, expert: int, destination: int, after=None):
        """Copy the block of (layer, expert) from its source (reading experts.bin when no tier holds it) to
        `destination` on the copy stream, after the event `after` if given; returns the copy's event."""
        source, release = self.source.block(layer, expert)
        if after is not None:
            self._copy_stream.wait_event(after)
        return self._enqueue(source, release, destination)

    def _enqueue(self, source: np.ndarray, release, destination: int, layout: CutLayout | None = None):
        """Queue the copy of a pinned block (or with `layout`, of its rows packed) to `destination` on the copy
        stream; hand its event to `release` (the source may be reused once it completes) and return it."""
        cp = self.cp
        if layout is None:
            cp.cuda.runtime.memcpyAsync(destination, source.ctypes.data, self.block_size,
                                        cp.cuda.runtime.memcpyHostToDevice, self._copy_stream.ptr)
        else:
            layout.enqueue_copy(source.ctypes.data, destination, self._copy_stream)
        event = cp.cuda.Event(disable_timing=True)
        event.record(self._copy_stream)
        release(event)
        return event

    def _copy_from_disk(self, layer: int, expert: int, destination: int):
        """A prefetch of a block that no host tier holds, on a loader thread: read, check, copy; the event."""
        return self._enqueue(*self.source.read_staged(layer, expert), destination)

    # ---- the step ------------------------------------------------------------------------------------------
    def begin_layer(self, layer: int, x, expert_ids, weights=None) -> None:
        cp, rank = self.cp, self._rank[layer]
        if rank <= self._current:
            self._stats.steps += 1
        self._current = rank
        if self._sync_free[rank]:
            self._begin_resident_layer(rank, expert_ids)
            return
        wanted = {"ids": cp.ascontiguousarray(expert_ids)}
        if self.prefetcher is not None or self.executor is not None:
            wanted["x"] = cp.ascontiguousarray(x)
        if self.executor is not None and weights is not None:
            wanted["weights"] = cp.ascontiguousarray(weights, dtype=np.float32)
        # The copies are queued behind the previous layer's CPU flag, then the host sleeps until the CPU's end and
        # only then waits for the stream: the GPU does not wait for the host to queue them, and the host does not
        # spin beside the CPU's threads while they work.
        stream = cp.cuda.get_current_stream()
        host = self._readback.queue(stream, **wanted)
        self._collect_cpu_work()
        self._readback.wait(stream)  # the synchronisation offloading needs
        for resident in list(self._untallied):  # their copies were queued before this one: finished
            self._tally_resident(resident)
        ids = host["ids"].astype(np.int64)  # [T, k]
        x_host = host.get("x")  # [T, H]
        self._observe_copy()
        needed = np.unique(ids).tolist()  # the step's distinct experts (batch union)
        slots = self._layers[rank]
        self._settle(rank)
        wasted = self._prefetched[rank].difference(needed)
        self._stats.prefetch_wasted_bytes += len(wasted) * self.block_size
        self._prefetched[rank] = set()
        self._stats.used[rank] += len(needed)
        slots.begin_step(needed)
        if self.prefetcher is not None:
            self.prefetcher.settle(rank, needed, self._stats)
            self._predictions = self.prefetcher.predict(rank, x_host)
        hits = [e for e in needed if slots.lookup(e) is not None]
        misses = [e for e in needed if slots.lookup(e) is None]
        on_cpu: list[int] = []
        cut = None
        if self.executor is not None and misses:
            on_cpu, cut = self._place_misses(layer, ids, misses)
            misses = [e for e in misses if e not in on_cpu and (cut is None or e != cut.expert)]
        cpu_part = on_cpu + ([cut.expert] if cut is not None else [])
        self.source.begin_layer(layer, misses + cpu_part)
        self._stats.tiers["gpu"].hits += len(hits)
        self._stats.tiers["gpu"].misses += len(misses) + len(cpu_part)
        self._plan = plan = LayerPlan(rank, layer, hits=hits, todo=list(misses), on_cpu=on_cpu, cut=cut, ids=ids,
                                      x=x_host, weights=host.get("weights"))
        # The copies start first unless one waits for a disk read (the CPU would wait behind it); the cut's copy
        # goes now when the first pass takes every other miss (else the staging block may still be needed).
        copies_first = all(self.source.in_memory(layer, e) for e in misses)
        if not copies_first:
            self._start_cpu_work(plan)
        plan.first_pass = self._queue_pass(plan, first=True)
        if cut is not None and not plan.todo and not plan.first_pass.through_staging:
            plan.cut_copy = self._queue_cut_copy(rank, cut)
        if copies_first:
            self._start_cpu_work(plan)

    def _begin_resident_layer(self, rank: int, expert_ids) -> None:
        """A step of a layer whose slots hold every expert: no read-back, no placement, no CPU work. The routing's
        copy to the host is queued, not waited for; the layer's previous one is counted now (long finished). CPU work
        still running on the CpuLayerWorker goes on (it needs no GIL to end, so whatever waits on the stream meanwhile
        cannot hold it up); the CPU thread's Python needs the GIL, so its work is taken in first."""
        if self.cpu is not None and self.cpu.thread_job_pending():
            self._collect_cpu_work()
        self._tally_resident(rank)
        stream = self.cp.cuda.get_current_stream()
        ids = self._readback.queue(stream, **{f"ids{rank}": self.cp.ascontiguousarray(expert_ids)})[f"ids{rank}"]
        copied = self.cp.cuda.Event(disable_timing=True)
        copied.record(stream)
        self._untallied[rank] = (ids, copied)
        self._plan = LayerPlan(rank, self._layer_ids[rank], resident=True)

    def _tally_resident(self, rank: int) -> None:
        """Count the routing of a sync-free layer's latest step (at the layer's next step, or after the next
        synchronisation): its distinct experts, every one a GPU hit."""
        if rank not in self._untallied:
            return
        ids, copied = self._untallied.pop(rank)
        copied.synchronize()
        used = len(np.unique(ids))
        self._stats.used[rank] += used
        self._stats.tiers["gpu"].hits += used
        self._stats.tiers["gpu"].bytes_read += used * self.block_size
        self._stats.compute.gpu_experts += used

    def _place_misses(self, layer: int, ids: np.ndarray, misses: list[int]) -> tuple[list[int], Cut | None]:
        """(the misses the CPU computes whole this step, the one cut by its intermediate rows or None), from the
        planner: all whole ("all"), or the cost model's choice ("auto"). Only an expert in host memory is cut (the
        CPU and the copy read the same pinned block), never a biased one, and at whole groups of its format's rows
        (ExpertCodec.row_group: int4's groups, fp8's tiles)."""
        counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)
        splittable = self.source.has_host_blocks and self._cuttable
        needs = [ExpertNeed(self.block_size, self._params, int(counts[e]), on_disk=not self.source.in_memory(layer, e),
                            splittable=splittable) for e in misses]
        return place_misses(misses, needs, self.bandwidths, self.file.config.moe_intermediate_size,
                            every_miss=self.cpu_experts == "all", row_group=self._row_group)

    def _queue_pass(self, plan: LayerPlan, first: bool) -> GpuPass:
        """Place the step's next group of experts in the layer's slots and queue the copies of those not there
        (its one expert goes through the staging block when every slot holds an expert this step still needs).
        The first pass takes the hits (a hit whose prefetch failed becomes a miss) and as many misses as free slots
        hold; a block placed for a later pass is copied after the earlier pass's kernels (the copy waits on
        `_pass_done`)."""
        rank, todo = plan.rank, plan.todo
        slots, events = self._layers[rank], self._slot_events[rank]
        table = np.full(self.num_experts, -1, np.int32)  # [E] local slot of each expert in this pass
        batch = []
        for expert in plan.hits if first else ():
            slot = self._ready_slot(rank, expert)
            if slot is None:  # its prefetch failed: now a miss
                todo.append(expert)
                continue
            table[expert] = slot
            batch.append(expert)
        while todo:
            placed = slots.place(todo[0])
            if placed is None:
                break
            expert = todo.pop(0)
            events[placed[0]] = self._demand_copy(rank, expert, placed[0], slots)
            table[expert] = placed[0]
            batch.append(expert)
        through_staging = not batch and bool(todo)
        if through_staging:
            expert = todo.pop(0)
            table[expert] = self.device.staging(rank)
            self._stats.bypass_loads += 1
            self.cp.cuda.get_current_stream().wait_event(self._demand_copy(rank, expert, table[expert], None))
            batch.append(expert)
        return GpuPass(table, batch, through_staging)

    def passes(self, layer: int) -> Iterator[LayerExperts]:
        """One LayerExperts per kernel launch: the step's experts that are (or are made) resident, as many at a
        time as the layer's slots hold (the first pass's copies were queued by `begin_layer`), then the cut
        expert's GPU rows."""
        cp, plan = self.cp, self._plan
        rank = plan.rank
        if plan.resident:  # every expert in its slot, the table fixed since the warm start
            yield self.device.view(rank)
            return
        slots, events = self._layers[rank], self._slot_events[rank]
        compute = cp.cuda.get_current_stream()
        gpu_pass = plan.first_pass
        while gpu_pass.experts:
            for expert in gpu_pass.experts:
                slot = int(gpu_pass.table[expert])
                if slot in events:
                    compute.wait_event(events[slot])
            self.device.tables[rank].set(gpu_pass.table)
            self._stats.compute.gpu_experts += len(gpu_pass.experts)
            self._stats.tiers["gpu"].bytes_read += len(gpu_pass.experts) * self.block_size
            yield self.device.view(rank)
            self._pass_done = cp.cuda.Event(disable_timing=True)
            self._pass_done.record(compute)
            if gpu_pass.through_staging:
                self._staging_free = self._pass_done
            for expert in gpu_pass.experts:
                slots.use(expert)
            gpu_pass = self._queue_pass(plan, first=False)
        if plan.cut is not None:
            yield self._cut_pass(rank, plan)
            self._pass_done = cp.cuda.Event(disable_timing=True)
            self._pass_done.record(compute)
            self._staging_free = self._pass_done

    def _queue_cut_copy(self, rank: int, cut: Cut) -> tuple[CutLayout, object]:
        """Queue the copy of a cut expert's GPU rows, packed, into the staging block once no earlier pass reads
        that block: (its layout, the copy's event)."""
        cp = self.cp
        layout = CutLayout(self.device.tensors, cut.gpu_rows, self._row_group)
        source, release = self.source.block(self._layer_ids[rank], cut.expert)
        if self._staging_free is not None:
            self._copy_stream.wait_event(self._staging_free)
        start = cp.cuda.Event() if self.adapt_rates else None  # timing the copy corrects the copy rate
        if start is not None:
            start.record(self._copy_stream)
        copied = self._enqueue(source, release, self.device.pointer(rank, self.device.staging(rank)), layout)
        if start is not None:
            end = cp.cuda.Event()
            end.record(self._copy_stream)
            self._copy_probe = (start, end, layout.nbytes / self.bandwidths.h2d)
        return layout, copied

    def _cut_pass(self, rank: int, plan: LayerPlan) -> LayerExperts:
        """The GPU part of the step's cut expert (its copy queued now if `begin_layer` did not): the compute waits
        for the copy."""
        layout, copied = plan.cut_copy or self._queue_cut_copy(rank, plan.cut)
        self.cp.cuda.get_current_stream().wait_event(copied)
        self._stats.compute.gpu_experts += 1
        self._stats.compute.split_experts += 1
        self._stats.tiers["gpu"].bytes_read += layout.nbytes
        return self.device.cut_view(layout, plan.cut.expert)

    def _demand_copy(self, rank: int, expert: int, slot: int, slots: LayerSlots | None):
        """Load a missed block into a local slot now (the host waits only for a disk read); its event."""
        layer = self._layer_ids[rank]
        start = time.perf_counter()
        try:
            with self.timer.phase("expert_load_disk"):
                return self._copy(layer, expert, self.device.pointer(rank, slot), after=self._pass_done)
        except CheckpointError:
            self._stats.load_errors += 1
            if slots is not None:
                slots.drop(expert)
            raise
        finally:
            self._stats.stall_seconds += time.perf_counter() - start

    def _ready_slot(self, rank: int, expert: int) -> int | None:
        """The slot of a resident expert once its prefetch (if any) has been handed to the copy stream."""
        slots = self._layers[rank]
        future = self._inflight[rank].pop(expert, None)
        if future is not None:
            start = time.perf_counter()
            try:
                with self.timer.phase("expert_load_wait"):
                    event = future.result()
            except CheckpointError as error:
                self._stats.load_errors += 1
                logger.warning("prefetch of expert %d of layer %d failed: %s", expert, self._layer_ids[rank], error)
                slots.drop(expert)
                self._stats.tiers["gpu"].hits -= 1
                self._stats.tiers["gpu"].misses += 1
                return None
            finally:
                self._stats.stall_seconds += time.perf_counter() - start
            slots.loading.discard(expert)
            self._slot_events[rank][slots.lookup(expert)] = event
        return slots.lookup(expert)

    def finish_layer(self, layer: int):
        """After the layer's kernels are queued: start the next layers' prefetches and return the weighted sum
        [T, H] on the device of the experts placed on the CPU (None if none). The compute stream waits for the CPU's
        flag before copying the sum in, so the host goes on to queue the next layer while the CPU works; the next
        `begin_layer` that synchronises (or, for the step's last MoE layer, this call) takes in the work's end."""
        plan, self._plan = self._plan, None
        for target, ranked in self._predictions:
            self._prefetch(target, ranked)
        self._predictions = []
        last = plan.rank == len(self._layer_ids) - 1
        if plan.cpu is None:
            if last:
                self._collect_cpu_work()  # an earlier layer's, when the layers after it were sync-free
            return None
        stream = self.cp.cuda.get_current_stream()
        if last:
            self._collect_cpu_work()
        else:
            self.cpu.flag.wait(stream, plan.cpu.ticket)
        out = self.cp.empty(plan.cpu.out.shape, np.float32)  # [T, H]
        self.cp.cuda.runtime.memcpyAsync(out.data.ptr, plan.cpu.out.ctypes.data, out.nbytes,
                                         self.cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        return out

    def _start_cpu_work(self, plan: LayerPlan) -> None:
        """Hand the experts placed on the CPU to it (cpu_dispatch.py), and predict what they take meanwhile."""
        if self.cpu is None:
            return
        job = self.cpu.start(plan)
        if job is not None:
            job.predicted = self._cpu_seconds(plan.ids, job.work)  # while the CPU works

    def _collect_cpu_work(self) -> None:
        """Wait for the CPU's latest layer: raise its error, correct the CPU rates by its time, count its experts
        as used."""
        if self.cpu is None or self.cpu.pending is None:
            return
        with self.timer.phase("expert_cpu"):
            plan, seconds = self.cpu.collect()
        if self.adapt_rates:
            self.bandwidths = corrected(self.bandwidths, "cpu", plan.cpu.predicted, seconds)
        for expert, _ in plan.cpu.work:
            self._layers[plan.rank].use(expert)

    def _cpu_seconds(self, ids: np.ndarray, work: list[tuple[int, tuple | None]]) -> float:
        """What the placement's rates predict the CPU work of a layer takes (each expert's block already in host
        memory; a cut one's share of it)."""
        inter, seconds = self.file.config.moe_intermediate_size, 0.0
        for expert, rows in work:
            need = ExpertNeed(self.block_size, self._params, int((ids == expert).sum()))
            share = 1.0 if rows is None else (rows[1] - rows[0]) / inter
            seconds += share * expert_cost(need, self.bandwidths).cpu
        return seconds

    def _observe_copy(self) -> None:
        """Correct the copy rate by the latest cut copy once it has finished."""
        if self._copy_probe is None or not self._copy_probe[1].done:
            return
        start, end, predicted = self._copy_probe
        self._copy_probe = None
        self.bandwidths = corrected(self.bandwidths, "copy", predicted,
                                    self.cp.cuda.get_elapsed_time(start, end) / 1e3)

    # ---- prefetch ------------------------------------------------------------------------------------------
    def _prefetch(self, rank: int, ranked: list[int]) -> None:
        """Start loading the most likely of `ranked` into layer `rank`'s slots, at most one per slot."""
        layer = self._layer_ids[rank]
        self._settle(rank)
        for expert, slot in self._layers[rank].place_ahead(ranked):
            destination = self.device.pointer(rank, slot)
            if self.source.in_memory(layer, expert):
                future = _done(self._copy(layer, expert, destination))
            else:
                self.source.count_disk_read()
                future = self._pool.submit(self._copy_from_disk, layer, expert, destination)
            self._inflight[rank][expert] = future
            self._prefetched[rank].add(expert)
            self._stats.prefetch_loads += 1
            self._stats.prefetch_bytes += self.block_size

    def _settle(self, rank: int) -> None:
        """Take in the finished background loads of layer `rank`: a block handed to the copy stream becomes an
        ordinary resident one (its event kept for the compute to wait on); a failed one frees its slot (a demand
        read reports the corrupt block if the expert is ever needed)."""
        slots, inflight = self._layers[rank], self._inflight[rank]
        for expert in [e for e, future in inflight.items() if future.done()]:
            future = inflight.pop(expert)
            error = future.exception()
            if error is None:
                self._slot_events[rank][slots.lookup(expert)] = future.result()
                slots.loading.discard(expert)
                continue
            self._stats.load_errors += 1
            slots.drop(expert)
            self._prefetched[rank].discard(expert)
            logger.warning("prefetch of expert %d of layer %d failed: %s", expert, self._layer_ids[rank], error)

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """One expert's tensors on the host (from the memory map of experts.bin); the GPU path uses `passes`."""
        return self.file.tensors(layer, expert)

    def close(self) -> None:
        """Wait for the CPU's last layer and the copies in flight, then join every thread of the store (the CPU
        worker's included: it may still be spinning in compiled code) and close its block source."""
        try:
            self._collect_cpu_work()
        finally:
            self._pool.shutdown(wait=True)
            if self.cpu is not None:
                self.cpu.close()
            self._copy_stream.synchronize()
            self.source.close()

    def stats(self) -> ExpertStats:
        snapshot = self.source.merged_stats(self._stats.snapshot())
        if self.executor is not None:
            cpu = self.executor.stats
            snapshot.compute.cpu_experts = cpu.cpu_experts
            snapshot.compute.cpu_seconds = cpu.cpu_seconds
            snapshot.compute.cpu_bytes_read = cpu.cpu_bytes_read
        return snapshot
