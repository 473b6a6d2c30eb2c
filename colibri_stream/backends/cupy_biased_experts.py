"""Routed experts with biases or gpt-oss's clamped SwiGLU on the GPU, one expert at a time: the MoE kernels compute
silu(gate) * up of unbiased experts, so these take the backend's dense projections instead.

For each expert the step routes tokens to (read on the host: a synchronisation per MoE layer, so such a model runs
every step eagerly, `CupyBackend.captures`), its tokens go through `linear` with its gate and up rows and biases,
the activation (`clamped_swiglu`, else silu(gate) * up), `linear` with its down rows and bias, and are added into
the output weighted by their route weights. Every expert resident (DeviceExpertStore), of bf16, fp16 or float32
(loader.py refuses the rest).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ClampedSwiglu
from ..experts.cpu_executor import clamped_swiglu
from ..experts.device import LayerExperts

Array = Any


def experts_one_by_one(backend: Any, x: Array, weights: Array, expert_ids: Array, experts: LayerExperts,
                       swiglu: ClampedSwiglu | None) -> Array:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), each expert of `experts` (slot = expert id) with its
    biases where it has them.  # x [T, H], weights [T, k], expert_ids [T, k] -> [T, H]"""
    cp = backend.cp
    ids = cp.asnumpy(expert_ids)  # [T, k] on the host
    y = cp.zeros(x.shape, np.float32)  # [T, H]
    for expert in np.unique(ids):
        rows, picks = (cp.asarray(index) for index in np.nonzero(ids == expert))  # a token is routed once an expert
        tokens = x[rows]  # [n, H]
        gate = backend.linear(tokens, experts.gate[expert], _row(experts.gate_bias, expert))  # [n, I]
        up = backend.linear(tokens, experts.up[expert], _row(experts.up_bias, expert))  # [n, I]
        hidden = backend.silu_mul(gate, up) if swiglu is None else clamped_swiglu(gate, up, swiglu.limit, swiglu.alpha)
        out = backend.linear(hidden, experts.down[expert], _row(experts.down_bias, expert))  # [n, H]
        y[rows] += weights[rows, picks][:, None] * out
    return y


def _row(bias: Array | None, expert: int) -> Array | None:
    return None if bias is None else bias[expert]
