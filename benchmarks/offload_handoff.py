"""Batch-1 decode with CPU experts: the stream waiting on the CPU's flag against the host waiting, same process.

For each GPU expert fraction, placement mode (colibri: the cost model; cpu_only: every miss on the CPU) and CPU
executor thread count, two stores over the same pinned L2 are built: one whose compute stream waits on the CPU
thread's flag (`stream_waits`, the default) and one whose host waits for the CPU in `finish_layer`. Their decode
runs alternate `--rounds` times, so host noise falls on both. Per run: tok/s, step ms, the executor's seconds per
step (its own time, so a slower executor and a later start tell apart) and the step's phases. Uses offload.py's
model folder, measurement and decode loop.

    python benchmarks/offload_handoff.py --fractions 0.5 0 --threads 16 15 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import os
import sys

from conditions import require_gpu
from decode import log, machine
from offload import decode, make_model, measure, open_folder, release, write


def run(args) -> list[dict]:
    import numba

    folder, pinned = open_folder(args.folder, "mixtral-8x7b", args.layers)
    bw = measure(folder, pinned, None)
    common = dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                  bench="offload_handoff", shape="mixtral-8x7b", layers=args.layers, batch=1,
                  numba_threading_layer=numba.threading_layer(), pcie_gbps_measured=bw.pcie_gbps,
                  host_read_gbps_measured=bw.host_read_gbps, shared_host_read_gbps_measured=bw.shared_host_read_gbps,
                  shared_pcie_gbps_measured=bw.shared_pcie_gbps)
    records = []
    for fraction in args.fractions:
        slots = round(fraction * folder.config.num_experts)
        for mode in args.modes:
            for threads in args.threads:
                models = {waits: make_model(folder, slots, pinned, mode, threads, stream_waits=waits)
                          for waits in (True, False)}
                runs: dict[bool, list[dict]] = {True: [], False: []}
                for _ in range(args.rounds):
                    for waits, model in models.items():
                        runs[waits].append(decode(model, 1, args.steps))
                for waits, model in models.items():
                    figures = runs[waits]
                    record = dict(common, gpu_expert_fraction=fraction, mode=mode, cpu_threads=threads,
                                  handoff="stream" if waits else "host", runs=figures,
                                  tok_s=[f["tok_s"] for f in figures],
                                  best_tok_s=max(f["tok_s"] for f in figures))
                    records.append(record)
                    log(f"{fraction:.0%} {mode} {threads} threads, {record['handoff']} waits: "
                        + " ".join(f"{f['tok_s']:.1f}" for f in figures)
                        + f" tok/s; executor {1e3 * figures[-1]['cpu_seconds_per_step']:.1f} ms/step, "
                        f"step {1e3 * figures[-1]['step_s']:.1f} ms")
                models.clear()
                release(None)  # frees the two stores' GPU slots
                write(args.out, records)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--folder", default="/tmp/colibri-offload-model")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.0])
    parser.add_argument("--modes", nargs="+", default=["colibri", "cpu_only"], choices=["colibri", "cpu_only"])
    parser.add_argument("--threads", nargs="+", type=int, default=[16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/offload_handoff_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
