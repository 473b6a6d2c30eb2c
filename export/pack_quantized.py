"""compressed-tensors `pack-quantized` int4 checkpoints (W4A16, as llm-compressor writes them).

config.json: `quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
"quantization_status": "compressed", "config_groups": {...: {"weights": {"num_bits": 4, "type": "int",
"strategy": "group", "group_size": g, "symmetric": ...}}}}`. Each quantized Linear `<m>.weight` [out, in] is

    <m>.weight_packed      int32 [out, in / 8]: eight 4-bit codes a word, input channel 8j + k in bits 4k..4k+3,
                           each the signed value q in -8..7 stored as q + 8
    <m>.weight_scale       bf16, fp16 or fp32 [out, in / g]
    <m>.weight_shape       int [2]: out, in
    <m>.weight_zero_point  int32 [ceil(out / 8), in / g], asymmetric only: the signed zero point z in -8..7 plus 8,
                           packed the same way along the output dimension

and dequantized = (q - z) * scale (z = 0 when symmetric). Our int4 codec stores code = q + 8 and zero = z + 8
(8 when symmetric), so w = (code - zero) * scale is the same number; only the packing changes (two codes a byte,
groups as rows of [out, in / g, g / 2]) and the scale widens to float32 exactly. compressed-tensors quantizes a
matrix only when g divides its input channels, so every group is whole.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..config import INT4_GROUP_SIZES
from ..errors import CheckpointError, UnsupportedModelError
from ..expert_codecs import Int4Codec, pack_nibbles
from .hf_checkpoint import HFCheckpoint, TensorInfo
from .quantized_source import QuantizedSource, expect_tensor

PACKED, SCALE, SHAPE, ZERO = "_packed", "_scale", "_shape", "_zero_point"
SCALE_DTYPES = ("BF16", "F16", "F32")
CODES_PER_WORD = 8
# Activation orders that only permute columns while calibrating: the stored weights keep the original order
# ("group" stores a g_idx permutation instead, which is refused)
STORED_IN_ORDER = (None, "weight", "static")


def _refused(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"config.json: quantization_config {what} is not supported (Colibri imports compressed-tensors "
        f"pack-quantized int4 weights, strategy group, group size {'/'.join(map(str, INT4_GROUP_SIZES))}, "
        "symmetric or with zero points, no activation quantization)")


def _weight_scheme(quantization: dict) -> tuple[int, bool]:
    """(group size, symmetric) of the config groups, which must agree (experts.bin holds one format)."""
    if quantization.get("format") != "pack-quantized":
        raise _refused(f"format {quantization.get('format')!r}")
    if quantization.get("quantization_status", "compressed") != "compressed":
        raise _refused(f"quantization_status {quantization['quantization_status']!r}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quantization.get(key):
            raise _refused(key)
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refused("without config_groups")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise _refused(f"{name} {key}")
        if group.get("format") not in (None, "pack-quantized"):
            raise _refused(f"{name} format {group['format']!r}")
        wanted = {"num_bits": 4, "type": "int", "strategy": "group"}
        for key, value in wanted.items():
            if weights.get(key) != value:
                raise _refused(f"{name} weights {key} {weights.get(key)!r}")
        if weights.get("dynamic", False):
            raise _refused(f"{name} weights dynamic {weights['dynamic']!r}")
        if weights.get("actorder") not in STORED_IN_ORDER:
            raise _refused(f"{name} weights actorder {weights['actorder']!r}")
        if weights.get("group_size") not in INT4_GROUP_SIZES:
            raise _refused(f"{name} weights group_size {weights.get('group_size')!r}")
        schemes.add((weights["group_size"], bool(weights.get("symmetric", True))))
    if len(schemes) > 1:
        raise _refused(f"with config groups of different weight schemes {sorted(schemes)}")
    return schemes.pop()


class PackQuantizedSource(QuantizedSource):
    """compressed-tensors pack-quantized int4 weights with a scale (and optional zero point) per group."""

    def __init__(self, quantization: dict):
        self.group_size, self.symmetric = _weight_scheme(quantization)
        self.codec = Int4Codec(self.group_size, not self.symmetric)
        self.description = f"compressed-tensors pack-quantized int4, {self.codec.describe()}"

    def expert_format(self):
        return dict(expert_dtype="int4", expert_group_size=self.group_size, expert_zero_point=not self.symmetric)

    def _suffixes(self) -> tuple[str, ...]:
        return (PACKED, SCALE, SHAPE) + (() if self.symmetric else (ZERO,))

    def weights(self, tensors: Mapping[str, TensorInfo]):
        weights = [name[: -len(PACKED)] for name in tensors if name.endswith(".weight" + PACKED)]
        return {weight: tuple(weight + suffix for suffix in self._suffixes()) for weight in weights}

    def check(self, tensors, weight, shape):
        out, inp = shape
        if inp % self.group_size:
            raise CheckpointError(f"{weight} has {inp} input channels, not a multiple of the group size "
                                  f"{self.group_size}")
        groups = inp // self.group_size
        expect_tensor(tensors, weight + PACKED, ("I32",), (out, -(-inp // CODES_PER_WORD)))
        expect_tensor(tensors, weight + SCALE, SCALE_DTYPES, (out, groups))
        expect_tensor(tensors, weight + SHAPE, ("I32", "I64"), (2,))
        if not self.symmetric:
            expect_tensor(tensors, weight + ZERO, ("I32",), (-(-out // CODES_PER_WORD), groups))

    def read(self, checkpoint: HFCheckpoint, weight, shape):
        out, inp = shape
        stored = tuple(int(n) for n in checkpoint.read(weight + SHAPE))
        if stored != shape:
            raise CheckpointError(f"{weight}{SHAPE} says {list(stored)}, the model implies {list(shape)}")
        codes = unpack_int32_codes(checkpoint.read(weight + PACKED))[:, :inp]  # [out, in] q + 8
        grouped = codes.reshape(out, inp // self.group_size, self.group_size)  # [out, groups, g]
        parts = {"": pack_nibbles(grouped),  # [out, groups, g / 2]
                 "_scale": checkpoint.read(weight + SCALE).astype(np.float32)}  # [out, groups]
        if not np.isfinite(parts["_scale"]).all():
            raise CheckpointError(f"{weight}{SCALE} holds non-finite scales: the checkpoint is corrupt")
        if not self.symmetric:
            zero = unpack_int32_codes(checkpoint.read(weight + ZERO).T).T  # [ceil(out/8) * 8, groups] z + 8
            parts["_zero"] = np.ascontiguousarray(zero[:out])
        return parts


def unpack_int32_codes(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, words] of eight 4-bit codes each, the k-th in bits 4k..4k+3 -> uint8 [rows, 8 * words]."""
    words = packed.astype("<i4").view(np.uint32)
    shifts = np.arange(CODES_PER_WORD, dtype=np.uint32) * 4  # [8]
    return ((words[..., None] >> shifts) & 15).astype(np.uint8).reshape(packed.shape[0], -1)
