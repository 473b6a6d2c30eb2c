"""Candidates for computing one routed expert on the host CPU, measured against this machine's read bandwidth.

One expert's SiLU-gated MLP, down(silu(gate x) * up x), at published expert shapes, for T tokens routed to it, in
bf16 and int8 (per-row float32 scales). Each candidate reads the weights where they lie; the figure of merit is
weight bytes read per second, next to the machine's read bandwidth measured in the same run (a parallel sum over
1 GiB with every thread, and NumPy's single-threaded sum). Experts are random normal weights, copied enough times
that a run cycles through more memory than the last-level cache holds, so every call reads from RAM. Candidates
are interleaved round by round after a warm-up; the median of the rounds is reported.

    python benchmarks/cpu_expert_kernels.py [--shapes qwen3,olmoe,mixtral] [--rounds 9] [--threads N]

Writes benchmarks/results/cpu_expert_kernels.json; docs/CPU_EXPERTS.md discusses the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import torch

from colibri_stream.experts.cpu_executor import CpuExpertExecutor, numpy_expert

SHAPES = {  # name: (hidden H, expert intermediate I)
    "qwen3-30b-a3b": (2048, 768),
    "olmoe-1b-7b": (2048, 1024),
    "mixtral-8x7b": (4096, 14336),
}
TOKENS = (1, 4, 16)
CYCLE_BYTES = 768 << 20  # each candidate cycles through at least this much expert memory
RESULTS = Path(__file__).parent / "results" / "cpu_expert_kernels.json"


@numba.njit(parallel=True, fastmath=True, nogil=True)
def _parallel_sum(a):
    """Sum of a [N] float32 over every numba thread (the read-bandwidth probe)."""
    chunks = numba.get_num_threads() * 4
    parts = np.zeros(chunks, np.float64)
    for c in numba.prange(chunks):
        acc = np.float32(0.0)
        for i in range(c * a.shape[0] // chunks, (c + 1) * a.shape[0] // chunks):
            acc += a[i]
        parts[c] = acc
    return parts.sum()


def read_bandwidth(rounds: int) -> dict:
    """GB/s of reading 1 GiB of float32: every thread (numba) and one NumPy thread."""
    a = np.random.default_rng(1).standard_normal(1 << 28, dtype=np.float32)  # [2^28]
    _parallel_sum(a)
    parallel, single = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        _parallel_sum(a)
        parallel.append(a.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        a.sum()
        single.append(a.nbytes / (time.perf_counter() - start) / 1e9)
    return {"all_threads_gbs": statistics.median(parallel), "numpy_one_thread_gbs": statistics.median(single)}


def make_expert(hidden: int, inter: int, dtype: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random gate [I, H], up [I, H], down [H, I] in bf16, or int8 with float32 row scales."""
    tensors = {}
    for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if dtype == "bf16":
            tensors[name] = w.astype(ml_dtypes.bfloat16)
        else:
            scale = np.abs(w).max(axis=1) / np.float32(127)  # [rows]
            tensors[name] = np.round(w / scale[:, None]).astype(np.int8)
            tensors[f"{name}_scale"] = scale.astype(np.float32)
    return tensors


def torch_views(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Zero-copy torch tensors over the same memory (bf16 through an int16 view; scales as bf16 for int8pack)."""
    out = {}
    for name, a in tensors.items():
        if a.dtype == ml_dtypes.bfloat16:
            out[name] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        elif name.endswith("_scale"):
            out[name] = torch.from_numpy(a).to(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(a)
    return out


def torch_expert(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """bf16 weights: torch's bf16 linear (activations in bf16); int8: torch._weight_int8pack_mm (bf16 x)."""
    if t["gate"].dtype == torch.bfloat16:
        linear = torch.nn.functional.linear
        return linear(torch.nn.functional.silu(linear(x, t["gate"])) * linear(x, t["up"]), t["down"])
    mm = torch._weight_int8pack_mm
    h = torch.nn.functional.silu(mm(x, t["gate"], t["gate_scale"])) * mm(x, t["up"], t["up_scale"])
    return mm(h, t["down"], t["down_scale"])


def candidates(threads: int) -> dict:
    """name -> (prepare(tensors) -> handle, call(x [n, H] float32, handle))."""
    executor = CpuExpertExecutor(threads)
    return {
        "numpy+ml_dtypes (astype, matmul)": (lambda t: t, numpy_expert),
        "torch cpu (bf16 linear / int8pack_mm)": (
            torch_views, lambda x, t: torch_expert(torch.from_numpy(x).to(torch.bfloat16), t).float().numpy()),
        "numba (prange rows, widen in L1, fp32 acc)": (lambda t: t, executor.run),
    }


def expert_bytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in tensors.values())


def measure_shape(name: str, dtype: str, rounds: int, threads: int, bandwidth: float) -> list[dict]:
    hidden, inter = SHAPES[name]
    rng = np.random.default_rng(0)
    one = make_expert(hidden, inter, dtype, rng)
    nbytes = expert_bytes(one)
    copies = [one] + [make_expert(hidden, inter, dtype, rng) for _ in range(max(1, -(-CYCLE_BYTES // nbytes)) - 1)]
    rows = []
    cands = candidates(threads)
    prepared = {c: [prep(t) for t in copies] for c, (prep, _) in cands.items()}
    for tokens in TOKENS:
        x = rng.standard_normal((tokens, hidden), dtype=np.float32)  # [T, H]
        reference = numpy_expert(x, one)
        times = {c: [] for c in cands}
        errors = {}
        for c, (_, call) in cands.items():  # warm-up (compiles), and the error against the float32 reference
            got = np.asarray(call(x, prepared[c][0]), dtype=np.float32)
            errors[c] = float(np.abs(got - reference).max() / np.abs(reference).max())
        for r in range(rounds):
            for c, (_, call) in cands.items():
                handle = prepared[c][(r + 1) % len(copies)]
                start = time.perf_counter()
                call(x, handle)
                times[c].append(time.perf_counter() - start)
        for c in cands:
            seconds = statistics.median(times[c])
            gbs = nbytes / seconds / 1e9
            rows.append({"shape": name, "hidden": hidden, "inter": inter, "dtype": dtype, "tokens": tokens,
                         "candidate": c, "expert_mb": nbytes / 1e6, "median_ms": seconds * 1e3,
                         "gbs": gbs, "pct_of_read_bw": 100 * gbs / bandwidth, "max_rel_err": errors[c]})
            print(f"{name:14} {dtype:4} T={tokens:<3} {c:44} {seconds * 1e3:9.3f} ms {gbs:7.2f} GB/s "
                  f"{100 * gbs / bandwidth:5.1f} %  err {errors[c]:.1e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b")
    parser.add_argument("--dtypes", default="bf16,int8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(args.rounds)
    print(f"read bandwidth: {bandwidth['all_threads_gbs']:.1f} GB/s with {args.threads} threads, "
          f"{bandwidth['numpy_one_thread_gbs']:.1f} GB/s one NumPy thread", flush=True)
    rows = []
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            rows += measure_shape(name, dtype, args.rounds, args.threads, bandwidth["all_threads_gbs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "numba": numba.__version__, "torch": torch.__version__,
                    "numpy": np.__version__},
        "read_bandwidth": bandwidth, "rounds": args.rounds, "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
