"""Expert placement on a trained model: eviction policies against Belady's optimum, and next-layer prefetch recall.

Everything runs on the CPU with the shipped default model (8 MoE layers x 32 experts, top-4) and its real routing:

1. Replay: the recorded routing of 4 held-out windows of 1024 tokens (benchmarks/data/default_model/traces_test.npz)
   through LRU, LFU with decay, pinned (ranked by usage from the other three windows, or by the routes of the whole
   test split from the training run's results) and Belady's MIN, at 2, 4, 8 and 16 slots of 32 per layer. Decode
   of one sequence per window (each token one step, a cold cache per window), and the 4 windows decoded together
   (batch 4: a step's experts are the union of 4 tokens'). Plus a sweep of the LFU decay.
2. Prefetch recall: the model runs each window (one prefill, the hidden states captured at every MoE layer) and
   the Prefetcher predicts layer l+d from layer l's MoE input, d = 1, 2, 3; recall = predicted ∩ used / used per
   token, per layer.
3. The store at run time: decode of the first --decode-tokens tokens of each window (teacher-forced) through
   TieredExpertStore at 4 and 8 slots, with and without prefetch. Checks that every step's logits equal the
   resident model's, and that without prefetch the store's hits equal the replay of the routing it recorded.

    python benchmarks/policy_eval.py [--decode-tokens 256] [--window-tokens 1024] [--write-usage PATH]

Results: benchmarks/results/policy_eval.json; the tables are printed as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.checkpoint import ModelFolder, default_model_path, expert_block_layout
from colibri_stream.config import ExpertStoreConfig
from colibri_stream.experts.policies import LFUDecayPolicy
from colibri_stream.experts.prefetcher import Prefetcher
from colibri_stream.experts.replay import replay, replay_policy
from colibri_stream.experts.store import MappedExpertStore
from colibri_stream.experts.trace import read_trace, write_usage
from colibri_stream.loader import load_model
from colibri_stream.model import MoETransformer
from colibri_stream.batch import single_sequence_batch

ROOT = Path(__file__).resolve().parent
TRACES = ROOT / "data" / "default_model" / "traces_test.npz"
RUN_RESULTS = ROOT / "data" / "default_model" / "runs" / "moe_s1536_wd0.5.json"
RESULTS = ROOT / "results" / "policy_eval.json"
BUDGETS = (2, 4, 8, 16)
STORE_BUDGETS = (4, 8)
DECAYS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
KV_BLOCK = 16
MODES = {"batch 1": "each window decoded alone from a cold cache", "batch 4": "the 4 windows decoded together"}


def layer_steps(ids: np.ndarray) -> list[list[int]]:
    """[T, k] routing of consecutive steps -> the sorted distinct experts of each step."""
    return [sorted(set(row)) for row in ids.tolist()]


def replay_rate(per_layer_steps: list[list[list[int]]], policy: str, slots: int,
                usage: list[np.ndarray] | None = None) -> tuple[float, list[float]]:
    """Hit rate over all layers (and per layer) of one replay per entry of `per_layer_steps` ([layer][run])."""
    per_layer = []
    hits = total = 0
    for rank, runs in enumerate(per_layer_steps):
        layer_hits = layer_total = 0
        for run, steps in enumerate(runs):
            result = replay(steps, replay_policy(policy, steps, 32, None if usage is None else usage[run][rank]),
                            slots)
            layer_hits += result.hits
            layer_total += result.hits + result.misses
        per_layer.append(layer_hits / layer_total)
        hits, total = hits + layer_hits, total + layer_total
    return hits / total, per_layer


def replay_tables(ids: np.ndarray) -> dict:
    """ids [S, L, T, K] -> hit rates per batch mode, budget and policy, and the LFU decay sweep."""
    windows, layers = ids.shape[:2]
    single = [[layer_steps(ids[s, l]) for s in range(windows)] for l in range(layers)]  # [layer][window]
    batched = [[[sorted(set(ids[:, l, t].ravel().tolist())) for t in range(ids.shape[2])]] for l in range(layers)]
    # usage "from earlier runs": the other windows' routes (leave one out), or the test split's load shares
    loo = [[np.bincount(np.concatenate([ids[o, l].ravel() for o in range(windows) if o != s]), minlength=32)
            for l in range(layers)] for s in range(windows)]
    shares = json.loads(RUN_RESULTS.read_text())["test_bf16"]["routing"]["layers"]
    split = [[np.array(shares[l]["load_share"]) for l in range(layers)]] * windows
    modes = {
        "batch 1": (single, {"lru": None, "lfu": None, "pinned (other windows)": loo, "pinned (test split)": split,
                             "belady": None}),
        "batch 4": (batched, {"lru": None, "lfu": None, "pinned (test split)": split[:1], "belady": None}),
    }
    tables = {}
    for mode, (steps, policies) in modes.items():
        tables[mode] = {slots: {name: dict(zip(("hit_rate", "per_layer"),
                                               replay_rate(steps, name.split(" ")[0], slots, usage)))
                                for name, usage in policies.items()}
                        for slots in BUDGETS}
    sweep = {}
    for slots in BUDGETS:
        sweep[slots] = {}
        for decay in DECAYS:
            hits = total = 0
            for runs in single:
                for steps in runs:
                    result = replay(steps, LFUDecayPolicy(32, decay), slots)
                    hits, total = hits + result.hits, total + result.hits + result.misses
            sweep[slots][decay] = hits / total
    return {"replay": tables, "lfu_decay_sweep": sweep}


class CaptureStore(MappedExpertStore):
    """The resident store, keeping each MoE layer's input and routing of the last step."""

    def __init__(self, folder: ModelFolder):
        super().__init__(folder.experts)
        self.x: dict[int, np.ndarray] = {}  # layer -> [T, H]
        self.ids: dict[int, np.ndarray] = {}  # layer -> [T, k]

    def begin_layer(self, layer, x, expert_ids, weights=None):
        self.x[layer], self.ids[layer] = np.array(x), np.array(expert_ids)


