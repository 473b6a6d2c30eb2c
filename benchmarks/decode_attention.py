"""Decode attention alone: one query token per sequence over a long paged KV cache, against the bytes it must read.

    python benchmarks/decode_attention.py --out decode_attention.json

For each shape (Mixtral: 32 query heads, 8 KV, d128; Qwen3-30B-A3B: 32 / 4, d128), KV cache dtype, context C and
batch B: B sequences of C cached tokens (block size 16, blocks in random order, every key and value a normal draw
rounded to the cache's dtype), one decode token each at position C - 1, the block tables padded to
`--capacity` tokens as the engine's captured decode graphs pad them. Each point's launches are captured in a CUDA
graph and the graph's replays timed with CUDA events (median of the repetitions), as a decode step runs them:

  query_head    paged_attention, a block per (token, query head)
  gqa           paged_attention_gqa with backends/tuning.py as it is (flash_decode out of reach)
  default       the backend's choice with backends/tuning.py as it is (flash_decode for bf16 and fp16 caches)
  gqa sweep     paged_attention_gqa under every --gqa-blocks-per-sm x --gqa-max-splits x --gqa-split-keys
  flash sweep   flash_decode under every --blocks-per-sm x --max-splits x --split-keys x --stages

Ceiling: the KV bytes of the B contexts (keys and values) over the device-to-device copy bandwidth measured in the
same run (read plus written, as decode.py counts it). Each output is compared with the query_head kernel's on
the same inputs (relative error). The table gives, per case, the baselines, the fastest point of each sweep and
the fraction of the ceiling of the fastest; the records hold every point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conditions import constants_set, machine, require_gpu  # noqa: E402
from decode import measure_bandwidth  # noqa: E402
from prefill_attention import relative_error, time_us  # noqa: E402

SHAPES = {"mixtral-8x7b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}  # (Q, K, D)
BLOCK_SIZE = 16
KV_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3"}
OUT_OF_REACH = 1 << 40  # a GQA_MIN_TOKENS / GQA_ONE_TOKEN_MAX_KEYS no launch reaches


class DecodeCase:
    """B sequences of `context` cached tokens over one random paged cache, and one decode token each."""

    def __init__(self, cp, backend, heads: int, kv_heads: int, head_dim: int, context: int, batch: int,
                 capacity: int, kv_dtype: str, seed: int = 0):
        from colibri_stream.batch import ForwardBatch

        per_seq = -(-context // BLOCK_SIZE)
        width = -(-capacity // BLOCK_SIZE)
        rng = np.random.default_rng(seed)
        tables = np.zeros((batch, width), np.int64)  # [B, width]: unused entries 0, as the graphs pad them
        tables[:, :per_seq] = rng.permutation(batch * per_seq).reshape(batch, per_seq)
        shape = (batch * per_seq, BLOCK_SIZE, kv_heads, head_dim)  # [num_blocks, block_size, K, D]
        state = cp.random.RandomState(seed)
        self.key_cache, self.value_cache = (
            backend.from_float32(state.standard_normal(shape, dtype=np.float32), KV_DTYPES[kv_dtype])
            for _ in range(2))
        positions = np.full(batch, context - 1, np.int64)
        self.batch = ForwardBatch(
            token_ids=np.zeros(batch, np.int64), positions=positions,
            query_start=np.arange(batch + 1, dtype=np.int64), context_lens=positions + 1, block_tables=tables,
            slot_mapping=tables[np.arange(batch), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
            logits_indices=np.arange(batch, dtype=np.int64))
        self.device_batch = {name: cp.asarray(getattr(self.batch, name))
                             for name in ("block_tables", "query_start", "positions")}
        self.query = state.standard_normal((batch, heads, head_dim), dtype=np.float32)  # [T, Q, D]
        self.scale = head_dim**-0.5
        self.kv_bytes = 2 * batch * context * kv_heads * head_dim * self.key_cache.itemsize

    def run(self, backend):
        return backend.paged_attention(self.query, self.key_cache, self.value_cache, None, self.device_batch,
                                       self.scale, None)


def tuning_modules():
    from colibri_stream.backends import cupy_backend, tuning

    return (tuning, cupy_backend)


def timed(cp, backend, case: DecodeCase, reference, **constants) -> tuple[float, float | None, list]:
    """(microseconds, relative error against `reference`, output) of the case's launches under `constants`,
    captured in a graph and replayed (no host time between them)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with constants_set(tuning_modules(), **constants), stream:
        case.run(backend)  # compiles, and leaves the pool the blocks the capture reuses
        stream.synchronize()
        stream.begin_capture()
        out = case.run(backend)
        graph = stream.end_capture()
        graph.launch(stream)
        us = time_us(cp, lambda: graph.launch(stream))
        stream.synchronize()
    error = relative_error([out], [reference], cp) if reference is not None else None
    return us, error, out


