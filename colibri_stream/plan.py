"""Expert placement plan: where experts live per tier under the memory budgets, what must move per token, and which
path bounds decode speed. Built from config.json and file sizes only (no weights are read); `colibri plan` prints it
and the engine logs the same text at start. `kv_report`: the KV cache's bytes per token and the tokens its default
size holds (kv_budget.py's rules), which `colibri plan` prints after it.

Tiers: L1 GPU slots (`gpu_memory_limit` minus the dense weights), L2 host slots (`l2_cache_size`; without it every
expert is reached through the memory map of experts.bin), L3 experts.bin itself. A bounded tier holds whole slots,
the same number per MoE layer, plus one staging block through which a miss passes when the step needs every slot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import expert_block_layout, read_config
from .config import CacheConfig, ModelConfig, SchedulerConfig
from .errors import ConfigError
from .inspect import _size as format_size
from .kv_budget import (HOST_KV_SHARE, SIZE_FLAGS, SlidingPool, activation_reserve, default_budget, size_kv_cache,
                        sliding_pool_blocks)
from .memory import MemoryInfo
from .model.paged_kv import SlidingLayers, kv_bytes_per_token
from .sliding_blocks import sliding_blocks_per_seq


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of every path an expert can take. Defaults: a host of one H200 and 16 cores; they are
    assumptions anywhere else, so measure and override them."""

    hbm: float = 4.2e12  # GPU memory, device-to-device copy
    pcie_pinned: float = 55e9  # host -> GPU from pinned memory
    pcie_pageable: float = 8.6e9  # host -> GPU from pageable memory (the memory map)
    disk: float = 1.5e9  # experts.bin, cold sequential read
    host_ram: float = 88e9  # host memory read by 16 threads

    def describe(self) -> str:
        return (f"HBM {self.hbm / 1e12:.1f} TB/s, PCIe pinned {self.pcie_pinned / 1e9:.0f} GB/s, "
                f"PCIe pageable {self.pcie_pageable / 1e9:.1f} GB/s, disk {self.disk / 1e9:.1f} GB/s, "
                f"host RAM {self.host_ram / 1e9:.0f} GB/s")


