"""Launching our CUDA kernels from CuPy: which instantiations compile together, argument types, grid arithmetic.

`launch` compiles a kernel of kernels/*.cu on first use (kernels.py: one NVRTC run per file and weight type, for
every instantiation FAMILIES lists) and launches it, as a programmatic dependent launch inside a decode graph's
capture (launch.py).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .cupy_flash_attention import FLASH_FILE, flash_instantiations
from .kernels import get_kernel
from .launch import launch_programmatic, programmatic_active
from .tuning import (GQA_GROUPS, GQA_MAX_LANE_FLOATS, INT4_GEMV_ROWS, INT4_GEMV_TILES, INT4_ROW_SHARING,
                     LATENT_HEAD_TILES, LATENT_KERNEL_SHAPES, LATENT_PREFILL_SHAPES, LINEAR_MMA_TILES, MMA_TILES,
                     MOE_ROWS_PER_WARP, MOE_TILES, TOKEN_TILES)

Array = Any  # a cupy.ndarray
NULL = np.uint64(0)  # a null pointer kernel argument
DEFAULT_SHARED_LIMIT = 48 << 10  # dynamic shared memory a kernel may take without raising its limit

CTYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.uint16): "__nv_bfloat16",
    np.dtype(np.float16): "__half",
    np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "__nv_fp8_e4m3",  # KV caches only
}

# The instantiations compiled together with a kernel of each templated file, for weight type w.
FAMILIES = {
    # w __nv_fp8_e4m3 (a KV cache filled from float32): to_storage only
    "linear.cu": lambda w: (f"to_storage<{w}>",) if w == "__nv_fp8_e4m3" else (
        *(f"linear_rows<{w}, {tt}>" for tt in TOKEN_TILES), *(f"per_head_rows<{w}, {tt}>" for tt in TOKEN_TILES),
        f"to_storage<{w}>", f"to_storage_split<{w}>"),
    "embedding.cu": lambda w: (f"embedding<{w}>",),
    "router.cu": lambda w: (f"route_topk<{w}>", *(f"route_split<{w}, {tt}>" for tt in TOKEN_TILES)),
    # w None: moe_align and moe_sum only
    "moe.cu": lambda w: () if w is None else tuple(f"{k}<{w}, {tt}, {r}>" for k in ("moe_gate_up", "moe_down")
                                                   for tt in MOE_TILES for r in MOE_ROWS_PER_WARP),
    "moe_mma.cu": lambda w: tuple(f"{k}<{w}, {nt}>" for k in ("moe_gate_up_mma", "moe_down_mma")
                                  for nt in MMA_TILES) if w in ("__nv_bfloat16", "__half") else (),
    # w: the bytes of codes a lane reads per chunk of int4, B (16, 8 or 4; cupy_quant_moe.py), or "mxfp4" (groups
    # of 32: B = 4, the Mxfp4Codes policy)
    # w None: moe_gemm_tiles only; np: the activations' parts (matmul precision medium, high)
    "moe_gemm.cu": lambda w: tuple(f"{k}<{w}, {np}>" for k in ("moe_gemm_gate_up", "moe_gemm_down")
                                   for np in (1, 2)) if w in ("__nv_bfloat16", "__half") else (),
    "moe_int4.cu": lambda w: (*(f"moe_gate_up_int4<4, {nt}, {kw}, Mxfp4Codes>" for nt in MMA_TILES
                                for kw in (1, INT4_ROW_SHARING)),
                              *(f"moe_down_int4<4, {nt}, Mxfp4Codes>" for nt in MMA_TILES)) if w == "mxfp4" else (
        f"quantize_activations<{w}>", *(f"moe_gate_up_int4<{w}, {nt}, {kw}>" for nt in MMA_TILES
                                        for kw in (1, INT4_ROW_SHARING)),
        *(f"moe_down_int4<{w}, {nt}>" for nt in MMA_TILES)),
    # w: "int4" or "mxfp4", the codes policy
    "moe_int4_gemv.cu": lambda w: ("quantize_activations<4>", *(
        f"{k}<{'Mxfp4Codes' if w == 'mxfp4' else 'Int4Codes'}, {tt}, {INT4_GEMV_ROWS}>"
        for k in ("moe_gate_up_int4_gemv", "moe_down_int4_gemv") for tt in INT4_GEMV_TILES)),
    "moe_fp8.cu": lambda w: tuple(f"{k}<{nt}>" for k in ("moe_gate_up_fp8", "moe_down_fp8") for nt in MMA_TILES),
    "linear_mma.cu": lambda w: tuple(f"linear_mma<{w}, {nt}>" for nt in LINEAR_MMA_TILES)
    if w in ("__nv_bfloat16", "__half") else (),
    # w: the KV cache's element type (float, __nv_bfloat16, __half, __nv_fp8_e4m3)
    "attention.cu": lambda w: (*(f"paged_attention<{w}, {d}>" for d in (1, 2, 4, 8)),
                               *(f"paged_attention_gqa<{w}, {d}, {g}>" for d in (1, 2, 4, 8) for g in GQA_GROUPS
                                 if g * d <= GQA_MAX_LANE_FLOATS), "paged_attention_merge"),
    "attention_prologue.cu": lambda w: (f"qk_norm_rope_write<{w}>",),
    FLASH_FILE: flash_instantiations,  # w: the KV cache's element type
    # w: the KV cache's element type (latent_attention: the 16-bit and fp8 ones)
    "latent_attention.cu": lambda w: (f"latent_rope_write<{w}>", *(
        f"latent_attention<{w}, {rank}, {rope}, {split}, {mt}>" for rank, rope in LATENT_KERNEL_SHAPES
        for split in ("true", "false") for mt in LATENT_HEAD_TILES if w != "float")),
    # w: the KV cache's element type (its rows gathered into bf16)
    "latent_prefill.cu": lambda w: (f"latent_gather<{w}, __nv_bfloat16>", *(
        f"latent_prefill_attention<{nope}, {rope}, {value}>" for nope, rope, value in LATENT_PREFILL_SHAPES)),
}


def storage_type(array: Array) -> str:
    """The CUDA type of a device weight array's elements."""
    return CTYPES[np.dtype(array.dtype)]


