"""gpt-oss's MXFP4 experts, as openai/gpt-oss-20b and gpt-oss-120b ship them.

config.json: `quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}` (transformers'
Mxfp4Config). Each MoE layer's routed experts are two fused stacks in OCP Microscaling MXFP4, rows being output
channels:

    model.layers.N.mlp.experts.gate_up_proj_blocks   uint8 [E, 2I, H/32, 16]: two e2m1 codes a byte, the even input
                                                     channel in the low nibble
    model.layers.N.mlp.experts.gate_up_proj_scales   uint8 [E, 2I, H/32]: an e8m0 exponent (+ 127) per 32 channels
    model.layers.N.mlp.experts.down_proj_blocks      uint8 [E, H, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales      uint8 [E, H, I/32]

and dequantized = E2M1[code] * 2**(scale - 127), which is our mxfp4 codec's layout, so the bytes are kept as they are.
gate_up's rows interleave the two matrices, gate in the even rows and up in the odd ones (transformers dequantizes
the stack to [E, 2I, H], transposes it to gate_up_proj [E, H, 2I] and takes gate = [..., ::2], up = [..., 1::2]):
an expert's gate is the even rows of its blocks and scales. The biases (gate_up_proj_bias [E, 2I], down_proj_bias
[E, H]), attention, router, norms and embeddings are bf16, read as in the unquantized checkpoints.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..config import MXFP4_BLOCK
from ..errors import CheckpointError, UnsupportedModelError
from ..expert_codecs import E8M0_NAN, Mxfp4Codec
from .hf_checkpoint import HFCheckpoint, TensorInfo
from .quantized_source import QuantizedSource, expect_tensor

BLOCKS, SCALES = "_blocks", "_scales"
# quantization_config's keys, none of which changes the stored weights: the skip list (the tensors say which weights
# are quantized) and transformers' load-time option to dequantize
KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


class Mxfp4ExpertSource(QuantizedSource):
    """MXFP4 weights (gpt-oss's fused expert stacks): e2m1 codes and an e8m0 exponent per 32 input channels."""

    codec = Mxfp4Codec()
    description = "gpt-oss MXFP4"
    stacked = True

    def __init__(self, quantization: dict):
        # the last expert read of a stack, whole: its gate and its up are rows of the same bytes, read once
        self._last: tuple[tuple[str, int], dict[str, np.ndarray]] | None = None
        for key, value in quantization.items():
            if key not in KEYS:
                raise UnsupportedModelError(f"config.json: quantization_config {key} {value!r} is not supported "
                                            f"(Colibri imports mxfp4 with the keys {', '.join(KEYS)})")

    def expert_format(self):
        return dict(expert_dtype="mxfp4")

    def weights(self, tensors: Mapping[str, TensorInfo]):
        bases = [name[: -len(BLOCKS)] for name in tensors if name.endswith(BLOCKS)]
        return {base: (base + BLOCKS, base + SCALES) for base in bases}

    def check(self, tensors, weight, shape):
        *stack, out, inp = shape
        if inp % MXFP4_BLOCK:
            raise CheckpointError(f"{weight} has {inp} input channels, not a multiple of MXFP4's {MXFP4_BLOCK}")
        blocks = inp // MXFP4_BLOCK
        expect_tensor(tensors, weight + BLOCKS, ("U8",), (*stack, out, blocks, MXFP4_BLOCK // 2))
        expect_tensor(tensors, weight + SCALES, ("U8",), (*stack, out, blocks))

    def read(self, checkpoint: HFCheckpoint, weight, shape):
        return _checked(weight + SCALES, {"": checkpoint.read(weight + BLOCKS),
                                          "_scale": checkpoint.read(weight + SCALES)})

    def read_expert(self, checkpoint: HFCheckpoint, weight, expert, rows):
        if self._last is None or self._last[0] != (weight, expert):
            whole = _checked(f"{weight}{SCALES}[{expert}]", {"": checkpoint.read(weight + BLOCKS, (expert,)),
                                                             "_scale": checkpoint.read(weight + SCALES, (expert,))})
            self._last = ((weight, expert), whole)
        return {suffix: part[rows] for suffix, part in self._last[1].items()}


def _checked(scales: str, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`parts` (codes [out, in/32, 16], exponents [out, in/32], read from the tensor `scales`), unless an exponent
    is e8m0's NaN (CheckpointError)."""
    if np.any(parts["_scale"] == E8M0_NAN):
        raise CheckpointError(f"{scales} holds the scale {E8M0_NAN}, e8m0's NaN: the checkpoint is corrupt")
    return parts