def measure(cp, backend, conditions: dict, shape: str, kv_dtype: str, context: int, batch: int, capacity: int,
            sweep: list[tuple[str, dict]], bandwidth: float) -> list[dict]:
    heads, kv_heads, head_dim = SHAPES[shape]
    common = {"bench": "decode_attention", "shape": shape, "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "kv_dtype": kv_dtype, "context": context, "batch": batch, "capacity": capacity,
              "commit": conditions["commit"], "gpu": conditions["gpu"], "bandwidth_gb_s": bandwidth}
    case = DecodeCase(cp, backend, heads, kv_heads, head_dim, context, batch, capacity, kv_dtype)
    ceiling_us = case.kv_bytes / bandwidth / 1e3
    common.update(kv_bytes=case.kv_bytes, ceiling_us=ceiling_us)
    no_flash = dict(FLASH_DECODE_MIN_KEYS=OUT_OF_REACH)
    points = [("query_head", dict(no_flash, GQA_MIN_TOKENS=OUT_OF_REACH, GQA_ONE_TOKEN_MAX_KEYS=OUT_OF_REACH)),
              ("gqa", no_flash), ("default", {})] + sweep
    records, reference = [], None
    for kind, constants in points:
        record = dict(common, kind=kind, constants=constants)
        try:
            us, error, out = timed(cp, backend, case, reference, **constants)
            if reference is None:
                reference = out
            record.update(us=us, gb_s=case.kv_bytes / us / 1e3, of_ceiling=ceiling_us / us, relative_error=error)
        except Exception as failure:  # one point's failure is recorded; the others still run
            record["error"] = f"{type(failure).__name__}: {failure}"
            print(f"{shape} {kv_dtype} C={context} B={batch} {kind} {constants} FAILED {record['error']}",
                  flush=True)
        records.append(record)
    del case, reference
    cp.get_default_memory_pool().free_all_blocks()
    return records


def summary_row(records: list[dict]) -> str:
    by_kind: dict[str, list[dict]] = {}
    for record in records:
        if "us" in record:
            by_kind.setdefault(record["kind"], []).append(record)
    first = records[0]
    head = f"{first['shape']:<15}{first['kv_dtype']:<5}{first['context']:>7}{first['batch']:>4}"

    def fastest(kind: str) -> dict:
        return min(by_kind.get(kind, []), key=lambda r: r["us"], default={"us": float("nan"), "constants": {}})

    best = min((r for rs in by_kind.values() for r in rs), key=lambda r: r["us"], default=None)
    if best is None:
        return head + "  no point ran"
    worst_error = max((r["relative_error"] or 0.0) for rs in by_kind.values() for r in rs)
    knobs = " ".join(f"{k.lower()}={v}" for k, v in best["constants"].items() if "MIN" not in k)
    cells = "".join(f"{fastest(kind)['us']:>9.1f}" for kind in ("query_head", "gqa", "default", "gqa sweep",
                                                                 "flash sweep"))
    return f"{head}{cells}{best['of_ceiling']:>8.0%}{best['gb_s']:>7.0f}{worst_error:>9.1e}  {best['kind']}: {knobs}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16"], choices=list(KV_DTYPES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--capacity", type=int, default=40960,
                        help="tokens the block tables are padded to (the engine's max_seq_len)")
    parser.add_argument("--gqa-blocks-per-sm", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--gqa-max-splits", type=int, nargs="*", default=[32, 256])
    parser.add_argument("--gqa-split-keys", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--blocks-per-sm", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--max-splits", type=int, nargs="*", default=[32, 128, 512])
    parser.add_argument("--split-keys", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 4], help="flash_decode ring slots per warp")
    args = parser.parse_args(argv)
    require_gpu()
    import cupy as cp

    from colibri_stream.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    conditions = machine()
    conditions["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bandwidth = measure_bandwidth(cp)
    sweep = [("gqa sweep", dict(GQA_BLOCKS_PER_SM=b, GQA_MAX_SPLITS=s, GQA_SPLIT_KEYS=k, GQA_ONE_TOKEN_MAX_KEYS=0,
                                FLASH_DECODE_MIN_KEYS=OUT_OF_REACH))
             for b, s, k in itertools.product(args.gqa_blocks_per_sm, args.gqa_max_splits, args.gqa_split_keys)]
    sweep += [("flash sweep", dict(FLASH_DECODE_BLOCKS_PER_SM=b, FLASH_DECODE_MAX_SPLITS=s, FLASH_DECODE_SPLIT_KEYS=k,
                                   FLASH_DECODE_STAGES=g))
              for b, s, k, g in itertools.product(args.blocks_per_sm, args.max_splits, args.split_keys, args.stages)]
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {len(sweep)} sweep points a case; microseconds:")
    print(f"{'shape':<15}{'kv':<5}{'context':>7}{'B':>4}{'qhead':>9}{'gqa':>9}{'default':>9}{'gqa best':>9}"
          f"{'flash':>9}{'of ceil':>8}{'GB/s':>7}{'max err':>9}  fastest")
    records = []
    for shape, kv_dtype, context, batch in itertools.product(args.shapes, args.kv_dtypes, args.contexts,
                                                             args.batches):
        if context > args.capacity:
            continue
        case_records = measure(cp, backend, conditions, shape, kv_dtype, context, batch, args.capacity, sweep,
                               bandwidth)
        print(summary_row(case_records), flush=True)
        records += case_records
    Path(args.out).write_text(json.dumps({"machine": conditions, "records": records}, indent=1))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