def to_device_storage(array) -> Array:
    """A weight (host NumPy in any storage dtype, or already a device array) as a contiguous device array of a
    kernel-readable dtype (bfloat16 as uint16 bits, fp8 e4m3 as uint8 bits)."""
    import cupy

    if isinstance(array, np.ndarray):
        if array.dtype == ml_dtypes.bfloat16:
            array = array.view(np.uint16)
        elif array.dtype == ml_dtypes.float8_e4m3fn:
            array = array.view(np.uint8)
        return cupy.asarray(np.ascontiguousarray(array))
    return cupy.ascontiguousarray(array)


def check_row_width(cols: int, array: Array, what: str) -> None:
    """Refuse rows of `cols` elements of `array`'s dtype that are not whole 16-byte vectors."""
    vector = 16 // np.dtype(array.dtype).itemsize
    if cols % vector:
        raise ValueError(f"{what}: rows of {cols} {storage_type(array)} elements are not a multiple of {vector} "
                         "(the kernels read 16 bytes at a time)")


def launch(file: str, expression: str, grid: tuple[int, ...], block: int, args: tuple, shared_mem: int = 0,
           weight_type: str | None = None) -> None:
    """Launch kernel `expression` of kernels/<file> on the current stream (nothing for an empty grid); a
    templated file's family is compiled for `weight_type` (its CUDA type)."""
    if 0 in grid:
        return
    family = FAMILIES[file](weight_type) if file in FAMILIES else ()
    if "<" in expression and expression not in family:  # NVRTC would compile a module without it
        raise ValueError(f"{expression} is not among the instantiations of {file} compiled for weight type "
                         f"{weight_type!r}: {', '.join(family) or 'none'}")
    kernel = get_kernel(file, expression, family)
    if shared_mem > DEFAULT_SHARED_LIMIT:
        allow_shared_memory(kernel, shared_mem)
    if programmatic_active():  # a decode graph's capture (launch.py)
        launch_programmatic(kernel, grid, (block,), args, shared_mem)
    else:
        kernel(grid, (block,), args, shared_mem=shared_mem)


_shared_limits: dict[int, int] = {}  # CUDA function pointer -> the dynamic shared memory it is allowed


def allow_shared_memory(kernel, nbytes: int) -> None:
    """Raise a CuPy RawKernel's dynamic shared memory limit to at least `nbytes` (once per kernel and size; the GPU
    refuses more than its opt-in maximum at launch)."""
    function = kernel.kernel.ptr
    if _shared_limits.get(function, 0) >= nbytes:
        return
    kernel.max_dynamic_shared_size_bytes = nbytes
    _shared_limits[function] = nbytes


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up (blocks of b that cover a)."""
    return -(-a // b)


def smallest_tile(count: int, tiles: tuple[int, ...]) -> int:
    """The smallest tile that holds `count` rows (the largest tile when none does)."""
    return next((tile for tile in tiles if tile >= count), tiles[-1])

