"""tests/test_kernel_compile.py where NVRTC is installed apart from the test environment (CI): COLIBRI_NVRTC_SITE names
a folder of the NVRTC, CUDA header and CuPy wheels (`.ci/nvrtc_site.sh FOLDER` installs them). The kernel checks run
in a child process whose path alone holds that folder, so no other test sees CuPy on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).resolve().parent / "test_kernel_compile.py"


def test_every_kernel_compiles_with_nvrtc_from_wheels():
    site = os.environ.get("COLIBRI_NVRTC_SITE")
    if not site:
        pytest.skip("COLIBRI_NVRTC_SITE is not set (`.ci/nvrtc_site.sh FOLDER` installs NVRTC there)")
    if importlib.util.find_spec("cupy_backends") is not None:
        pytest.skip("CuPy is installed here: tests/test_kernel_compile.py compiles the kernels itself")
    site = Path(site).resolve()
    assert (site / "cupy_backends").is_dir(), f"COLIBRI_NVRTC_SITE={site} holds no CuPy (run .ci/nvrtc_site.sh)"
    paths = [str(site), os.environ.get("PYTHONPATH", "")]
    libraries = [str(site / "nvidia" / "cuda_nvrtc" / "lib"), os.environ.get("LD_LIBRARY_PATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)),
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, libraries)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)],
                          env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, done.stdout[-4000:]
