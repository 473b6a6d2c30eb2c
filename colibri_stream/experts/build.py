"""Builds the expert store of a model folder from the engine's ExpertStoreConfig and logs its placement plan.

Every budget, policy and file problem is raised here, at start, as a ConfigError: a request never finds out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..checkpoint import ModelFolder
from ..config import ExpertStoreConfig
from ..errors import ConfigError
from ..plan import make_plan
from .expert_parallel import shard_config
from .policies import make_policy
from .prefetcher import Prefetcher
from .store import ExpertStore, MappedExpertStore
from .tiers import BlockReader, HostTier, TieredExpertStore, kvikio_available
from .trace import USAGE_FILE, RoutingRecorder, read_usage

logger = logging.getLogger(__name__)


def open_expert_store(folder: ModelFolder, options: ExpertStoreConfig, device: str,
                      shard: range | None = None) -> ExpertStore:
    """The store for `folder` on `device` ("cpu" or "cuda"): memory-mapped when every expert fits its tier,
    otherwise tiered; wrapped in a RoutingRecorder when a trace or usage file is asked for. With a `shard` (the
    expert ids of a rank of an expert-parallel group) the store holds those experts only, numbered from 0 in every
    MoE layer, and must be resident (the budgets of a tiered store are refused)."""
    config = folder.config
    if options.gpu_memory_limit is not None and device != "cuda":
        logger.warning("--gpu-memory-limit is ignored: experts run on the CPU, there is no GPU tier")
    plan = make_plan(config if shard is None else shard_config(config, shard),
                     (folder.path / config.dense_file).stat().st_size, device, options.gpu_memory_limit,
                     options.l2_cache_size, folder.path.resolve().name)
    if shard is not None and not plan.fully_resident:
        raise ConfigError("an expert-parallel rank keeps its shard's experts resident: drop --gpu-memory-limit and "
                          "--l2-cache-size")
    usage = None
    if options.eviction_policy == "pinned" and not plan.fully_resident:
        usage, _ = read_usage(options.usage_file or folder.path / USAGE_FILE, config)
    for line in plan.report().splitlines():
        logger.info(line)
    if shard is not None:
        logger.info("  this expert-parallel rank's shard: the model's experts %d-%d of %d, numbered 0-%d",
                    shard.start, shard.stop - 1, config.num_experts, len(shard) - 1)
    if plan.fully_resident:
        store: ExpertStore = MappedExpertStore(folder.experts, shard)
    elif device == "cuda":
        store = _gpu_store(folder, options, plan.gpu_slots, plan.host_slots, usage)
    else:
        store = _tiered_store(folder, options, plan.host_slots, usage)
    if options.routing_trace is not None or options.usage_file is not None:
        store = RoutingRecorder(store, config, options.routing_trace, options.usage_file)
    return store


def _policies(folder: ModelFolder, options: ExpertStoreConfig, usage: np.ndarray | None) -> list:
    config = folder.config
    return [make_policy(options.eviction_policy, config.num_experts, None if usage is None else usage[rank])
            for rank in range(len(config.moe_layers))]


def _prefetcher(folder: ModelFolder, options: ExpertStoreConfig, usage: np.ndarray | None) -> Prefetcher | None:
    config = folder.config
    prefetcher = None
    if options.prefetch:
        routers = [folder.dense.get(f"layers.{layer}.router") for layer in config.moe_layers]  # [E, H] each
        prefetcher = Prefetcher(routers, config.top_k, options.prefetch_lookahead)
    logger.info("  eviction %s%s; prefetch %s", options.eviction_policy,
                f" (ranked by {Path(options.usage_file or folder.path / USAGE_FILE).name})" if usage is not None
                else "", f"{options.prefetch_lookahead} MoE layer(s) ahead" if prefetcher else "off")
    return prefetcher


def _tiered_store(folder: ModelFolder, options: ExpertStoreConfig, slots_per_layer: int,
                  usage: np.ndarray | None) -> TieredExpertStore:
    tier = HostTier(folder.experts, slots_per_layer * len(folder.config.moe_layers))
    return TieredExpertStore(folder.experts, tier, slots_per_layer, _policies(folder, options, usage),
                             _prefetcher(folder, options, usage))


def _gpu_store(folder: ModelFolder, options: ExpertStoreConfig, gpu_slots: int, host_slots: int | None,
               usage: np.ndarray | None) -> ExpertStore:
    """GPU slots in front of pinned host memory (every expert, or `host_slots` per layer) or of experts.bin.
    Failing to get the pinned or GPU memory is a ConfigError here, at start."""
    import cupy

    from .cpu_executor import CpuExpertExecutor, threads_beside_gpu
    from .gpu_tier import GpuTieredStore
    from .pinned import PinnedExperts, pinned_empty
    from .slots import layer_slot_counts

    config, experts = folder.config, folder.experts
    reader = BlockReader(experts, use_kvikio=kvikio_available())
    logger.info("  blocks read from %s with %s; misses computed on the CPU: %s", experts.path.name,
                reader.library, options.cpu_experts)
    try:
        if host_slots is None:
            host = None
        elif host_slots >= config.num_experts:
            host = PinnedExperts(experts, reader)
        else:
            tier = HostTier(experts, host_slots * len(config.moe_layers), allocate=pinned_empty, reader=reader)
            host = TieredExpertStore(experts, tier, host_slots, _policies(folder, options, usage))
        threads = options.cpu_threads or threads_beside_gpu()
        executor = None if options.cpu_experts == "off" else CpuExpertExecutor(threads)
        slots = layer_slot_counts(gpu_slots, len(config.moe_layers), config.num_experts, options.gpu_slot_layout)
        logger.info("  GPU slots of each MoE layer (%s): %s", options.gpu_slot_layout, slots)
        return GpuTieredStore(experts, slots, _policies(folder, options, usage), host, reader,
                              _prefetcher(folder, options, usage), executor, options.cpu_experts)
    except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError) as error:
        raise ConfigError(f"the expert tiers do not fit this machine ({error}): lower --gpu-memory-limit or "
                          f"--l2-cache-size") from error