@dataclass(frozen=True)
class PathLoad:
    """One path's traffic per token and the time it takes at its bandwidth."""

    name: str
    bytes_per_token: float
    bandwidth: float

    @property
    def seconds(self) -> float:
        return self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class PlacementPlan:
    """Slots per MoE layer in each tier, for one model, device and pair of budgets."""

    model_name: str
    device: str  # cpu | cuda
    num_moe_layers: int
    num_experts: int
    top_k: int
    block_size: int  # bytes of one expert block
    dense_bytes: int
    gpu_memory_limit: int | None
    l2_cache_size: int | None
    gpu_slots: int  # per layer; 0 on the CPU
    host_slots: int | None  # per layer; None: every expert through the memory map (no bounded host tier)

    @property
    def fully_resident(self) -> bool:
        """Every expert stays where the compute reads it: nothing to manage, the memory-mapped store serves."""
        if self.device == "cuda":
            return self.gpu_slots >= self.num_experts
        return self.host_slots is None or self.host_slots >= self.num_experts

    @property
    def expert_bytes(self) -> int:
        return self.num_moe_layers * self.num_experts * self.block_size

    def default_hit_rates(self) -> tuple[float, float]:
        """(GPU, host) hit rates if routing were uniform: slots / experts. Trained routers do better."""
        gpu = min(1.0, self.gpu_slots / self.num_experts)
        host = 1.0 if self.host_slots is None else min(1.0, self.host_slots / self.num_experts)
        return gpu, host

    def traffic(self, bandwidths: Bandwidths, gpu_hit: float, host_hit: float) -> list[PathLoad]:
        """Bytes per token on each path at batch 1: the compute reads the dense weights and top_k experts per
        layer; a GPU miss crosses PCIe, a host miss (bounded host tier) reads experts.bin."""
        active = self.num_moe_layers * self.top_k * self.block_size
        if self.device == "cuda":
            loads = [PathLoad("HBM (compute)", self.dense_bytes + active, bandwidths.hbm)]
            if not self.fully_resident:
                pinned = self.host_slots is not None
                loads.append(PathLoad("PCIe (host -> GPU)", active * (1 - gpu_hit),
                                      bandwidths.pcie_pinned if pinned else bandwidths.pcie_pageable))
                if pinned:
                    loads.append(PathLoad("disk (experts.bin)", active * (1 - gpu_hit) * (1 - host_hit),
                                          bandwidths.disk))
            return loads
        loads = [PathLoad("host RAM (compute)", self.dense_bytes + active, bandwidths.host_ram)]
        if not self.fully_resident:
            loads.append(PathLoad("disk (experts.bin)", active * (1 - host_hit), bandwidths.disk))
        return loads

    def tier_lines(self) -> list[str]:
        """Where experts live: one line per tier."""
        e, layers = self.num_experts, self.num_moe_layers
        head = (f"Expert placement of {self.model_name} on {self.device}: {layers} MoE layers x {e} experts "
                f"(top-{self.top_k}), {format_size(self.block_size)} per expert, "
                f"{format_size(self.expert_bytes)} of experts, {format_size(self.dense_bytes)} of dense weights")
        if self.fully_resident:
            where = "GPU memory" if self.device == "cuda" else "host memory (memory map of experts.bin)"
            return [head, f"  all {e} experts of every layer resident in {where}: no expert store to manage"]
        lines = [head]
        if self.device == "cuda":
            lines.append(f"  L1 GPU   {self.gpu_slots:>4} slots/layer  "
                         f"{format_size(self._slot_bytes(self.gpu_slots))} of --gpu-memory-limit "
                         f"{format_size(self.gpu_memory_limit)} (dense weights take {format_size(self.dense_bytes)})")
        if self.host_slots is None:
            lines.append(f"  L2 host  {e:>4} experts/layer memory map of experts.bin (pageable, page cache)")
        else:
            lines.append(f"  L2 host  {self.host_slots:>4} slots/layer  "
                         f"{format_size(self._slot_bytes(self.host_slots))} of --l2-cache-size "
                         f"{format_size(self.l2_cache_size)}")
            held = self.gpu_slots + self.host_slots
            lines.append(f"  L3 disk  {e:>4} experts/layer experts.bin, CRC32-checked reads; "
                         f"{max(0, e - held)} per layer live only there")
        return lines

    def _slot_bytes(self, slots: int) -> int:
        return (slots * self.num_moe_layers + 1) * self.block_size  # + the staging block

    @property
    def gpu_weight_bytes(self) -> int:
        """GPU memory of the dense weights and the expert slots (0 on the CPU)."""
        if self.device != "cuda":
            return 0
        return self.dense_bytes + (self.expert_bytes if self.fully_resident else self._slot_bytes(self.gpu_slots))

    def report(self, bandwidths: Bandwidths = Bandwidths(), gpu_hit: float | None = None,
               host_hit: float | None = None) -> str:
        """The full text: tiers, traffic per token at the given (or uniform-routing) hit rates, bottleneck."""
        default_gpu, default_host = self.default_hit_rates()
        rates = []
        if self.device == "cuda" and not self.fully_resident:
            rates.append(f"GPU {default_gpu if gpu_hit is None else gpu_hit:.1%}{'*' if gpu_hit is None else ''}")
        if self.host_slots is not None and not self.fully_resident:
            rates.append(f"host {default_host if host_hit is None else host_hit:.1%}{'*' if host_hit is None else ''}")
        gpu_hit = default_gpu if gpu_hit is None else gpu_hit
        host_hit = default_host if host_hit is None else host_hit
        lines = self.tier_lines()
        lines.append(f"Per token at batch 1{', hit rates ' + ', '.join(rates) if rates else ''}:")
        loads = self.traffic(bandwidths, gpu_hit, host_hit)
        for load in loads:
            lines.append(f"  {load.name:<20} {format_size(int(load.bytes_per_token)):>10}/token at "
                         f"{load.bandwidth / 1e9:,.1f} GB/s = {load.seconds * 1e3:8.3f} ms")
        worst = max(loads, key=lambda p: p.seconds)
        rate = f"{1 / worst.seconds:,.0f} tokens/s" if worst.seconds else "unbounded"
        lines.append(f"Bottleneck: {worst.name.split(' (')[0]} ({worst.seconds * 1e3:.3f} ms/token, at most {rate} "
                     f"per sequence)")
        if self.device == "cuda" and not self.fully_resident:
            misses = self.num_moe_layers * self.top_k * self.block_size * (1 - gpu_hit)
            both = bandwidths.host_ram + (bandwidths.pcie_pinned if self.host_slots is not None
                                          else bandwidths.pcie_pageable)
            hybrid = max(misses / both, loads[0].seconds)
            lines.append(f"With --cpu-experts auto (default) the CPU computes misses where they lie while PCIe "
                         f"moves others: {hybrid * 1e3:.3f} ms/token at best (at most {1 / hybrid:,.0f} tokens/s "
                         f"per sequence, host RAM and PCIe together)")
        if any(rate.endswith("*") for rate in rates):
            lines.append("* slots / experts, what uniform routing would give; trained routers do better "
                         "(benchmarks/policy_eval.py measures it), pass the measured rate")
        lines.append(f"Bandwidths assumed: {bandwidths.describe()} (defaults: measured on the H200 machine, disk "
                     f"cold, host RAM with 16 threads; --bw-* overrides)")
        return "\n".join(lines)


