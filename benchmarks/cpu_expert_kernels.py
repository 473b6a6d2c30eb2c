"""Candidates for computing one routed expert on the host CPU, next to a plain read of the same bytes.

One expert's SiLU-gated MLP, down(silu(gate x) * up x), at published expert shapes, for T tokens routed to it, in
bf16, int8 (per-row float32 scales), int4 (groups of 128) and fp8 (128 x 128 tile scales) (expert_codecs.py),
with 1 or more threads. Figures of merit: weight bytes read per second (what
decides decode speed at 1-4 tokens) and GFLOP/s (2 * T * parameters per second: what decides it at 8-64 tokens).
Candidates:

- `stream`: a numba parallel sum over the expert's weight bytes (as uint64 words), the practical read ceiling;
- `numpy`: `astype(float32)` of each matrix, then `x @ W.T` (the NumPy-backend path);
- `torch`: bf16 `F.linear` on zero-copy bf16 views (bf16 activations), int8 through `torch._weight_int8pack_mm`
  (not run for int4 and fp8);
- `numba`: `CpuExpertExecutor`'s kernel as checked out;
- `baseline`: the same executor from another git revision (`--baseline REV`), to measure a kernel change.

Each expert is copied until the calls cycle through at least 768 MiB, each call on the next copy, so calls read
from RAM, not the L3; weights are random normal (never zeros); candidates are interleaved round by round after a
warm-up call that also measures the error against the float32 reference; the median of the rounds is reported.

    python benchmarks/cpu_expert_kernels.py [--shapes qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b]
        [--dtypes bf16,int8,int4,fp8] [--tokens 1,4,16,64] [--threads 1,2] [--candidates stream,numpy,torch,numba]
        [--baseline REV] [--rounds 9]

Writes benchmarks/results/cpu_expert_kernels.json; docs/CPU_EXPERTS.md discusses the results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import torch

from colibri_stream.expert_codecs import Fp8Codec, Int4Codec
from colibri_stream.experts.cpu_executor import CpuExpertExecutor, numpy_expert

SHAPES = {  # name: (hidden H, expert intermediate I)
    "qwen3-30b-a3b": (2048, 768),
    "olmoe-1b-7b": (2048, 1024),
    "mixtral-8x7b": (4096, 14336),
}
CODECS = {"int4": Int4Codec(128, False), "fp8": Fp8Codec("block")}  # the formats quantized by their codec
TORCH_DTYPES = ("bf16", "int8")  # the formats the torch candidate computes
CYCLE_BYTES = 768 << 20  # the calls cycle through at least this much expert memory
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu_expert_kernels.json"


@numba.njit(parallel=True, nogil=True)
def _read(words):
    """Sum of words [N] uint64 over every numba thread: one read of the bytes, nothing else."""
    chunks = numba.get_num_threads() * 4
    parts = np.zeros(chunks, np.uint64)
    for c in numba.prange(chunks):
        part = words[c * words.shape[0] // chunks:(c + 1) * words.shape[0] // chunks]  # a slice: unit-stride loads
        acc = np.uint64(0)
        for i in range(part.shape[0]):
            acc += part[i]
        parts[c] = acc
    return parts.sum()


def read_weights(tensors: dict[str, np.ndarray]) -> int:
    """The stream candidate: reads gate, up and down (contiguous, whole 8-byte words) once."""
    return sum(int(_read(tensors[name].reshape(-1).view(np.uint64))) for name in ("gate", "up", "down"))


def make_expert(hidden: int, inter: int, dtype: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random gate [I, H], up [I, H], down [H, I] in bf16, int8 with float32 row scales, or a codec's format."""
    tensors = {}
    for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if dtype in CODECS:
            tensors.update(CODECS[dtype].quantize_matrix(name, w))
        elif dtype == "bf16":
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


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def baseline_module(rev: str):
    """cpu_executor.py as of git revision `rev` (or the file at that path, where there is no git history),
    imported beside the checked-out one (its own numba cache)."""
    source = Path(rev).read_text() if Path(rev).is_file() else git("show", f"{rev}:colibri_stream/experts/cpu_executor.py")
    path = Path(tempfile.mkdtemp(prefix="cpu_executor_")) / "cpu_executor_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("colibri_stream.experts.cpu_executor_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def candidates(names: list[str], threads: int, baseline) -> dict:
    """name -> (prepare(tensors) -> handle, call(x [n, H] float32, handle))."""
    every = {
        "stream": (lambda t: t, lambda x, t: read_weights(t)),
        "numpy": (lambda t: t, numpy_expert),
        "torch": (torch_views,
                  lambda x, t: torch_expert(torch.from_numpy(x).to(torch.bfloat16), t).float().numpy()),
        "numba": (lambda t: t, CpuExpertExecutor(threads).run),
    }
    if baseline is not None:
        every["baseline"] = (lambda t: t, baseline.CpuExpertExecutor(threads).run)
    return {name: every[name] for name in names}


