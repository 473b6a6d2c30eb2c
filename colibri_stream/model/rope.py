"""Rotary position embedding tables (host NumPy math; backends upload the tables once).

The inverse frequencies follow the RoPE variants these models ship with: plain, linear interpolation, Llama 3's
frequency-band scaling and YaRN. The rotation pairs dimension i with i + D/2 ("rotate half"), as the Hugging Face
implementations of Mixtral, Qwen and OLMoE do.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [D/2] float64, attention scaling applied to cos and sin)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # [D/2]
    base_freq = 1.0 / rope.theta**exponents  # [D/2]
    if rope.type == "default":
        return base_freq, 1.0
    if rope.type == "linear":
        return base_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(base_freq, rope), 1.0
    return _yarn(rope, head_dim)


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (DeepSeek's weighting `m`)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    original = rope.original_max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32.0
    beta_slow = rope.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # [D/2]
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin for every position below max_positions.  # [P, D/2] float32 each"""
    inv_freq, scaling = inverse_frequencies(rope, head_dim)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq.astype(np.float32)[None, :]  # [P, D/2]
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)
