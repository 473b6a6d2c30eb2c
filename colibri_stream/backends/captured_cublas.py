"""cuBLAS GEMMs inside a CUDA-graph capture, called through ctypes.

CuPy's cuBLAS wrappers refuse to run while a stream captures ("calling cuBLAS API during stream capture is
currently unsupported"), but cuBLAS itself records its kernels into a capture like any other launch. A decode
graph uses this for lm_head from CAPTURED_CUBLAS_MIN_TOKENS tokens, where cuBLAS reads a large vocabulary's
matrix faster than linear_mma (benchmarks/dense_projection.py compares them), and for every projection from
CAPTURED_CUBLAS_ALL_MIN_TOKENS tokens (backends/tuning.py).

The handle is CuPy's (its workspace is allocated by the eager warm-up step that precedes every capture); the calls
are stream-ordered on the capturing stream, and the engine never runs an eager cuBLAS call concurrently with a
graph replay, so the workspace is not shared between two running GEMMs.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The libcublas CuPy loaded (found in this process's mappings, so the CUDA major version matches)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublas.so" in line and "libcublasLt" not in line}
    if not paths:
        raise RuntimeError("libcublas is not loaded (make one cuBLAS call through CuPy first)")
    library = ctypes.CDLL(sorted(paths)[0])
    library.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.cublasSetPointerMode_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.cublasGemmEx.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # handle, ops, m n k
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # alpha, A, A type, lda
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # B, B type, ldb
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # beta, C, C type, ldc
        ctypes.c_int, ctypes.c_int]  # compute type, algorithm
    for name in ("cublasSetStream_v2", "cublasSetPointerMode_v2", "cublasGemmEx"):
        getattr(library, name).restype = ctypes.c_int
    return library


def gemm_ex(handle: int, stream: int, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int,
            lda: int, b: int, b_type: int, ldb: int, c: int, c_type: int, ldc: int, compute_type: int,
            algorithm: int, accumulate: bool = False) -> None:
    """C = A op B, or C += A op B with `accumulate` (alpha 1, beta 0 or 1, host pointer mode) on `stream`, as
    cublasGemmEx; device pointers as ints."""
    library = _library()
    one, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
    _check(library.cublasSetStream_v2(handle, stream), "cublasSetStream")
    _check(library.cublasSetPointerMode_v2(handle, 0), "cublasSetPointerMode")  # 0: host
    _check(library.cublasGemmEx(handle, transa, transb, m, n, k, ctypes.byref(one), a, a_type, lda, b, b_type, ldb,
                                ctypes.byref(beta), c, c_type, ldc, compute_type, algorithm), "cublasGemmEx")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with cublasStatus {status}")
