"""The CuPy backend's paths made of CuPy array operations, for what its kernels do not take: Multi-head Latent
Attention (each head's up-projection, the rope parts and the cache rows [latent | rope key], attention over rows of
kv_lora_rank + rope width) and attention with sink logits, both through sequence_attention.py.

These steps read the batch on the host, so a model that takes them runs every step eagerly, without CUDA graphs
(`CupyBackend.captures`). Numerics as the NumPy backend's: float32 products of the weights and cache rows widened
to float32 (`KvRows.widen`), rows rounded to the cache's dtype when written (`CupyBackend.from_float32`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .rotary import rotate

# the storage dtype of a device array -> its name for CupyBackend.from_float32
STORAGE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16",
                 np.dtype(np.uint8): "float8_e4m3"}


class KvRows:
    """Device arrays of any storage dtype (float32, bf16 bits as uint16, float16, fp8 e4m3 bits as uint8) widened
    to float32."""

    def __init__(self, cp: Any):
        self.cp = cp
        self._fp8_values: Any = None  # [256] float32: the value of each fp8 e4m3 code, made on first use

    def widen(self, rows: Any, scale: float = 1.0) -> Any:
        """rows as float32, times `scale`."""
        cp = self.cp
        dtype = np.dtype(rows.dtype)
        if dtype == np.uint16:
            out = (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif dtype == np.uint8:
            if self._fp8_values is None:
                codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                self._fp8_values = cp.asarray(codes.astype(np.float32))
            out = self._fp8_values[rows.astype(np.int32)]
        else:
            out = rows.astype(np.float32)
        return out if scale == 1.0 else out * np.float32(scale)


def per_head_linear(cp: Any, rows: KvRows, x: Any, weight: Any) -> Any:
    """x [T, H, In] float32, weight [H, Out, In] (a storage dtype) -> [T, H, Out]: each head through its own
    matrix, one batched product."""
    w = rows.widen(weight)  # [H, Out, In]
    return cp.ascontiguousarray(cp.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2))


def latent_rope_write(backend: Any, q_latent: Any, q_rope: Any, latent: Any, k_rope: Any, cos: Any, sin: Any,
                      positions: Any, interleaved: bool, cache: Any, slot_mapping: Any, scale: float = 1.0) -> Any:
    """`Backend.latent_rope_write` on the device: q_rope and k_rope rotated, the rows [latent | rotated k_rope]
    divided by `scale` and rounded into cache [num_blocks, block_size, 1, R + r] at slot_mapping (a negative slot
    stores nothing), and the query [q_latent | rotated q_rope] [T, Q, R + r] returned."""
    cp = backend.cp
    q_rope = rotate(cp, q_rope, cos, sin, positions, interleaved)  # [T, Q, r]
    k_rope = rotate(cp, k_rope[:, None, :], cos, sin, positions, interleaved)  # [T, 1, r]
    rows = cp.concatenate([latent[:, None, :], k_rope], axis=-1)  # [T, 1, R + r]
    stored = slot_mapping >= 0  # [T]
    slots = slot_mapping[stored]  # [T']
    values = rows[stored] if scale == 1.0 else rows[stored] / np.float32(scale)  # [T', 1, R + r]
    flat = cache.reshape(-1, *cache.shape[2:])  # [num_blocks * block_size, 1, R + r]
    flat[slots] = backend.from_float32(cp.ascontiguousarray(values), STORAGE_NAMES[np.dtype(cache.dtype)])
    return cp.concatenate([q_latent, q_rope], axis=-1)  # [T, Q, R + r]
