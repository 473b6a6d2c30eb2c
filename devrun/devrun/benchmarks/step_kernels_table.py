"""Nsight Compute's CSV of one decode step (benchmarks/step_kernels.py) as a table: each kernel launch in order with
its duration, DRAM bytes read and their rate, then the sum per kernel name.

    python benchmarks/step_kernels_table.py ncu.csv
"""

from __future__ import annotations

import csv
import io
import sys
from collections import defaultdict


def read(path: str) -> list[dict]:
    """Launches in order: {"id", "kernel", "grid", metric name: value}."""
    text = open(path).read()
    start = text.find('"ID"')
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        launch = launches.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row["Kernel Name"].split("(")[0]})
        value = row["Metric Value"].replace(",", "")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3, "byte": 1,
                 "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}.get(row["Metric Unit"], 1)
        try:
            launch[row["Metric Name"]] = float(value) * scale
        except ValueError:
            launch[row["Metric Name"]] = value
    return sorted(launches.values(), key=lambda launch: launch["id"])


def main(argv: list[str]) -> int:
    launches = read(argv[0])
    print("| # | kernel | grid | us | MB read | GB/s |\n|---|---|---|---|---|---|")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for launch in launches:
        us, nbytes = launch.get("gpu__time_duration.sum", 0.0), launch.get("dram__bytes_read.sum", 0.0)
        print(f"| {launch['id']} | {launch['kernel']} | {launch.get('launch__grid_size', '')} | {us:.1f} "
              f"| {nbytes / 1e6:.2f} | {nbytes / us / 1e3 if us else 0:.0f} |")
        total = totals[launch["kernel"]]
        total[0] += 1
        total[1] += us
        total[2] += nbytes
    print("\n| kernel | launches | us | MB read | GB/s |\n|---|---|---|---|---|")
    for name, (count, us, nbytes) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"| {name} | {count} | {us:.1f} | {nbytes / 1e6:.1f} | {nbytes / us / 1e3 if us else 0:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
