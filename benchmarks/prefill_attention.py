"""Prefill attention: flash_attention.cu (tensor cores) against attention.cu's paged_attention on the same inputs.

    python benchmarks/prefill_attention.py --out prefill_attention.json

One sequence over a paged KV cache (block size 16, blocks in random order), Mixtral (32 query heads, 8 KV, d128)
and Qwen3-30B-A3B (32 / 4, d128) shapes, contexts 1k, 8k and 32k, the prompt as one chunk or as 2048-token
chunks (each over the cache the chunks before it wrote; the figure is the sum over the chunks), on a bf16 cache
(the default) and a float32 one; flash_attention with products of high and low bf16 parts (the backend's choice)
and of bf16 operands only. TFLOP/s counts causal FLOPs: 4 * D * (keys seen) per query head and token. Each flash
case is checked against paged_attention on the same cache (relative error of the outputs) and both are timed with
CUDA events, the median of their repetitions; the ratio is paged_attention's time over flash_attention's.
A failing case is printed and recorded, and the others still run. A second table times one step of a short
chunk after a cached prefix of SHORT_CONTEXT tokens on each kernel: where the flash kernel overtakes
paged_attention is what FLASH_MIN_TOKENS should be.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conditions import constants_set, machine, require_gpu  # noqa: E402

SHAPES = {"mixtral-8x7b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}  # (Q, K, D)
CONTEXTS = (1024, 8192, 32768)
CHUNK = 2048
SHORT_CONTEXT = 4096  # short chunks: one step of a few tokens at the end of a context of this many
SHORT_CHUNKS = (2, 8, 16, 32, 64, 128, 512)
BLOCK_SIZE = 16
TIME_BUDGET_S = 0.5  # repetitions of a case until about this much GPU time (at least one after a warm-up)
MAX_REPEATS = 20


def causal_flops(first: int, context: int, heads: int, head_dim: int) -> float:
    """QK^T and PV of positions first .. context - 1 of a causal prompt: position p sees p + 1 keys."""
    keys = (context * (context + 1) - first * (first + 1)) / 2
    return 4.0 * head_dim * heads * keys


class Prompt:
    """One sequence's prompt of `context` tokens over a random KV cache, positions `first` on computed in chunks
    of `chunk` tokens (the ones before `first` are in the cache as a cached prefix would be)."""

    def __init__(self, cp, heads: int, kv_heads: int, head_dim: int, context: int, chunk: int, kv_dtype: str,
                 first: int = 0, seed: int = 0):
        from colibri_stream.batch import single_sequence_batch

        blocks = -(-context // BLOCK_SIZE)
        rng = np.random.default_rng(seed)
        table = rng.permutation(blocks)
        generator = cp.random.RandomState(seed)
        shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)  # [num_blocks, block_size, K, D]
        self.key_cache, self.value_cache = (generator.standard_normal(shape, dtype=np.float32) for _ in range(2))
        if kv_dtype == "bfloat16":  # round to nearest even, kept as uint16 bits as the backend stores bf16
            self.key_cache, self.value_cache = (to_bf16_bits(cp, c) for c in (self.key_cache, self.value_cache))
        self.steps = []  # (batch, device_batch, query [T, Q, D]) of each chunk
        for start in range(first, context, chunk):
            end = min(context, start + chunk)
            batch = single_sequence_batch(np.zeros(end - start, np.int64), start, table, BLOCK_SIZE)
            device_batch = {name: cp.asarray(getattr(batch, name))
                            for name in ("block_tables", "query_start", "positions")}
            query = generator.standard_normal((end - start, heads, head_dim), dtype=np.float32)
            self.steps.append((batch, device_batch, query))
        self.scale = head_dim**-0.5

    def run(self, backend) -> list:
        return [backend.paged_attention(query, self.key_cache, self.value_cache, batch, device_batch, self.scale,
                                        None) for batch, device_batch, query in self.steps]


def to_bf16_bits(cp, values):
    bits = values.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def time_us(cp, run) -> float:
    """Median GPU time of run() in microseconds (the caller has run it once: compiled and warmed up)."""
    times = []
    while len(times) < MAX_REPEATS and (not times or sum(times) < TIME_BUDGET_S * 1e6):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def relative_error(ours: list, reference: list, cp) -> float:
    num = sum(float(cp.linalg.norm(a - b)) ** 2 for a, b in zip(ours, reference))
    den = sum(float(cp.linalg.norm(b)) ** 2 for b in reference)
    return (num / den) ** 0.5


# (kernel, KV cache dtype, split), paged_attention first for each cache dtype: the flash kernel with products
# of high and low bf16 parts (the backend's choice, float32-close) and with bf16 operands only ("bf16 products")
KERNELS = tuple((kernel, kv_dtype, split) for kv_dtype in ("bfloat16", "float32")
                for kernel, split in (("paged_attention", False), ("flash_attention", True), ("flash_attention", False)))


def measure(cp, backend, conditions: dict, shape: str, context: int, chunk: int, first: int) -> list[dict]:
    """Every entry of KERNELS on one case; a failure is recorded in its record and printed."""
    from colibri_stream.backends import cupy_flash_attention  # the dispatch constants each case sets

    heads, kv_heads, head_dim = SHAPES[shape]
    flops = causal_flops(first, context, heads, head_dim)
    baseline_us = reference = None
    records = []
    for kernel, kv_dtype, split in KERNELS:
        record = {"bench": "prefill_attention", "shape": shape, "heads": heads, "kv_heads": kv_heads,
                  "head_dim": head_dim, "context": context, "cached_prefix": first, "chunk": chunk,
                  "chunks": -(-(context - first) // chunk), "kernel": kernel, "split": split, "kv_dtype": kv_dtype,
                  "commit": conditions["commit"], "gpu": conditions["gpu"]}
        name = kernel if kernel == "paged_attention" else f"flash ({'split' if split else 'bf16 products'})"
        label = f"{shape:<15}{context:>8}{first:>8}{chunk:>7}  {name:<22}{kv_dtype:<9}"
        prompt = None  # the previous case's arrays go before this one's are made
        if kernel == "paged_attention":  # the baseline of the flash cases on this cache dtype
            baseline_us = reference = None
        try:
            prompt = Prompt(cp, heads, kv_heads, head_dim, context, chunk, kv_dtype, first)
            # paged_attention: a FLASH_MIN_TOKENS past any chunk
            # split or not: the backend's matmul precision high or medium
            baseline = kernel == "paged_attention"
            with constants_set((cupy_flash_attention,), FLASH_MIN_TOKENS=1 << 62 if baseline else 2), \
                    constants_set((backend,), activation_parts=2 if split else 1):
                outputs = prompt.run(backend)  # compiles and warms up
                us = time_us(cp, lambda: prompt.run(backend))
            if kernel == "paged_attention":
                baseline_us, reference, error = us, outputs, 0.0
            else:
                error = relative_error(outputs, reference, cp) if reference else None
            del outputs
            record.update(us_per_call=us, tflops=flops / us / 1e6, ratio=baseline_us / us if baseline_us else None,
                          relative_error=error)
            ratio = f"{record['ratio']:.2f}" if record["ratio"] else "-"
            err = f"{error:.1e}" if error is not None else "-"
            print(f"{label}{us:>12.0f}{record['tflops']:>9.1f}{ratio:>9}{err:>10}", flush=True)
        except Exception as failure:  # one case's failure is recorded; the others still run
            record["error"] = f"{type(failure).__name__}: {failure}"
            print(f"{label} FAILED {record['error']}", flush=True)
        records.append(record)
    cp.get_default_memory_pool().free_all_blocks()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--short-chunks", type=int, nargs="*", default=list(SHORT_CHUNKS),
                        help="chunk sizes timed as one step after a cached prefix (for FLASH_MIN_TOKENS)")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy as cp

    from colibri_stream.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    conditions = machine()
    conditions["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    records = []
    print(f"{'shape':<15}{'context':>8}{'cached':>8}{'chunk':>7}  {'kernel':<22}{'kv':<9}{'us/prompt':>12}"
          f"{'TFLOP/s':>9}{'x paged':>9}{'rel err':>10}")
    for shape in args.shapes:
        for context in args.contexts:
            for chunk in sorted({context, min(context, CHUNK)}, reverse=True):
                records += measure(cp, backend, conditions, shape, context, chunk, 0)
    for shape in args.shapes:
        for chunk in args.short_chunks:
            records += measure(cp, backend, conditions, shape, SHORT_CONTEXT, chunk, SHORT_CONTEXT - chunk)
    Path(args.out).write_text(json.dumps({"machine": conditions, "records": records}, indent=1))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
