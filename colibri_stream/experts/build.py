"""Builds the expert store of a model folder from the engine's ExpertStoreConfig and logs its placement plan.

Every budget, policy and file problem is raised here, at start, as a ConfigError: a request never finds out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..checkpoint import ModelFolder
from ..config import ConfigError, ExpertStoreConfig
from ..plan import make_plan
from .policies import make_policy
from .prefetcher import Prefetcher
from .store import ExpertStore, MappedExpertStore
from .tiers import HostTier, TieredExpertStore
from .trace import USAGE_FILE, RoutingRecorder, read_usage

logger = logging.getLogger(__name__)


def open_expert_store(folder: ModelFolder, options: ExpertStoreConfig, device: str) -> ExpertStore:
    """The store for `folder` on `device` ("cpu" or "cuda"): memory-mapped when every expert fits its tier,
    otherwise tiered; wrapped in a RoutingRecorder when a trace or usage file is asked for."""
    config = folder.config
    if options.gpu_memory_limit is not None and device != "cuda":
        logger.warning("--gpu-memory-limit is ignored: experts run on the CPU, there is no GPU tier")
    plan = make_plan(config, (folder.path / config.dense_file).stat().st_size, device, options.gpu_memory_limit,
                     options.l2_cache_size, folder.path.resolve().name)
    usage = None
    if options.eviction_policy == "pinned" and not plan.fully_resident:
        usage, _ = read_usage(options.usage_file or folder.path / USAGE_FILE, config)
    for line in plan.report().splitlines():
        logger.info(line)
    if plan.fully_resident:
        store: ExpertStore = MappedExpertStore(folder.experts)
    elif device == "cuda":
        raise ConfigError("expert slots on the GPU are not implemented yet: leave out --gpu-memory-limit (every "
                          "expert in GPU memory) or run on the CPU with --device cpu --l2-cache-size")
    else:
        store = _tiered_store(folder, options, plan.host_slots, usage)
    if options.routing_trace is not None or options.usage_file is not None:
        if device == "cuda":  # the GPU backend replaces the store by its own resident one
            raise ConfigError("--routing-trace and --usage-file record on the CPU only for now: use --device cpu")
        store = RoutingRecorder(store, config, options.routing_trace, options.usage_file)
    return store


def _tiered_store(folder: ModelFolder, options: ExpertStoreConfig, slots_per_layer: int,
                  usage: np.ndarray | None) -> TieredExpertStore:
    config = folder.config
    policies = [make_policy(options.eviction_policy, config.num_experts, None if usage is None else usage[rank])
                for rank in range(len(config.moe_layers))]
    prefetcher = None
    if options.prefetch:
        routers = [folder.dense.get(f"layers.{layer}.router") for layer in config.moe_layers]  # [E, H] each
        prefetcher = Prefetcher(routers, config.top_k, options.prefetch_lookahead)
    logger.info("  eviction %s%s; prefetch %s", options.eviction_policy,
                f" (ranked by {Path(options.usage_file or folder.path / USAGE_FILE).name})" if usage is not None
                else "", f"{options.prefetch_lookahead} MoE layer(s) ahead" if prefetcher else "off")
    tier = HostTier(folder.experts, slots_per_layer * len(config.moe_layers))
    return TieredExpertStore(folder.experts, tier, slots_per_layer, policies, prefetcher)
