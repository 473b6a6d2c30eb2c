"""Every kernel of kernels/*.cu compiles with NVRTC for sm_90, for every weight type the backend instantiates (and
every KV cache element type for the kernels that read or write the cache).

Compiling needs NVRTC and the CUDA headers, not a GPU: where CuPy and NVRTC are installed (a development machine
with the `gpu` extra, the GPU machine) this catches a broken kernel before any device time is spent.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu  # in the GPU lane (`pytest -m gpu`), though compiling needs NVRTC alone

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy is not installed (kernel compile checks need cupy-cuda12x/13x and NVRTC)")

from colibri_stream.backends.cupy_flash_attention import FLASH_FILE  # noqa: E402
from colibri_stream.backends.cupy_launch import FAMILIES  # noqa: E402
from colibri_stream.backends.cupy_quant_moe import INT4_LANE_BYTES  # noqa: E402
from colibri_stream.backends.kernels import COMPILE_OPTIONS, kernel_dir, kernel_source  # noqa: E402

WEIGHT_TYPES = ("float", "__nv_bfloat16", "__half", "signed char", "__nv_fp8_e4m3")
# templated on the KV cache's element type (linear.cu: its to_storage fills a cache from float32)
KV_FILES = ("attention.cu", "attention_prologue.cu", "flash_attention.cu", "latent_attention.cu", "latent_prefill.cu",
            "linear.cu")
ARCH = "compute_90"  # the H200


def _header_version(include: Path) -> tuple[int, int] | None:
    """(major, minor) of the CUDA headers in `include` (CUDART_VERSION of cuda_runtime_api.h), None if unknown."""
    try:
        found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (include / "cuda_runtime_api.h").read_text())
    except OSError:
        return None
    return None if found is None else (int(found.group(1)) // 1000, int(found.group(1)) % 1000 // 10)


def _include_dirs() -> list[str]:
    """CuPy's headers and a folder holding cuda_bf16.h (a CUDA toolkit, or the nvidia-* wheels): the first whose
    version is NVRTC's, else the first found. Headers newer than NVRTC can use what its built-in headers lack
    (CUDA 13's cuda_fp8.hpp under NVRTC 12.9 does)."""
    import cupy

    dirs = [str(Path(cupy.__file__).parent / "_core" / "include")]
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    candidates += glob.glob(str(Path(cupy.__file__).parents[1] / "nvidia" / "*"))
    found = [Path(root, "include") for root in candidates if root and Path(root, "include", "cuda_bf16.h").is_file()]
    if not found:
        pytest.skip("no CUDA headers (cuda_bf16.h) found for NVRTC")
    version = tuple(nvrtc.getVersion())
    matching = [include for include in found if _header_version(include) == version]
    return dirs + [str((matching or found)[0])]


def _compile(name: str, expressions: tuple[str, ...]) -> None:
    try:
        program = nvrtc.createProgram(kernel_source(name), name, [], [])
    except Exception as error:  # the NVRTC library itself is missing
        pytest.skip(f"NVRTC is not usable: {error}")
    for expression in expressions:
        nvrtc.addNameExpression(program, expression)
    options = [*COMPILE_OPTIONS, f"-arch={ARCH}", *(f"-I{d}" for d in _include_dirs())]
    try:
        nvrtc.compileProgram(program, options)
    except Exception:
        pytest.fail(f"{name} {expressions} does not compile:\n{nvrtc.getProgramLog(program)}")
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("name", sorted(p.name for p in kernel_dir().glob("*.cu")))
def test_kernel_file_compiles(name):
    if name not in FAMILIES:
        _compile(name, ())
        return
    if name == "moe_int4.cu":  # templated on the bytes of codes a lane reads
        for lane_bytes in INT4_LANE_BYTES:
            _compile(name, FAMILIES[name](str(lane_bytes)))
        return
    if name == "moe_int4_gemv.cu":  # templated on the codes policy
        for codes in ("int4", "mxfp4"):
            _compile(name, FAMILIES[name](codes))
        return
    if name == "moe_fp8.cu":
        _compile(name, FAMILIES[name](None))
        return
    for weight_type in WEIGHT_TYPES:
        if weight_type == "signed char" and name != "moe.cu":
            continue  # only routed experts are ever int8
        if weight_type == "__nv_fp8_e4m3" and name not in KV_FILES:
            continue  # fp8 is a KV cache type only
        _compile(name, FAMILIES[name](weight_type))


@pytest.mark.parametrize("stages", [3, 4])
def test_flash_decode_compiles_with_deeper_rings(stages, monkeypatch):
    """flash_decode's ring depth is a tuning constant (benchmarks/decode_attention.py sweeps it): other depths
    than the default compile too."""
    from colibri_stream.backends import tuning

    monkeypatch.setattr(tuning, "FLASH_DECODE_STAGES", stages)
    expressions = FAMILIES[FLASH_FILE]("__nv_bfloat16")
    assert f"flash_decode<__nv_bfloat16, 128, {stages}>" in expressions
    _compile(FLASH_FILE, expressions)
