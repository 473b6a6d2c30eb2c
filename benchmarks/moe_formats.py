"""Routed experts of one MoE layer per expert format: bf16 (moe.cu / moe_mma.cu) against int4 and fp8
(moe_int4.cu, moe_fp8.cu), as time per step and as a fraction of the bytes' ceiling.

    python benchmarks/moe_formats.py --out benchmarks/results/moe_formats_h200.json

One MoE layer of random experts of the published shapes (Mixtral-8x7B: 8 experts, top 2, H 4096, I 14336;
Qwen3-30B-A3B: 128, top 8, 2048, 768), resident on the GPU, in each format: bf16 values, int4 codes with float32
scales per group of 128 (symmetric), fp8 e4m3 codes (no NaN codes) with a float32 scale per 128 x 128 tile. Codes
are drawn uniformly at random (never zeros; the kernels' time does not depend on the values). Steps of T tokens
routed uniformly at random (distinct experts per token) are captured in a CUDA graph of 16 steps and replayed, as
a decode step runs; the figure is the GPU time per step. Ceiling: the bytes of the distinct experts the steps touch
(codes, scales) over the device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conditions import machine, require_gpu  # noqa: E402

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # (E, k, H, I)
FORMATS = ("bf16", "int4", "fp8")
TOKENS = (1, 4, 16, 64, 256)
STEPS = 16  # routed steps per graph, each its own routing


def random_experts(cp, fmt: str, num_experts: int, h: int, i: int):
    """The layer's experts in `fmt` as the resident store holds them: DeviceExpertStore over LayerExperts."""
    from colibri_stream.backends.cupy_moe import DeviceExpertStore
    from colibri_stream.experts.device import LayerExperts

    rng = cp.random.RandomState(7)

    def bf16(shape, std):
        bits = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).view(np.uint32)
        return (bits >> np.uint32(16)).astype(np.uint16)

    if fmt == "bf16":
        w13 = bf16((num_experts, 2 * i, h), h**-0.5)  # [E, 2I, H]
        w2 = bf16((num_experts, h, i), i**-0.5)  # [E, H, I]
        return DeviceExpertStore({0: LayerExperts.stacked(w13, w2, None, None)})
    arrays = {}
    for name, rows, cols in (("gate", i, h), ("up", i, h), ("down", h, i)):
        if fmt == "int4":
            groups = cols // 128
            arrays[name] = rng.randint(0, 256, (num_experts, rows, groups, 64)).astype(np.uint8)
            arrays[name + "_scale"] = (rng.random_sample((num_experts, rows, groups), dtype=np.float32)
                                       * np.float32(2 / 7 / cols**0.5))
        else:
            codes = rng.randint(0, 256, (num_experts, rows, cols)).astype(np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x3F  # no NaN codes
            arrays[name] = codes
            arrays[name + "_scale"] = (rng.random_sample((num_experts, -(-rows // 128), -(-cols // 128)),
                                                         dtype=np.float32) * np.float32(2 / 448 / cols**0.5))
    return DeviceExpertStore({0: LayerExperts.from_arrays(arrays, None)})


def expert_bytes(store) -> int:
    """Bytes of one expert's tensors in the store's layer 0."""
    return sum(array[0].nbytes for array in store.layers[0].named().values())


def run_shape(cp, backend, name: str, formats: list[str], tokens_list: list[int], bandwidth: float,
              variants: list[tuple[str, int]]) -> list[dict]:
    """Records of one shape: each format at each token count, timed as the tree stands, then again with each
    (constant of backends/tuning.py, value) of `variants` set."""
    import contextlib

    from decode import time_in_graph, tuning_set

    num_experts, top_k, h, i = SHAPES[name]
    records = []
    for fmt in formats:
        store = random_experts(cp, fmt, num_experts, h, i)
        per_expert = expert_bytes(store)
        for tokens in tokens_list:
            generator = cp.random.RandomState(tokens)
            x = generator.standard_normal((STEPS, tokens, h), dtype=np.float32)  # [S, T, H]
            scores = generator.random_sample((STEPS, tokens, num_experts), dtype=np.float32)
            ids = cp.argsort(scores, axis=2)[:, :, :top_k].astype(np.int32)  # [S, T, k] distinct experts
            weights = generator.random_sample((STEPS, tokens, top_k), dtype=np.float32)  # [S, T, k]
            distinct = float(np.mean([len(np.unique(cp.asnumpy(ids[s]))) for s in range(STEPS)]))
            def step(s, x=x, weights=weights, ids=ids, store=store):
                return backend.routed_experts(x[s], weights[s], ids[s], 0, store)

            for variant in [None, *variants]:
                with contextlib.nullcontext() if variant is None else tuning_set(*variant):
                    seconds = time_in_graph(cp, step, calls=STEPS, replays=5)
                ceiling_s = distinct * per_expert / (bandwidth * 1e9)
                record = {"shape": name, "format": fmt, "tokens": tokens, "experts": num_experts, "top_k": top_k,
                          "hidden": h, "intermediate": i, "bytes_per_expert": per_expert,
                          "variant": None if variant is None else f"{variant[0]}={variant[1]}",
                          "distinct_experts": distinct, "step_us": seconds * 1e6, "ceiling_us": ceiling_s * 1e6,
                          "ceiling_fraction": ceiling_s / seconds,
                          "effective_gbps": distinct * per_expert / seconds / 1e9}
                print(f"{name:14s} {fmt:5s} T={tokens:4d} {record['variant'] or '':26s} {seconds * 1e6:8.1f} us  "
                      f"ceiling {ceiling_s * 1e6:8.1f} us  ({record['ceiling_fraction']:.0%}, "
                      f"{record['effective_gbps']:.0f} GB/s)", flush=True)
                records.append(record)
        del store
        cp.get_default_memory_pool().free_all_blocks()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                        help="time each case again with this integer constant of backends/tuning.py set "
                             "(INT4_GEMV_MAX_TOKENS=0: int4 on tensor cores at every batch); repeatable")
    parser.add_argument("--out", help="JSON records")
    args = parser.parse_args(argv)
    variants = [(name, int(value)) for name, value in (v.split("=", 1) for v in args.variant)]
    require_gpu()
    import cupy as cp
    from decode import measure_bandwidth

    from colibri_stream.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    bandwidth = measure_bandwidth(cp)
    print(f"device copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    records = []
    for name in args.shapes:
        records += run_shape(cp, backend, name, args.formats, args.tokens, bandwidth, variants)
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "moe_formats", **machine(), "hbm_gbps_measured": bandwidth,
                                              "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