H200_MEMORY = 139 << 30  # bytes of GPU memory `colibri plan` assumes without --gpu-total-memory (the H200 machine)


def kv_report(config: ModelConfig, plan: PlacementPlan, cache: CacheConfig, dtype: str, host: MemoryInfo,
              gpu_total: int = H200_MEMORY, scheduler: SchedulerConfig = SchedulerConfig()) -> str:
    """KV bytes per token and the tokens the default cache size holds (kv_budget.py's rules) for a cache of storage
    `dtype` (model/paged_kv.py): on the GPU, `gpu_total` under gpu_memory_utilization less the plan's weights and
    expert slots and the activation reserve; on the CPU, a share of the host's available memory `host`. Layers
    with a window shorter than the model's context count apart: a fixed share per sequence, taken off first."""
    scheduler = scheduler.on_device(plan.device)
    context = config.max_position_embeddings
    sliding = SlidingLayers.of(config, context) if cache.sliding_window_pool else None
    num_sliding = 0 if sliding is None else len(sliding.layers)
    per_token = kv_bytes_per_token(config, dtype, config.num_layers - num_sliding)
    entry = (f"one row of latent {config.kv_lora_rank} + rope key {config.rotary_dim}" if config.attention == "mla"
             else f"keys and values x {config.num_kv_heads} KV heads x {config.head_dim} dims")
    lines = [f"KV cache in {dtype}: {format_size(per_token)} per token ({config.num_layers - num_sliding} layers x "
             f"{entry})"]
    pool = None
    if sliding is not None:
        block = cache.block_size * kv_bytes_per_token(config, dtype, num_sliding)
        pool = SlidingPool(sliding_pool_blocks(sliding.window, cache.block_size, scheduler.max_batch_size,
                                               scheduler.max_num_batched_tokens, cache.enable_prefix_caching),
                           kv_bytes_per_token(config, dtype, num_sliding))
        per_seq = sliding_blocks_per_seq(sliding.window, cache.block_size, 1) * block  # a decoding sequence's
        lines.append(f"  and {format_size(per_seq)} per sequence, whatever its length, in {num_sliding} sliding-window "
                     f"layers (window {sliding.window}): a pool of {format_size(pool.bytes(cache.block_size))} for "
                     f"{scheduler.max_batch_size} sequences")
    if plan.device == "cuda":
        reserve = activation_reserve(config, scheduler.max_num_batched_tokens)
        memory = MemoryInfo(max(0, gpu_total - plan.gpu_weight_bytes), gpu_total, host=False)
        budget = default_budget(memory, cache.gpu_memory_utilization, reserve)
        lines.append(f"  at most {format_size(budget)} for it: {cache.gpu_memory_utilization:g} of "
                     f"{format_size(gpu_total)} GPU memory (--gpu-total-memory), less "
                     f"{format_size(plan.gpu_weight_bytes)} of weights and expert slots and a {format_size(reserve)} "
                     f"activation reserve")
    else:
        budget = default_budget(host, cache.gpu_memory_utilization, 0)
        lines.append(f"  at most {format_size(budget)} for it: {HOST_KV_SHARE:g} of the {format_size(host.free)} of "
                     f"host memory available now")
    if per_token == 0:
        lines.append(f"  every layer has a window: any context of the model's {context:,} positions")
        return "\n".join(lines)
    try:  # the engine's own sizing: at most max_batch_size sequences of the model's context
        size = size_kv_cache(cache, per_token, context, None, scheduler.max_batch_size, budget, pool)
    except ConfigError as error:
        lines.append(f"  {error}")
        return "\n".join(lines)
    tokens = size.capacity_tokens
    if size.lowered_from is None:
        lines.append(f"  holds {tokens:,} tokens: {tokens // context:,} sequences of the model's {context:,} positions "
                     f"(at most --max-batch-size {scheduler.max_batch_size} of them)")
    else:
        lines.append(f"  holds {tokens:,} tokens, less than one sequence of the model's {context:,} positions: "
                     f"max_seq_len would be lowered to {size.max_seq_len:,} ({SIZE_FLAGS} change it)")
    return "\n".join(lines)


