"""Decode and offload figures of two revisions on one machine, run alternately: the change against its baseline.

The current tree and a baseline tree (`--baseline-tree`: a folder holding an older revision's `colibri_stream/`,
`kernels/` and `benchmarks/`, as `git archive REV colibri_stream kernels benchmarks | tar -x -C DIR` writes it;
its kernels/ is copied into its package so that it compiles its own, `own_kernels`) each run their own `benchmarks/decode.py` (Colibri only) and `benchmarks/offload.py` (Colibri's default mode, host
RAM tier, `--fractions` of the experts on the GPU, each tree's model in a folder of its own, written by that
tree), `--rounds` times, alternating, each run in a fresh process whose
`PYTHONPATH` is that tree. The medians of each revision's runs are compared: `ratio` = current / baseline.
Records (`bench: "compare_revisions"`) go to `--out`; the Markdown table is printed.

    python benchmarks/compare_revisions.py --baseline-tree devold --out /tmp/compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conditions import machine, require_gpu

ROOT = Path(__file__).resolve().parents[1]


def own_kernels(tree: Path) -> None:
    """Make `tree`'s package load its own kernels/: revisions whose `kernel_dir()` asks for the package data
    `colibri_stream._kernels` first would get the editable install's (the current tree's) through it, so the
    baseline tree gets that package as a copy of its kernels/."""
    package = tree / "colibri_stream" / "_kernels"
    if (tree / "kernels").is_dir() and not package.is_dir():
        shutil.copytree(tree / "kernels", package)
        (package / "__init__.py").write_text("")


def run_tree(tree: Path, script: str, args: list[str], out: Path, timeout: float) -> list[dict]:
    """Run `tree`'s benchmarks/`script` with `args --out out` in a fresh process on that tree; its records."""
    env = dict(os.environ, PYTHONPATH=f"{tree}:{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out)]
    begin = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name}/{script} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    print(f"  {tree.name}/{script}: {time.perf_counter() - begin:.0f} s", flush=True)
    return json.loads(out.read_text())


def figures(script: str, records: list[dict]) -> dict[str, float]:
    """The throughput figures of one run by case name."""
    if script == "decode.py":
        return {f"decode {r['shape']} b{r['batch']}": r["colibri_tok_s"] for r in records if r.get("colibri_tok_s")}
    return {f"offload {r.get('shape', '')} {r['gpu_expert_fraction']:.0%} b{r['batch']}": r["colibri_tok_s"]
            for r in records if r.get("colibri_tok_s") and r.get("source") == "l2"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", required=True)
    parser.add_argument("--baseline-label", default="baseline", help="what the baseline tree is (a commit)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-args", default="--no-baseline --shapes mixtral-8x7b qwen3-30b-a3b --batches 1 16 64")
    parser.add_argument("--offload-args", default="--modes colibri --sources l2 --fractions 0.5 --batches 1 16 "
                        "--accelerate-fractions --steps 8")
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode.py", "offload.py"])
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare_revisions.json"))
    args = parser.parse_args(argv)
    require_gpu()  # its decode and offload runs time the GPU
    trees = {"current": ROOT, "baseline": Path(args.baseline_tree).resolve()}
    own_kernels(trees["baseline"])
    scripts = {s: a for s, a in (("decode.py", args.decode_args), ("offload.py", args.offload_args))
               if s not in args.skip}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for script, script_args in scripts.items():
                order = ("current", "baseline") if round_ % 2 == 0 else ("baseline", "current")
                for label in order:
                    out = Path(tmp) / f"{label}_{script}_{round_}.json"
                    tree_args = script_args.split()
                    if script == "offload.py":  # each tree writes its model in its own format
                        tree_args += ["--folder", str(Path(tmp) / f"{label}-offload-model")]
                    try:
                        records = run_tree(trees[label], script, tree_args, out, args.timeout)
                    except Exception as error:  # one failed run is reported; the others go on
                        errors.append(f"round {round_} {label} {script}: {error}")
                        print(errors[-1], flush=True)
                        continue
                    run = figures(script, records)
                    if not run:  # the script ran but measured nothing: its records say why
                        errors.append(f"round {round_} {label} {script}: no figures in {json.dumps(records)[-1500:]}")
                        print(errors[-1], flush=True)
                    runs.setdefault((label, script), []).append(run)
    common = dict(machine(), bench="compare_revisions", baseline=args.baseline_label, rounds=args.rounds,
                  decode_args=args.decode_args, offload_args=args.offload_args, errors=errors)
    records = []
    for script in scripts:
        current, baseline = runs.get(("current", script), []), runs.get(("baseline", script), [])
        for case in sorted({k for run in current + baseline for k in run}):
            ours = [run[case] for run in current if case in run]
            theirs = [run[case] for run in baseline if case in run]
            record = dict(common, case=case, current_tok_s=statistics.median(ours) if ours else None,
                          baseline_tok_s=statistics.median(theirs) if theirs else None,
                          current_runs=ours, baseline_runs=theirs)
            if ours and theirs:
                record["ratio"] = record["current_tok_s"] / record["baseline_tok_s"]
            records.append(record)
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    print("| case | current tok/s | baseline tok/s | current / baseline |\n|---|---|---|---|")
    for r in records:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        print(f"| {r['case']} | {r['current_tok_s'] or 0:.1f} | {r['baseline_tok_s'] or 0:.1f} | {ratio} |")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
