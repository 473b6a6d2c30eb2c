"""The host's share of sampling one decode step at V = 151936 with the OpenAI default parameters (temperature 1,
top_p 1, seeded), by batch size:

- numpy: `Sampler.sample` on whole host rows (the NumPy backend: candidates and exp sums computed by NumPy too);
- device: `Sampler.sample_from` a stand-in for `DeviceLogits` whose candidates and exp sums are already computed
  (as `top_candidates` hands them back), so only the host's work is timed. Rows it is asked for are copies of host
  memory: the PCIe copy of a real device (39 MB at batch 64) is not counted. `rows` says how many rows it copied
  per step.

    python benchmarks/sampling_host.py [--batch-sizes 16,64] [--steps 10] [--out benchmarks/results/sampling_host.json]

On the 2-core dev machine (--steps 20, medians), before and after rows over the whole vocabulary were served from
the candidates (commit 5a6716e); the synthetic logits send 1.45 of 64 rows a step beyond their candidates:

    B=16  numpy 10.7 -> 21.5 ms   device host share  8.8 -> 0.5 ms (rows copied 16 -> 0.45 a step)
    B=64  numpy 40   -> 94   ms   device host share 44.8 -> 3.1 ms (rows copied 64 -> 1.45 a step)

After the faster candidates, exact exp and walk of 4b6fd1f (same tokens; --steps 10, results JSON):

    B=16  numpy 24.9  -> 17.3 ms  device host share 0.57 -> 0.51 ms
    B=64  numpy 100.6 -> 68.7 ms  device host share 3.45 -> 2.69 ms
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from conditions import machine

from colibri_stream.request import SamplingParams
from colibri_stream.sampling import Candidates, HostLogits, Sampler, SamplingState

VOCAB = 151936
MAX_CANDIDATES = 1024  # backends/cupy_sampling.MAX_CANDIDATES, without importing CuPy


class PrecomputedLogits(HostLogits):
    """Host logits whose candidates (MAX_CANDIDATES of every row at each temperature asked) are computed before
    the clock starts, as a GPU computes them; `rows` counts the rows copied whole."""

    def __init__(self, logits: np.ndarray, temperature: float):
        super().__init__(logits)
        self.max_candidates = MAX_CANDIDATES
        rows = np.arange(len(logits))
        self.ready = super().candidates(rows, np.full(len(rows), temperature, np.float32), MAX_CANDIDATES,
                                        np.ones(len(rows), dtype=bool))
        self.copied = 0

    def rows(self, rows):
        self.copied += len(rows)
        return self.logits[rows].copy()

    def candidates(self, rows, temperature, count, lse_rows):
        return Candidates(*(getattr(self.ready, f.name)[rows, :count] if getattr(self.ready, f.name).ndim == 2
                            else getattr(self.ready, f.name)[rows] for f in fields(Candidates)))


def logits_like_a_model(rows: int, seed: int) -> np.ndarray:
    """[B, V] float32: a few dozen likely tokens over a long tail, as a language model's next-token logits."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, VOCAB), dtype=np.float32) * 2.0  # [B, V]
    logits[:, rng.integers(0, VOCAB, 40)] += 12.0
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sampling_host.json"))
    args = parser.parse_args()
    records = []
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=0)
    for batch in map(int, args.batch_sizes.split(",")):
        states = [SamplingState.from_params(params, [], index=b) for b in range(batch)]
        times = {"numpy": [], "device": []}
        copied = 0
        for step in range(args.steps):
            logits = logits_like_a_model(batch, step)
            start = time.perf_counter()
            Sampler().sample(logits, states)
            times["numpy"].append(time.perf_counter() - start)
            source = PrecomputedLogits(logits, 1.0)
            start = time.perf_counter()
            Sampler().sample_from(source, states)
            times["device"].append(time.perf_counter() - start)
            copied += source.copied
        record = {"bench": "sampling_host", **machine(), "vocab": VOCAB, "batch": batch, "steps": args.steps,
                  "params": "temperature 1, top_p 1, seeded", "logits": "synthetic: 40 likely tokens over a tail",
                  "numpy_ms_per_step": float(np.median(times["numpy"]) * 1e3),
                  "device_host_ms_per_step": float(np.median(times["device"]) * 1e3),
                  "rows_copied_per_step": copied / args.steps}
        records.append(record)
        print(f"B={batch:3d} V={VOCAB}: numpy {record['numpy_ms_per_step']:7.2f} ms/step, "
              f"device host share {record['device_host_ms_per_step']:7.2f} ms/step "
              f"(rows copied whole: {record['rows_copied_per_step']:.2f}/step)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
