"""One eager decode (or prefill) step of a synthetic shape inside a CUDA profiler range, for Nsight Compute's
per-kernel view.

    ncu --profile-from-start off --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \\
        python benchmarks/step_kernels.py --shape qwen3-30b-a3b --batch 1 --layers 2

A first step outside the range compiles the kernels; the profiled step runs the same kernels a captured step
does at that batch (linear_rows up to SMALL_BATCH tokens, the MoE GEMV below MMA_MIN_TOKENS), launched one by
one. `benchmarks/step_kernels_table.py` turns the CSV into a table per kernel.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from conditions import require_gpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--dense-layers", type=int, default=None,
                        help="leading dense layers, the rest MoE, in place of the shape's own (long_context.py's "
                             "SHAPE:LAYERS:DENSE)")
    parser.add_argument("--prefill", type=int, default=1,
                        help="new tokens per sequence in the step (1: a decode step)")
    parser.add_argument("--matmul-precision", default="medium", choices=("high", "medium"),
                        help="the backend's matmul precision (EngineConfig's default: medium)")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy

    from colibri_stream.batch import ForwardBatch
    from colibri_stream.synthetic import synthetic_model
    from long_context import benchmark_config

    model = synthetic_model(benchmark_config(args.shape, args.layers, args.dense_layers), device="cuda",
                            matmul_precision=args.matmul_precision)
    block_size, b, n = 16, args.batch, args.prefill
    per_seq = -(-(args.context + n) // block_size)
    kv = model.allocate_kv_cache(b * per_seq, block_size)
    tables = np.arange(b * per_seq).reshape(b, per_seq)
    positions = (args.context + np.tile(np.arange(n), b)).astype(np.int64)  # [B * N]
    rows = np.repeat(np.arange(b), n)  # [B * N]: each token's sequence
    ends = np.full(b, args.context + n, np.int64)
    batch = ForwardBatch(
        token_ids=np.arange(b * n, dtype=np.int64) % 1000 + 7, positions=positions,
        query_start=np.arange(b + 1, dtype=np.int64) * n, context_lens=ends, block_tables=tables,
        slot_mapping=tables[rows, positions // block_size] * block_size + positions % block_size,
        logits_indices=np.arange(1, b + 1, dtype=np.int64) * n - 1)
    model.forward(batch, kv)  # compiles every kernel
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    model.forward(batch, kv)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
