"""Where the engines of one server run and which of them takes a request: shared by data-parallel replicas
(`replicas.py`) and the ranks of an expert-parallel group (`group_core.py`, `expert_group.py`).

- Devices: `visible_gpus` (found without initializing CUDA) and `replica_environments`, each engine process's
  CUDA_VISIBLE_DEVICES (one GPU each) or its share of the CPU's cores.
- Routing: `ReplicaRouter` sends a request to the least loaded engine (`ReplicaLoad`: sequences in flight and
  prompt tokens not yet prefilled), or back to the engine its prompt's first KV block was last sent to while that
  one's load is within PREFIX_AFFINITY_SLACK of the least (its prefix cache probably still holds it).
- `summed_stats`: engines' snapshots as one.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, fields

from .engine import EngineStats
from .errors import ConfigError

PROMPT_TOKENS_PER_SEQUENCE = 512  # outstanding prompt tokens that weigh as much load as one running sequence
PREFIX_AFFINITY_SLACK = 4.0  # a prompt goes back to the replica holding its prefix unless that replica's load
#                              exceeds the least loaded one's by more than this (in sequences)
PREFIX_MEMORY = 65536  # prefix keys remembered (least recently sent forgotten first)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), found without
    initializing CUDA: the variable when set, else the host's /dev/nvidiaN devices."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [name.strip() for name in given.split(",") if name.strip() and name.strip() != "-1"]
    return sorted((name[len("nvidia"):] for name in os.listdir("/dev") if name[len("nvidia"):].isdigit()
                   and name.startswith("nvidia")), key=int) if os.path.isdir("/dev") else []


def replica_environments(count: int, device: str, cpu_threads: int | None, gpus: list[str],
                         option: str = "data_parallel",
                         unit: str = "replica") -> tuple[list[dict[str, str]], int | None]:
    """The process environment of each of `count` engine processes (data-parallel replicas, or the ranks of an
    expert-parallel group: `option` and `unit` name them in errors) and the cpu_threads each runs with. device: the
    engine option ("auto" uses the GPUs when there are any). Raises ConfigError for a count below 1 and for more
    processes than GPUs."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{option} must be a whole number of at least 1, got {count!r}")
    if on_gpus(device, gpus):
        if count > len(gpus):
            raise ConfigError(f"--{option.replace('_', '-')} {count} needs {count} GPUs, one per {unit}; "
                              f"{len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")
        return [{"CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(count)], cpu_threads
    threads = cpu_threads or max(1, (os.cpu_count() or 1) // count)
    blas = {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return [dict(blas, CUDA_VISIBLE_DEVICES="") for _ in range(count)], threads


def on_gpus(device: str, gpus: list[str]) -> bool:
    """Whether engines of the `device` option run on GPUs, `gpus` being those visible ("auto": where there are)."""
    return device == "cuda" or (device == "auto" and bool(gpus))


def summed_stats(snapshots: list[EngineStats], greatest: tuple[str, ...] = ("last_step_time",)) -> EngineStats:
    """Engines' snapshots as one: each figure summed, those named in `greatest` the largest of them."""
    return EngineStats(**{f.name: (max if f.name in greatest else sum)(getattr(s, f.name) for s in snapshots)
                          for f in fields(EngineStats)})


@dataclass
class ReplicaLoad:
    """Work sent to one replica and not done: its requests' sequences until they finish, their prompt tokens
    until the first output (the prefill is then done)."""

    sequences: int = 0
    prompt_tokens: int = 0

    @property
    def value(self) -> float:
        """The load in sequences: running sequences plus prompt tokens at PROMPT_TOKENS_PER_SEQUENCE."""
        return self.sequences + self.prompt_tokens / PROMPT_TOKENS_PER_SEQUENCE


class ReplicaRouter:
    """Picks the replica for each request: least loaded, or the one its prefix was last sent to while that one's
    load is within PREFIX_AFFINITY_SLACK of the least. block_size: tokens per KV block (the prefix key is the
    prompt's first whole block; a shorter prompt caches nothing and goes by load alone)."""

    def __init__(self, num_replicas: int, block_size: int):
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self._block_size = block_size
        self._last_replica: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix key -> replica

    def prefix_key(self, prompt_token_ids: list[int]) -> tuple[int, ...] | None:
        if len(prompt_token_ids) < self._block_size:
            return None
        return tuple(prompt_token_ids[:self._block_size])

    def choose(self, prompt_token_ids: list[int], candidates: list[int]) -> int:
        """The replica (one of `candidates`, not empty) for a prompt; remembers it for the prompt's prefix."""
        least = min(candidates, key=lambda i: (self.loads[i].value, i))
        key = self.prefix_key(prompt_token_ids)
        chosen = least
        if key is not None:
            cached = self._last_replica.get(key)
            if (cached in candidates
                    and self.loads[cached].value <= self.loads[least].value + PREFIX_AFFINITY_SLACK):
                chosen = cached
            self._last_replica[key] = chosen
            self._last_replica.move_to_end(key)
            if len(self._last_replica) > PREFIX_MEMORY:
                self._last_replica.popitem(last=False)
        return chosen