def make_plan(config: ModelConfig, dense_bytes: int, device: str, gpu_memory_limit: int | None = None,
              l2_cache_size: int | None = None, model_name: str = "the model") -> PlacementPlan:
    """Divide the budgets into per-layer slots; ConfigError when a bounded tier cannot hold one slot per layer."""
    _, block = expert_block_layout(config)
    layers, e = len(config.moe_layers), config.num_experts
    minimum = (layers + 1) * block  # one slot per layer and the staging block

    def slots(budget: int, flag: str) -> int:
        if budget < minimum:
            raise ConfigError(f"{flag} {format_size(budget)} is too small: one expert slot per MoE layer needs "
                              f"{layers} x {format_size(block)} plus a {format_size(block)} staging block "
                              f"= {format_size(minimum)}")
        return min(e, (budget // block - 1) // layers)

    gpu_slots = 0
    if device == "cuda":
        gpu_slots = e
        if gpu_memory_limit is not None:
            if gpu_memory_limit <= dense_bytes:
                raise ConfigError(f"--gpu-memory-limit {format_size(gpu_memory_limit)} does not even hold the "
                                  f"dense weights ({format_size(dense_bytes)})")
            gpu_slots = slots(gpu_memory_limit - dense_bytes, "--gpu-memory-limit minus the dense weights,")
    host_slots = None if l2_cache_size is None else slots(l2_cache_size, "--l2-cache-size")
    return PlacementPlan(model_name, device, layers, e, config.top_k, block, dense_bytes, gpu_memory_limit,
                         l2_cache_size, gpu_slots, host_slots)


def plan_for_folder(folder: str | os.PathLike, device: str, gpu_memory_limit: int | None = None,
                    l2_cache_size: int | None = None) -> PlacementPlan:
    """The plan of a model folder, read from its config.json and the size of its dense file."""
    folder = Path(folder)
    config = read_config(folder)
    dense = folder / config.dense_file
    dense_bytes = dense.stat().st_size if dense.is_file() else 0
    return make_plan(config, dense_bytes, device, gpu_memory_limit, l2_cache_size, folder.resolve().name)