def expert_bytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in tensors.values())


def measure_shape(name: str, dtype: str, args, baseline) -> list[dict]:
    hidden, inter = SHAPES[name]
    rng = np.random.default_rng(0)
    one = make_expert(hidden, inter, dtype, rng)
    nbytes, params = expert_bytes(one), 3 * hidden * inter
    cycle_bytes = args.cycle_mib << 20
    copies = [one] + [make_expert(hidden, inter, dtype, rng) for _ in range(max(1, -(-cycle_bytes // nbytes)) - 1)]
    rows = []
    for threads in args.threads:
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        cands = candidates([c for c in args.candidates if c != "torch" or dtype in TORCH_DTYPES], threads, baseline)
        prepared = {c: [prep(t) for t in copies] for c, (prep, _) in cands.items()}
        for tokens in args.tokens:
            x = rng.standard_normal((tokens, hidden), dtype=np.float32)  # [T, H]
            reference = numpy_expert(x, one)
            times = {c: [] for c in cands}
            errors = {}
            for c, (_, call) in cands.items():  # warm-up (compiles), and the error against the float32 reference
                got = call(x, prepared[c][0])
                if c != "stream":
                    errors[c] = float(np.abs(np.asarray(got, np.float32) - reference).max() / np.abs(reference).max())
            for r in range(args.rounds):
                for i, (c, (_, call)) in enumerate(cands.items()):
                    # every call takes the next copy, so none finds the one before it (a small expert) in the L3
                    handle = prepared[c][(1 + r * len(cands) + i) % len(copies)]
                    start = time.perf_counter()
                    call(x, handle)
                    times[c].append(time.perf_counter() - start)
            stream = statistics.median(times["stream"]) if "stream" in times else None
            for c in cands:
                seconds = statistics.median(times[c])
                row = {"shape": name, "hidden": hidden, "inter": inter, "dtype": dtype, "threads": threads,
                       "tokens": tokens, "candidate": c, "expert_mb": nbytes / 1e6, "median_ms": seconds * 1e3,
                       "min_ms": min(times[c]) * 1e3, "gbs": nbytes / seconds / 1e9,
                       "gflops": 2 * tokens * params / seconds / 1e9,
                       "pct_of_stream": 100 * stream / seconds if stream else None, "max_rel_err": errors.get(c)}
                rows.append(row)
                pct = f"{row['pct_of_stream']:5.0f} %" if stream else ""
                err = f"err {errors[c]:.1e}" if c in errors else ""
                print(f"{name:14} {dtype:4} {threads:2} thr T={tokens:<3} {c:9} {seconds * 1e3:9.3f} ms "
                      f"{row['gbs']:7.2f} GB/s {row['gflops']:7.1f} GFLOP/s {pct} {err}", flush=True)
    return rows


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def threading_layer() -> str | None:
    """numba's threading layer (omp, tbb or workqueue), once a parallel function has run."""
    try:
        return numba.threading_layer()
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b")
    parser.add_argument("--dtypes", default="bf16,int8", help="of bf16, int8, int4, fp8")
    parser.add_argument("--tokens", type=ints, default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=ints, default=[numba.config.NUMBA_NUM_THREADS])
    parser.add_argument("--candidates", type=lambda text: text.split(","),
                        default=["stream", "numpy", "torch", "numba"])
    parser.add_argument("--baseline", help="git revision (or cpu_executor.py file) whose CpuExpertExecutor runs as the "
                        "`baseline` candidate")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cycle-mib", type=int, default=CYCLE_BYTES >> 20,
                        help="expert memory the calls cycle through (MiB): more than the CPU's caches hold")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    baseline = baseline_commit = None
    if args.baseline:
        baseline = baseline_module(args.baseline)
        # the commit that last changed the baseline's cpu_executor.py
        baseline_commit = (f"file {args.baseline}" if Path(args.baseline).is_file() else
                           git("log", "-1", "--format=%H", args.baseline, "--", "colibri_stream/experts/cpu_executor.py"))
        if "baseline" not in args.candidates:
            args.candidates.append("baseline")
    rows = []
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            rows += measure_shape(name, dtype, args, baseline)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "numba": numba.__version__, "threading_layer": threading_layer(),
                    "torch": torch.__version__, "numpy": np.__version__},
        "baseline": baseline_commit and baseline_commit.strip(), "rounds": args.rounds,
        "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
