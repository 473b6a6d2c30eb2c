"""The interface between expert stores and the GPU backend: experts as the MoE kernels see them on the device.

A store that computes on the GPU implements `DeviceExperts`: for each MoE layer's step it yields one
`LayerExperts` per launch of the MoE kernels (`passes`) and afterwards hands back what it computed elsewhere
(`finish_layer`). The backend needs nothing else from a store, and a store nothing of the backend: the arrays are
device arrays (CuPy), read here only for their pointers, strides and shapes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..expert_codecs import EXPERT_BIASES, WEIGHT_TENSORS
from .store import ExpertStore

Array = Any  # a device array (cupy.ndarray)
NULL = np.uint64(0)  # a null pointer kernel argument


def device_pointer(array: Array | None) -> np.uint64:
    """A device array's address as a kernel argument (NULL for an absent array)."""
    return NULL if array is None else np.uint64(array.data.ptr)


def slot_stride(array: Array | None) -> np.int64:
    """Elements from one slot of `array` to the next, as a kernel argument (0 for an absent array)."""
    return np.int64(0 if array is None else array.strides[0] // array.itemsize)


@dataclass
class LayerExperts:
    """A MoE layer's experts on the device as one launch of the MoE kernels sees them: matrices indexed by slot.

    Resident experts are views of stacked [E, 2I, H] and [E, H, I] arrays (slot = expert id, no table); experts
    in GPU slots are views of the slot arena in experts.bin's block layout, and `slot_of` maps expert ids to slots
    (negative: not computed by this launch). Rows are contiguous; gate and up share one stride per slot.
    """

    gate: Array  # [S, I, H] storage dtype; int4: [S, I, groups, width / 2] uint8 (expert_codecs.py)
    up: Array  # [S, I, H]
    down: Array  # [S, H, I]
    gate_scale: Array | None  # float32 scales: int8 [S, I] per row; int4 [S, I, groups]; fp8 [S, tiles...] or [S, I]
    up_scale: Array | None  # as gate_scale
    down_scale: Array | None  # [S, H], [S, H, groups], ...
    slot_of: Array | None = None  # [E] int32
    gate_zero: Array | None = None  # [S, I, groups] uint8 zero points of asymmetric int4 experts, else None
    up_zero: Array | None = None
    down_zero: Array | None = None
    gate_bias: Array | None = None  # [S, I] float32 (gpt-oss's biased experts), else None
    up_bias: Array | None = None  # [S, I]
    down_bias: Array | None = None  # [S, H]

    @classmethod
    def stacked(cls, w13: Array, w2: Array, s13: Array | None, s2: Array | None, b13: Array | None = None,
                b2: Array | None = None) -> LayerExperts:
        """Views of stacked arrays w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], s13 [E, 2I], s2 [E, H],
        and the biases b13 [E, 2I] (gate's, then up's), b2 [E, H] where the experts have them."""
        i = w2.shape[2]
        return cls(w13[:, :i], w13[:, i:], w2, None if s13 is None else s13[:, :i],
                   None if s13 is None else s13[:, i:], s2, gate_bias=None if b13 is None else b13[:, :i],
                   up_bias=None if b13 is None else b13[:, i:], down_bias=b2)

    @classmethod
    def from_arrays(cls, arrays: dict[str, Array], slot_of: Array | None) -> LayerExperts:
        """From device arrays named as an expert block's tensors (gate, up, down and, for the quantized formats,
        their scales and zero points; biased experts' biases), each with a leading slot axis."""
        return cls(arrays["gate"], arrays["up"], arrays["down"], arrays.get("gate_scale"), arrays.get("up_scale"),
                   arrays.get("down_scale"), slot_of, arrays.get("gate_zero"), arrays.get("up_zero"),
                   arrays.get("down_zero"), arrays.get("gate_bias"), arrays.get("up_bias"), arrays.get("down_bias"))

    def named(self) -> dict[str, Array]:
        """The arrays by block tensor name (those present), slot axis first."""
        return {name: getattr(self, name) for name in (*WEIGHT_TENSORS, *EXPERT_BIASES) if getattr(self, name) is not None}

    def kernel_args(self, activation: tuple) -> tuple[tuple, tuple]:
        """(gate/up arguments, down arguments) of moe_gate_up and moe_down: pointers and strides per slot, the
        biases (null where the experts have none) and `activation` (limit, alpha, up_shift: common.cuh's
        GatedActivation)."""
        if self.gate.strides != self.up.strides:
            raise ValueError("gate and up of a layer's experts must share their strides")
        slot_of = device_pointer(self.slot_of)
        gate_up = (device_pointer(self.gate), device_pointer(self.up), slot_stride(self.gate),
                   device_pointer(self.gate_scale), device_pointer(self.up_scale), slot_stride(self.gate_scale),
                   *self.gate_up_bias_args(), *activation, slot_of)
        down = (device_pointer(self.down), slot_stride(self.down), device_pointer(self.down_scale),
                slot_stride(self.down_scale), *self.down_bias_args(), slot_of)
        return gate_up, down

    def gate_up_bias_args(self) -> tuple:
        """gate_bias, up_bias, their slot stride: the MoE kernels' bias arguments (nulls without biases)."""
        if self.gate_bias is not None and (self.gate_bias.strides != self.up_bias.strides):
            raise ValueError("gate and up biases of a layer's experts must share their strides")
        return device_pointer(self.gate_bias), device_pointer(self.up_bias), slot_stride(self.gate_bias)

    def down_bias_args(self) -> tuple:
        """down_bias and its slot stride (null and 0 without biases)."""
        return device_pointer(self.down_bias), slot_stride(self.down_bias)


class DeviceExperts(ExpertStore):
    """A store whose experts the GPU backend computes in place on the device.

    For MoE layer `layer`'s step, after `begin_layer`: `passes(layer)` yields one LayerExperts per launch of the
    MoE kernels (the backend launches them before asking for the next), then `finish_layer(layer)` returns the
    weighted sum [T, H] (device) of the experts the store computed elsewhere, or None.
    """

    num_experts: int  # E: the length of every slot table
    resident: bool  # every expert of a step computed by its passes (none elsewhere: every pair gets a value)

    @abstractmethod
    def passes(self, layer: int) -> Iterable[LayerExperts]:
        ...

    @abstractmethod
    def finish_layer(self, layer: int) -> Array | None:
        ...

    def device_experts(self) -> DeviceExperts:
        return self

    def on_device(self, upload) -> ExpertStore:
        return self
