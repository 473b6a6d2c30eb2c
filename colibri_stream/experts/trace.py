"""Routing records: a trace file of every step's routing, and the usage file that the pinned policy reads.

Trace file (JSON lines), one line per MoE layer and step:

    {"step": 12, "layer": 3, "experts": [[5, 1], [0, 5]]}     experts: [tokens of the step, top_k] in router order

Usage file (JSON), routes per expert summed over earlier runs; `usage_file` both seeds the pinned policy and, when
given, receives this run's routes (merged, rewritten every `USAGE_SAVE_STEPS` steps and at exit):

    {"format": "colibri-expert-usage", "num_experts": 32, "steps": 4096, "layers": {"0": [routes per expert], ...}}
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import IO

import numpy as np

from ..config import ModelConfig
from .stats import ExpertStats
from .store import ExpertStore
from ..errors import ConfigError

USAGE_FORMAT = "colibri-expert-usage"
USAGE_FILE = "expert_usage.json"  # the default usage file, next to the model's config.json
USAGE_SAVE_STEPS = 256


def read_usage(path: str | os.PathLike, config: ModelConfig) -> tuple[np.ndarray, int]:
    """Routes per expert of a usage file -> (counts [num_moe_layers, E] int64, steps); ConfigError when it does
    not exist or does not fit the model."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"usage file {path} does not exist: record one with --usage-file on an earlier run, "
                          f"or with benchmarks/policy_eval.py --write-usage") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"usage file {path} is not readable JSON ({exc})") from None
    if not _describes(data, config):
        raise ConfigError(f"usage file {path} does not describe this model's MoE layers "
                          f"({len(config.moe_layers)} layers of {config.num_experts} experts, counts that are "
                          "integers from 0)")
    counts = np.array([data["layers"][str(layer)] for layer in config.moe_layers], np.int64)  # [layers, E]
    return counts, int(data.get("steps", 0))


def _describes(data: object, config: ModelConfig) -> bool:
    """Whether a usage file's JSON is one of this model: its format and expert count, a list of counts (int64
    integers from 0) per expert of every MoE layer and of no other, and an integer step count."""
    if not isinstance(data, dict) or data.get("format") != USAGE_FORMAT:
        return False
    layers = data.get("layers")
    if data.get("num_experts") != config.num_experts or not isinstance(layers, dict) \
            or set(layers) != {str(layer) for layer in config.moe_layers}:
        return False
    return _is_count(data.get("steps", 0)) and all(
        isinstance(row, list) and len(row) == config.num_experts and all(map(_is_count, row))
        for row in layers.values())


def _is_count(value: object) -> bool:
    """A JSON integer from 0 that fits an int64 (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def write_usage(path: str | os.PathLike, config: ModelConfig, counts: np.ndarray, steps: int) -> None:
    """Write routes per expert (counts [num_moe_layers, E]) atomically."""
    path = Path(path)
    data = {"format": USAGE_FORMAT, "num_experts": config.num_experts, "steps": int(steps),
            "layers": {str(layer): [int(c) for c in row] for layer, row in zip(config.moe_layers, counts)}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def read_trace(path: str | os.PathLike, config: ModelConfig) -> list[list[list[int]]]:
    """A trace file as replay input: per MoE-layer rank, per step, the sorted distinct experts of the step."""
    rank = {layer: r for r, layer in enumerate(config.moe_layers)}
    steps: list[dict[int, list[int]]] = [{} for _ in config.moe_layers]  # rank -> step -> experts
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            steps[rank[record["layer"]]][record["step"]] = sorted({e for token in record["experts"] for e in token})
    return [[by_step[s] for s in sorted(by_step)] for by_step in steps]


class _UsageCounter:
    """This run's routes added to an earlier usage file, saved every USAGE_SAVE_STEPS steps and at exit."""

    def __init__(self, path: Path, config: ModelConfig):
        self.path, self.config = path, config
        if path.exists():
            self.base, self.base_steps = read_usage(path, config)
        else:
            self.base, self.base_steps = np.zeros((len(config.moe_layers), config.num_experts), np.int64), 0
            write_usage(path, config, self.base, 0)  # fails now, not at the first save, if the path is unwritable
        self.counts = np.zeros_like(self.base)  # [layers, E] this run's routes
        self.steps = 0  # this run's steps

    def save(self) -> None:
        write_usage(self.path, self.config, self.base + self.counts, self.base_steps + self.steps)


class RoutingRecorder(ExpertStore):
    """Wraps a store and records its routing: a trace file, usage counts, or both.

    On the GPU it wraps the backend's device store (`device_experts` hands it on) and copies each layer's routing
    to the host, one synchronisation per MoE layer: a step that records is never captured as a CUDA graph
    (`capturable` stays False).
    """

    def __init__(self, inner: ExpertStore, config: ModelConfig, trace_file: str | None = None,
                 usage_file: str | None = None):
        self.inner = inner
        self._rank = {layer: r for r, layer in enumerate(config.moe_layers)}
        self._step = -1
        self._last_rank = len(config.moe_layers)
        self._trace: IO[str] | None = None
        if trace_file is not None:
            try:
                self._trace = open(trace_file, "w")
            except OSError as exc:
                raise ConfigError(f"cannot write the routing trace {trace_file}: {exc.strerror}") from None
        self._usage = _UsageCounter(Path(usage_file), config) if usage_file is not None else None
        self._finalizer = weakref.finalize(self, RoutingRecorder._finish, self._trace, self._usage)

    def begin_layer(self, layer: int, x, expert_ids, weights=None) -> None:
        rank = self._rank[layer]
        if rank <= self._last_rank:
            self._new_step()
        self._last_rank = rank
        # The inner store first: a GPU store takes in the previous layer's CPU work before anything waits on the
        # stream (which may be held until that work ends).
        self.inner.begin_layer(layer, x, expert_ids, weights)
        ids = expert_ids.get() if hasattr(expert_ids, "get") else np.asarray(expert_ids)  # [T, k] on the host
        if self._usage is not None:
            np.add.at(self._usage.counts[rank], ids.reshape(-1), 1)
        if self._trace is not None:
            self._trace.write(json.dumps({"step": self._step, "layer": layer, "experts": ids.tolist()}) + "\n")
            if rank == len(self._rank) - 1:  # the step's last MoE layer: its records are complete
                self._trace.flush()

    def _new_step(self) -> None:
        self._step += 1
        if self._usage is not None:
            if self._step and self._step % USAGE_SAVE_STEPS == 0:
                self._usage.save()
            self._usage.steps = self._step + 1

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return self.inner.expert(layer, expert)

    @property
    def timer(self):
        return self.inner.timer

    @timer.setter
    def timer(self, value) -> None:
        self.inner.timer = value

    def device_experts(self):
        return self.inner.device_experts()

    def on_device(self, upload) -> ExpertStore:
        self.inner = self.inner.on_device(upload)
        return self

    def stats(self) -> ExpertStats | None:
        return self.inner.stats()

    def flush(self) -> None:
        if self._trace is not None:
            self._trace.flush()
        if self._usage is not None:
            self._usage.save()
        self.inner.flush()

    def close(self) -> None:
        """Close the trace, save the usage counts, then close the store it records."""
        self._finalizer()
        self.inner.close()

    @staticmethod
    def _finish(trace: IO[str] | None, usage: _UsageCounter | None) -> None:
        if trace is not None:
            trace.close()
        if usage is not None:
            usage.save()

