"""A MoE layer's routed experts on the NumPy backend: one CpuLayerWorker call against the executor expert by expert.

Writes a one-layer random model of a real shape (`write_synthetic_folder`: experts.bin memory-mapped, as `colibri
serve --device cpu` reads it), then times `NumpyBackend.routed_experts` at several token counts with random
routing, the two ways alternating, after a warm-up that brings experts.bin into the page cache. Prints ms per layer
and the weight bytes read per second; writes JSON.

    python benchmarks/cpu_moe_layer.py --shape qwen3-30b-a3b --tokens 1 4 16 \
        --out benchmarks/results/cpu_moe_layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.checkpoint import ModelFolder
from colibri_stream.experts.store import MappedExpertStore
from colibri_stream.synthetic import write_synthetic_folder


def timed(backend: NumpyBackend, store, config, tokens: int, rng: np.random.Generator) -> tuple[float, int]:
    """(seconds, distinct experts) of one layer's routed experts for `tokens` random tokens."""
    x = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)  # [T, H]
    ids = np.stack([rng.choice(config.num_experts, config.top_k, replace=False) for _ in range(tokens)])  # [T, k]
    weights = rng.uniform(0.05, 0.3, ids.shape).astype(np.float32)  # [T, k]
    begin = time.perf_counter()
    backend.routed_experts(x, weights, ids.astype(np.int64), config.moe_layers[0], store)
    return time.perf_counter() - begin, len(np.unique(ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--folder", default="/tmp/colibri-cpu-moe-layer")
    parser.add_argument("--out", default="benchmarks/results/cpu_moe_layer.json")
    args = parser.parse_args(argv)
    path = Path(args.folder) / args.shape
    if not (path / "experts.bin").exists():
        write_synthetic_folder(path, args.shape, num_layers=1)
    folder = ModelFolder(path)
    config, store = folder.config, MappedExpertStore(folder.experts)
    backends = {"worker": NumpyBackend(), "per_expert": NumpyBackend(layer_worker=False)}
    expert_bytes = sum(t.nbytes for t in store.expert(0, 0).values())
    rng = np.random.default_rng(0)
    for backend in backends.values():  # warm: page cache, compiled kernels, the worker
        for _ in range(3):
            timed(backend, store, config, config.num_experts // config.top_k, rng)
    records = []
    for tokens in args.tokens:
        runs: dict[str, list[float]] = {name: [] for name in backends}
        read: dict[str, list[float]] = {name: [] for name in backends}
        for _ in range(args.rounds):
            for name, backend in backends.items():
                seconds, experts = timed(backend, store, config, tokens, rng)
                runs[name].append(seconds)
                read[name].append(experts * expert_bytes / seconds)
        figures = {name: {"ms_per_layer": 1e3 * statistics.median(runs[name]),
                          "gb_s": statistics.median(read[name]) / 1e9} for name in backends}
        figures["speedup"] = figures["per_expert"]["ms_per_layer"] / figures["worker"]["ms_per_layer"]
        print(f"{args.shape} T={tokens}: " + ", ".join(
            f"{n} {f['ms_per_layer']:.2f} ms ({f['gb_s']:.1f} GB/s)" for n, f in figures.items() if n != "speedup")
            + f", worker {figures['speedup']:.2f}x", flush=True)
        records.append({"bench": "cpu_moe_layer", "commit": os.environ.get("COLIBRI_COMMIT", "unknown"),
                        "command": " ".join(sys.argv), "cpu_cores": os.cpu_count(), "machine": platform.machine(),
                        "python": platform.python_version(), "shape": args.shape, "tokens": tokens,
                        "executor_threads": backends["worker"].experts.num_threads, "expert_bytes": expert_bytes,
                        "figures": figures})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
