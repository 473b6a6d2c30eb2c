"""numba, when installed (the `cpu` extra), and the compile options the CPU expert kernels share."""

from __future__ import annotations

try:
    import numba
except ImportError:  # the `cpu` extra is not installed: the NumPy path serves every expert
    numba = None

# Float32 sums may be reassociated (into SIMD lanes) and multiply-adds fused; no other fast-math assumption.
FASTMATH = {"reassoc", "contract"}
# Row chunks per thread. Each thread claims the next unclaimed chunk until none is left (an atomic counter), so a
# thread slowed by another process, or by the core the GPU's step thread shares, takes fewer chunks and the pass
# does not wait for it (numba's prange alone gives each thread a fixed equal share).
CHUNKS_PER_THREAD = 8


def jit(**options):
    """numba.njit(**options), compiled on first call; the plain function when numba is missing."""
    return numba.njit(cache=True, error_model="numpy", **options) if numba is not None else (lambda function: function)
