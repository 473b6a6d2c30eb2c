"""Routed experts of a prefill chunk: moe_mma.cu, the grouped GEMM (moe_gemm.cu) and per-expert cuBLAS GEMMs
(cupy_expert_gemm.py), side by side.

    python benchmarks/moe_prefill.py --out moe_prefill.json [--matmul-precision medium]

One MoE layer of random bf16 experts of the published shapes (Mixtral-8x7B: 8 experts, top 2, H 4096, I 14336;
Qwen3-30B-A3B: 128, top 8, 2048, 768; GLM-4.5-Air: 128, top 8, 4096, 1408; DeepSeek-V3: 256, top 8, 7168, 2048),
steps of T tokens routed uniformly at random (top-k distinct experts per token), each step through
`routed_experts` on each path, the dispatch thresholds (EXPERT_GEMM_MIN_WORK, GROUPED_GEMM_MIN_PAIRS) set so that
every step takes it. The figure is the median wall time of a step (the cuBLAS path synchronises once to read the
group sizes, so the wall time is what a prefill step pays), as TFLOP/s of the useful work (2 * 3 * H * I per pair;
at matmul precision high the activations' two parts double what the tensor cores do). Ceiling: one cuBLAS GEMM of
the same shape as all of a step's gate and up products together (P rows, one expert's [2I, H] matrix, every part),
timed in the same run, as TFLOP/s of useful work. Each path's output is compared with moe_mma.cu's (relative
error). The crossovers are what GROUPED_GEMM_MIN_PAIRS and EXPERT_GEMM_MIN_WORK should be.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conditions import constants_set, machine, require_gpu  # noqa: E402

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "glm-4.5-air": (128, 8, 4096, 1408), "deepseek-v3": (256, 8, 7168, 2048)}  # (E, k, H, I)
# the dispatch thresholds that send every step down each path
PATHS = {"moe_mma": dict(EXPERT_GEMM_MIN_WORK=1 << 62, GROUPED_GEMM_MIN_PAIRS=1 << 30),
         "moe_gemm": dict(EXPERT_GEMM_MIN_WORK=1 << 62, GROUPED_GEMM_MIN_PAIRS=1),
         "expert_gemms": dict(EXPERT_GEMM_MIN_WORK=1, GROUPED_GEMM_MIN_PAIRS=1)}
TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
TIME_BUDGET_S = 0.3  # repetitions of a case until about this much time (at least two after a warm-up)
MAX_REPEATS = 20


def median_seconds(cp, step) -> float:
    """The median wall time of `step()` to the GPU's completion, after one warm-up call."""
    step()
    cp.cuda.Device().synchronize()
    times: list[float] = []
    while len(times) < 2 or (sum(times) < TIME_BUDGET_S and len(times) < MAX_REPEATS):
        start = time.perf_counter()
        step()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def random_bf16(cp, shape: tuple[int, ...], std: float, seed: int):
    """Normal values of `std` rounded to bf16 (uint16 bits, as the backend holds them), drawn a matrix at a time
    (DeepSeek-V3's experts in float32 would not fit beside them)."""
    out = cp.empty(shape, np.uint16)
    generator = cp.random.RandomState(seed)
    for e in range(shape[0]):
        bits = (generator.standard_normal(shape[1:], dtype=np.float32) * np.float32(std)).view(np.uint32)
        out[e] = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return out


def run_shape(cp, backend, name: str, tokens_list: list[int]) -> list[dict]:
    from colibri_stream.backends import cupy_expert_gemm, cupy_moe_gemm
    from colibri_stream.backends.cublas_gemm import activation_parts, weight_product
    from colibri_stream.backends.cupy_moe import DeviceExpertStore
    from colibri_stream.experts.device import LayerExperts

    num_experts, top_k, h, i = SHAPES[name]
    w13 = random_bf16(cp, (num_experts, 2 * i, h), h**-0.5, 1)  # [E, 2I, H]
    w2 = random_bf16(cp, (num_experts, h, i), i**-0.5, 2)  # [E, H, I]
    store = DeviceExpertStore({0: LayerExperts.stacked(w13, w2, None, None)})
    records = []
    for tokens in tokens_list:
        generator = cp.random.RandomState(tokens)
        x = generator.standard_normal((tokens, h), dtype=np.float32)  # [T, H]
        scores = generator.random_sample((tokens, num_experts), dtype=np.float32)
        ids = cp.argsort(scores, axis=1)[:, :top_k].astype(np.int32)  # [T, k] distinct experts
        weights = generator.random_sample((tokens, top_k), dtype=np.float32)  # [T, k]
        pairs = tokens * top_k
        useful = 2.0 * 3 * h * i * pairs
        outputs, seconds = {}, {}
        for path, thresholds in PATHS.items():
            with constants_set([cupy_expert_gemm, cupy_moe_gemm], **thresholds):
                seconds[path] = median_seconds(cp, lambda: backend.routed_experts(x, weights, ids, 0, store))
                outputs[path] = backend.routed_experts(x, weights, ids, 0, store)
        parts = backend.activation_parts
        halves = activation_parts(x[cp.arange(pairs) // top_k], w13, parts)  # [N * P, H]
        out = cp.empty((pairs, 2 * i), np.float32)  # [P, 2I]

        def one_gemm():
            for part in range(parts):
                weight_product(out.data.ptr, 2 * i, w13.data.ptr, h, w13.dtype, 2 * i, h,
                               halves.data.ptr + part * pairs * h * 2, h, pairs, accumulate=part > 0)

        ceiling_s = median_seconds(cp, one_gemm) * 1.5  # gate and up (2/3 of the work) on one matrix
        halves = out = None  # freed before the next case
        record = {"shape": name, "experts": num_experts, "top_k": top_k, "hidden": h, "intermediate": i,
                  "tokens": tokens, "pairs_per_expert": pairs / num_experts, "activation_parts": parts,
                  "ceiling_tflops": useful / ceiling_s / 1e12}
        reference = outputs["moe_mma"]
        for path in PATHS:
            record[f"{path}_ms"] = seconds[path] * 1e3
            record[f"{path}_tflops"] = useful / seconds[path] / 1e12
            error = cp.linalg.norm(outputs[path] - reference) / cp.linalg.norm(reference)
            record[f"{path}_relative_error"] = float(error)
        print(f"{name:14s} T={tokens:5d} pairs/expert={pairs / num_experts:7.1f}  "
              + "  ".join(f"{path} {record[f'{path}_tflops']:6.1f}" for path in PATHS)
              + f"  ceiling {record['ceiling_tflops']:6.1f} TFLOP/s  err "
              + "/".join(f"{record[f'{path}_relative_error']:.1e}" for path in PATHS if path != "moe_mma"),
              flush=True)
        records.append(record)
    store = w13 = w2 = None  # freed before the pool is emptied
    cp.get_default_memory_pool().free_all_blocks()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--matmul-precision", default="high", choices=("high", "medium"),
                        help="the backend's: two parts of the activations (high) or one (medium)")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy

    from colibri_stream.backends.cupy_backend import CupyBackend

    backend = CupyBackend(args.matmul_precision)
    conditions = {**machine(), "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                  "matmul_precision": args.matmul_precision}
    records = [record for shape in args.shapes for record in run_shape(cupy, backend, shape, args.tokens)]
    Path(args.out).write_text(json.dumps({"machine": conditions, "records": records}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
