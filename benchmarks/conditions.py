"""The conditions a benchmark ran under, recorded next to its figures (CPU, cores, platform, versions, commit, load),
and the check that a GPU benchmark has its GPU."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np


def machine() -> dict:
    """This machine and checkout; the load average tells whether something else was running."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    # COLIBRI_COMMIT names the tree where git cannot (a copy of the working tree on another machine)
    commit = os.environ.get("COLIBRI_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "commit": commit, "load_average": os.getloadavg()}


def require_gpu() -> None:
    """Exit with a message naming what is missing unless CuPy sees a CUDA device: for scripts that time the GPU."""
    script = Path(sys.argv[0]).name
    try:
        import cupy
    except ImportError:
        sys.exit(f"{script} needs a GPU: CuPy is not installed (pip install \".[gpu]\")")
    if not cupy.cuda.is_available():
        sys.exit(f"{script} needs a GPU: CuPy finds no CUDA device")


@contextlib.contextmanager
def constants_set(modules, **values):
    """Module constants set to `values` meanwhile, in each of `modules` that defines them: a constant imported by
    name is a binding of the importing module too, so every module that reads one is named."""
    saved = [(module, name, getattr(module, name)) for module in modules for name in values if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, values[name])
    try:
        yield
    finally:
        for module, name, old in saved:
            setattr(module, name, old)
