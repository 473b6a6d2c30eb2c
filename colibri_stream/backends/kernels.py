"""Run-time compilation of kernels/*.cu with CuPy (NVRTC), memoised per (file, template instantiations, arch).

The sources ship inside the wheel as the folder `colibri_stream/_kernels` (the repository's `kernels/`, package data
with no `__init__.py`, so that the repository root on `sys.path` does not shadow the `kernels` distribution that
transformers imports); in a checkout they are read from `kernels/` directly. `#include "x.cuh"` lines of our own
headers are inlined before compiling, so CuPy's on-disk cache (keyed on the source text) never serves a binary
built from an older header.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)
COMPILE_OPTIONS = ("-std=c++17",)


def kernel_dir() -> Path:
    """The folder holding the .cu sources: kernels/ of the source tree this package was imported from (a checkout,
    an editable install, or another revision's tree put first on the path), else the installed package data."""
    source = Path(__file__).resolve().parents[2]
    if (source / "pyproject.toml").is_file() and (source / "kernels" / "common.cuh").is_file():
        return source / "kernels"
    return Path(__file__).resolve().parents[1] / "_kernels"


@functools.lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of kernels/<name> with our own headers inlined (once each)."""
    folder = kernel_dir()
    seen: set[str] = set()

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        text = (folder / header).read_text().replace("#pragma once\n", "")
        return _INCLUDE.sub(inline, text)

    return _INCLUDE.sub(inline, (folder / name).read_text())


def _arch() -> str:
    import cupy

    return cupy.cuda.Device().compute_capability


@functools.lru_cache(maxsize=None)
def _module(name: str, expressions: tuple[str, ...], arch: str):
    import cupy

    return cupy.RawModule(code=kernel_source(name), options=COMPILE_OPTIONS, name_expressions=list(expressions) or None)


def get_kernel(name: str, expression: str, expressions: tuple[str, ...] = ()):
    """The kernel `expression` (a function name, or a template instantiation such as "linear_rows<float, 4>")
    of kernels/<name>, compiled for the current GPU.

    `expressions` lists the instantiations compiled together in one module (one NVRTC run); it must contain
    `expression`. Plain `extern "C"` kernels need none.
    """
    module = _module(name, expressions, _arch())
    return module.get_function(expression)
