"""numba, when installed (the `cpu` extra), and what the CPU expert kernels share: compile options, the gated
activation."""

from __future__ import annotations

import numpy as np

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


# The gated activation as (limit, alpha, up_shift): clamp gate above at limit and up to +-limit, then
# gate * sigmoid(alpha gate) * (up + up_shift). SILU is silu(gate) * up; gpt-oss's clamped SwiGLU is
# (swiglu_limit, swiglu_alpha, 1).
SILU = (np.float32(np.inf), np.float32(1.0), np.float32(0.0))


def activation_of(swiglu) -> tuple:
    """The kernels' activation tuple for a ClampedSwiglu (None: SILU)."""
    if swiglu is None:
        return SILU
    return np.float32(swiglu.limit), np.float32(swiglu.alpha), np.float32(1.0)


@jit(inline="always", fastmath=FASTMATH)
def gated(gv, uv, activation):
    """One intermediate value from its gate and up products under `activation` (see SILU); float32."""
    limit, alpha, up_shift = activation
    gv = min(gv, limit)
    uv = max(min(uv, limit), -limit)
    return gv / (np.float32(1.0) + np.exp(-alpha * gv)) * (uv + up_shift)
