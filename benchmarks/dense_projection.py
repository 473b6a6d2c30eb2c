"""Dense projections of a decode step on one GPU: our GEMV (linear_rows) against our tensor-core kernel
(linear_mma, split over the columns) at each token count, inside CUDA graphs as a decode step runs them, with
cuBLAS (eager, not capturable) as a reference. It decides DENSE_MMA_MIN_TOKENS (tuning.py).

Shapes: q/k/v (one launch), o and lm_head of Mixtral-8x7B, Qwen3-30B-A3B and GLM-4.5-Air, DeepSeek-V3's latent
attention projections, dense MLP and lm_head, random bf16 weights. Each call reads the next of LAYERS copies of
the weights, so they come from HBM, not L2. GB/s is weight bytes over time.

    python benchmarks/dense_projection.py --out benchmarks/results/dense_projection_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from conditions import constants_set, require_gpu
from decode import log, machine, measure_bandwidth, time_in_graph

LAYERS = 8  # copies of each weight the calls cycle through
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def projections(hidden: int, q: int, kv: int, vocab: int) -> dict[str, tuple[int, list[int]]]:
    """A grouped-query layer's projections, each as (In, [Out_m] of the matrices of one launch)."""
    return {"q,k,v": (hidden, [q, kv, kv]), "o": (q, [hidden]), "lm_head": (hidden, [vocab])}


SHAPES = {  # name: its projections (hidden, q rows, k/v rows, vocabulary for grouped-query attention)
    "mixtral-8x7b": projections(4096, 4096, 1024, 32000),
    "qwen3-30b-a3b": projections(2048, 4096, 512, 151936),
    "glm-4.5-air": projections(4096, 96 * 128, 8 * 128, 151552),
    # latent attention's projections, each its own launch: the query's low-rank pair, the latent's, the output; the
    # dense layers' MLP (gate and up in one launch)
    "deepseek-v3": {"q_a": (7168, [1536]), "q_b": (1536, [128 * 192]), "kv_a": (7168, [576]), "o": (128 * 128, [7168]),
                    "mlp gate,up": (7168, [18432, 18432]), "mlp down": (18432, [7168]), "lm_head": (7168, [129280])},
}


def eager_seconds(cp, fn, calls: int = 32) -> float:
    """GPU seconds per call of fn(i) launched eagerly (CUDA events around `calls` calls)."""
    fn(0)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / calls


def measure(backend, shape: str, name: str, n_in: int, n_outs: list[int],
            sweep: list[tuple[int, int]], token_counts: list[int]) -> list[dict]:
    """One projection of `shape` at every token count (linear_mma also with each (blocks per SM, least span) of
    `sweep`)."""
    from colibri_stream.backends import cupy_backend  # the module whose split constants a sweep sets

    cp = backend.cp
    copies = 2 if name == "lm_head" else LAYERS
    weights = [[backend.random_weight((n, n_in), 0.02, 100 * c + m, "bfloat16") for m, n in enumerate(n_outs)]
               for c in range(copies)]  # [copies][matrices] of [Out_m, In]
    biases = [None] * len(n_outs)
    nbytes = 2 * n_in * sum(n_outs)
    splits = backend.column_splits(n_in, sum(-(-n // 128) for n in n_outs))
    records = []
    for tokens in token_counts:
        x = cp.random.standard_normal((tokens, n_in), dtype=np.float32)  # [T, In]
        gemv = time_in_graph(cp, lambda i, x=x: backend._linear_rows(x, weights[i % copies], biases))
        mma = time_in_graph(cp, lambda i, x=x: backend._linear_mma(x, weights[i % copies], biases))
        cublas = eager_seconds(cp, lambda i, x=x: [backend._gemm(x, w) for w in weights[i % copies]])
        variants = {}  # "blocks per SM x least span": mma microseconds with those split constants
        for blocks_per_sm, min_span in sweep:
            with constants_set((cupy_backend,), LINEAR_MMA_BLOCKS_PER_SM=blocks_per_sm,
                               LINEAR_MMA_MIN_SPAN=min_span):
                seconds = time_in_graph(cp, lambda i, x=x: backend._linear_mma(x, weights[i % copies], biases))
                variants[f"{blocks_per_sm}x{min_span}"] = {
                    "us": seconds * 1e6, "splits": backend.column_splits(n_in, sum(-(-n // 128) for n in n_outs))}
        records.append({"bench": "dense_projection", "shape": shape, "projection": name, "in": n_in,
                        "outs": n_outs, "tokens": tokens, "weight_bytes": nbytes, "column_splits": splits,
                        "gemv_us": gemv * 1e6, "mma_us": mma * 1e6, "cublas_eager_us": cublas * 1e6,
                        "gemv_gbps": nbytes / gemv / 1e9, "mma_gbps": nbytes / mma / 1e9,
                        "cublas_eager_gbps": nbytes / cublas / 1e9, "mma_split_variants": variants})
        best = min(variants.items(), key=lambda item: item[1]["us"]) if variants else None
        log(f"{shape} {name:8s} T={tokens:3d}: gemv {gemv * 1e6:7.1f} us ({nbytes / gemv / 1e9:5.0f} GB/s), "
            f"mma {mma * 1e6:7.1f} us ({nbytes / mma / 1e9:5.0f} GB/s), cuBLAS eager {cublas * 1e6:7.1f} us, "
            f"splits {splits}" + (f"; best split constants {best[0]}: {best[1]['us']:.1f} us "
                                  f"({best[1]['splits']} splits)" if best else ""))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dense_projection.json"))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--blocks-per-sm", type=int, nargs="*", default=[],
                        help="also time linear_mma with these LINEAR_MMA_BLOCKS_PER_SM values ...")
    parser.add_argument("--min-spans", type=int, nargs="*", default=[],
                        help="... and these LINEAR_MMA_MIN_SPAN values (every pair)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args(argv)
    require_gpu()
    from colibri_stream.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    command = " ".join(["benchmarks/dense_projection.py", *sys.argv[1:]])
    common = {**machine(), "commit": os.environ.get("COLIBRI_COMMIT", "unknown"),
              "hbm_gbps_measured": measure_bandwidth(backend.cp), "command": command}
    sweep = [(b, s) for b in args.blocks_per_sm for s in args.min_spans]
    records = []
    for shape in args.shapes:
        for name, (n_in, n_outs) in SHAPES[shape].items():
            records += [{**common, **record}
                        for record in measure(backend, shape, name, n_in, n_outs, sweep, args.tokens)]
            backend.cp.get_default_memory_pool().free_all_blocks()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    log(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