def prefetch_recall(folder: ModelFolder, tokens: np.ndarray, trace_ids: np.ndarray, max_distance: int = 3) -> dict:
    """Per-token recall of the Prefetcher at distances 1..max_distance, per layer, from one prefill per window."""
    config = folder.config
    capture = CaptureStore(folder)
    model = MoETransformer(config, folder.dense, capture, NumpyBackend())
    prefetcher = Prefetcher([folder.dense.get(f"layers.{l}.router") for l in config.moe_layers], config.top_k,
                            lookahead=max_distance)
    layers = len(config.moe_layers)
    hits = np.zeros((max_distance + 1, layers))  # [distance, layer]
    used = np.zeros(layers)
    agree = []
    for window, window_tokens in enumerate(tokens):
        blocks = -(-len(window_tokens) // KV_BLOCK)
        kv = model.allocate_kv_cache(blocks, KV_BLOCK)
        model.forward(single_sequence_batch(window_tokens.astype(np.int64), 0, np.arange(blocks), KV_BLOCK), kv)
        ids = np.stack([capture.ids[l] for l in config.moe_layers])  # [L, T, k]
        agree.append(np.mean([set(a) == set(b) for a, b in zip(ids.reshape(-1, config.top_k).tolist(),
                                                               trace_ids[window].reshape(-1, config.top_k).tolist())]))
        used += ids.shape[1] * config.top_k
        for t in range(ids.shape[1]):
            for rank, layer in enumerate(config.moe_layers):
                for target, ranked in prefetcher.predict(rank, capture.x[layer][t : t + 1]):
                    hits[target - rank, target] += len(set(ranked) & set(ids[target, t].tolist()))
    recall = {d: [None if r < d else hits[d, r] / used[r] for r in range(layers)] for d in range(1, max_distance + 1)}
    mean = {d: float(np.mean([v for v in recall[d] if v is not None])) for d in recall}
    return {"per_layer": recall, "mean": mean, "routing_agreement_with_trace": float(np.mean(agree))}


def decode(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Teacher-forced decode, one token per step -> logits [1, V] of every step."""
    blocks = -(-len(tokens) // KV_BLOCK)
    kv = model.allocate_kv_cache(blocks, KV_BLOCK)
    table = np.arange(blocks)
    return [model.forward(single_sequence_batch(tokens[i : i + 1], i, table, KV_BLOCK), kv)
            for i in range(len(tokens))]


def store_runs(path: Path, tokens: np.ndarray, decode_tokens: int) -> list[dict]:
    """The tiered store decoding each window's first tokens, against the resident model and the replay."""
    folder = ModelFolder(path)
    config = folder.config
    block = expert_block_layout(config)[1]
    windows = [w[:decode_tokens].astype(np.int64) for w in tokens]
    resident = load_model(str(path))
    reference = [decode(resident, w) for w in windows]
    runs = []
    for slots in STORE_BUDGETS:
        for policy in ("lru", "lfu"):
            for prefetch in (False, True):
                stats, recorded, seconds, exact = [], [], 0.0, True
                with tempfile.TemporaryDirectory() as tmp:
                    for w, window in enumerate(windows):
                        trace = Path(tmp) / f"trace{w}.jsonl"
                        options = ExpertStoreConfig(l2_cache_size=(slots * len(config.moe_layers) + 1) * block,
                                                    eviction_policy=policy, prefetch=prefetch,
                                                    routing_trace=str(trace))
                        model = load_model(str(path), experts=options)
                        start = time.perf_counter()
                        logits = decode(model, window)
                        seconds += time.perf_counter() - start
                        model.store.flush()
                        exact &= all(np.array_equal(a, b) for a, b in zip(logits, reference[w]))
                        stats.append(model.store.stats())
                        recorded.append(read_trace(trace, config))
                host_hits = sum(s.tiers["host"].hits for s in stats)
                host_total = host_hits + sum(s.tiers["host"].misses for s in stats)
                replayed = [replay(layer, replay_policy(policy, layer, 32), slots)
                            for run in recorded for layer in run]
                used = sum(int(s.used.sum()) for s in stats)
                covered = sum(int(s.predicted_used.sum()) for s in stats)
                covered_used = sum(int(s.used[s.predicted > 0].sum()) for s in stats)
                steps = len(windows) * decode_tokens
                runs.append({
                    "slots": slots, "policy": policy, "prefetch": prefetch,
                    "logits_equal_resident": bool(exact),
                    "host_hit_rate": host_hits / host_total,
                    "replay_hit_rate": sum(r.hits for r in replayed) / sum(r.hits + r.misses for r in replayed),
                    "prefetch_recall": covered / covered_used if prefetch else None,
                    "disk_bytes_per_token": sum(s.tiers["disk"].bytes_read for s in stats) / steps,
                    "prefetch_wasted_bytes_per_token": sum(s.prefetch_wasted_bytes for s in stats) / steps,
                    "stall_ms_per_token": 1e3 * sum(s.stall_seconds for s in stats) / steps,
                    "ms_per_token": 1e3 * seconds / steps,
                    "distinct_experts_per_token": used / steps,
                })
    return runs


def markdown(results: dict) -> str:
    lines = []
    for mode, table in results["replay"].items():
        names = list(next(iter(table.values())))
        lines += [f"\nHit rate, {mode} ({MODES[mode]})",
                  "", "| slots / 32 | uniform | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
        for slots, row in table.items():
            lines.append(f"| {slots} | {int(slots) / 32:.3f} | "
                         + " | ".join(f"{row[n]['hit_rate']:.3f}" for n in names) + " |")
    recall = results["prefetch_recall"]
    layers = len(recall["per_layer"][1])
    lines += ["\nPrefetch recall per layer (predicting layer l from layer l-d)", "",
              "| d | " + " | ".join(f"L{r}" for r in range(layers)) + " | mean |", "|---" * (layers + 2) + "|"]
    for d, values in recall["per_layer"].items():
        lines.append(f"| {d} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in values)
                     + f" | {recall['mean'][d]:.3f} |")
    header = ("slots", "policy", "prefetch", "hit rate", "replay", "recall", "disk KiB/token", "wasted KiB/token",
              "stall ms/token", "ms/token", "logits = resident")
    lines += ["\nTiered store at run time (decode, teacher-forced)", "", "| " + " | ".join(header) + " |",
              "|---" * len(header) + "|"]
    for run in results["store_runs"]:
        recall = run["prefetch_recall"]
        cells = (run["slots"], run["policy"], "on" if run["prefetch"] else "off", f"{run['host_hit_rate']:.3f}",
                 f"{run['replay_hit_rate']:.3f}", "-" if recall is None else f"{recall:.3f}",
                 f"{run['disk_bytes_per_token'] / 1024:.1f}", f"{run['prefetch_wasted_bytes_per_token'] / 1024:.1f}",
                 f"{run['stall_ms_per_token']:.3f}", f"{run['ms_per_token']:.2f}", run["logits_equal_resident"])
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(default_model_path()), type=Path)
    parser.add_argument("--decode-tokens", type=int, default=256, help="tokens per window in the store runs")
    parser.add_argument("--write-usage", default=None, type=Path,
                        help="also write a usage file of all the trace's routes (for --eviction-policy pinned)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--window-tokens", type=int, default=None,
                        help="replay and prefetch over the first N tokens of each window (default: all of them)")
    args = parser.parse_args()
    data = np.load(TRACES)
    ids, tokens = data["expert_ids"].astype(np.int64), data["tokens"]  # [S, L, T, K], [S, T]
    ids, tokens = ids[:, :, :args.window_tokens], tokens[:, :args.window_tokens]
    folder = ModelFolder(args.model)
    if args.write_usage:
        counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=32) for l in range(ids.shape[1])])
        write_usage(args.write_usage, folder.config, counts, ids.shape[0] * ids.shape[2])
    start = time.time()
    results = replay_tables(ids)
    results["prefetch_recall"] = prefetch_recall(folder, tokens, ids)
    results["store_runs"] = store_runs(args.model, tokens, args.decode_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    results["conditions"] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "cpu_count": os.cpu_count(), "processor": platform.processor()},
        "commit": commit, "model": "colibri_stream/default_model (8 MoE layers x 32 experts, top-4, int8 experts)",
        "trace": f"{TRACES.name}: {ids.shape[0]} held-out windows x {ids.shape[2]} tokens, routing recorded with "
                 f"transformers (float32)",
        "replay": "decode order: each token one step; experts of a step asked in ascending id order; Belady = MIN "
                  "with bypass; pinned preloads its slots (free warm start)",
        "store_runs": f"NumPy backend, {args.decode_tokens} tokens per window teacher-forced, experts.bin in the "
                      f"page cache (warm), one run each",
        "command": " ".join(["python benchmarks/policy_eval.py", *sys.argv[1:]]),
        "wall_s": round(time.time() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"\nwrote {args.out} ({results['conditions']['wall_s']} s)")


if __name__ == "__main__":
    main()
