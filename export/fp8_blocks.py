"""FP8 block-scaled checkpoints as DeepSeek-V3/R1 and the Qwen3 `-FP8` releases ship them.

config.json: `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}` (transformers' FineGrainedFP8Config). Each quantized Linear is `<m>.weight`
float8_e4m3fn [out, in] with `<m>.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)], one per 128 x 128 tile
(the last tiles of a dimension not divisible by 128 partial): dequantized = weight * scale_inv of its tile, which is
our fp8 codec's block layout, so the bytes and scales are kept as they are. Modules left unquantized
(`modules_to_not_convert`, usually the embeddings, lm_head and the router) are plain weights without a scale.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import CheckpointError, UnsupportedModelError
from ..expert_codecs import FP8_BLOCK, Fp8Codec
from .hf_checkpoint import HFCheckpoint, TensorInfo
from .quantized_source import QuantizedSource, expect_tensor

SCALE_SUFFIX = "_scale_inv"
# What the reader honours, per key of quantization_config: the values each key may take (absent keys take
# transformers' defaults, the first). MiniMax-M2 names the format float8_e4m3fn. DeepSeek-V3.1 declares scale_fmt
# ue8m0: its weight_scale_inv are float32 powers of two (the scales its activations are rounded to), and a weight is
# still value * scale_inv; ue8m0 scales stored as bytes are refused by their dtype
SUPPORTED = {"fmt": ("e4m3", "float8_e4m3fn"), "activation_scheme": ("dynamic",),
             "weight_block_size": ([FP8_BLOCK, FP8_BLOCK],), "scale_fmt": ("float", "ue8m0"),
             "expert_dtype": ("fp8",)}
# Keys that do not change the stored weights: the skip lists (the tensors' dtypes say which are quantized) and
# transformers' load-time option to dequantize
IGNORED_KEYS = ("quant_method", "modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize")
SCALE_DTYPES = ("F32", "BF16")  # float32 in DeepSeek-V3's checkpoints; bfloat16 widens to float32 exactly


class Fp8BlockSource(QuantizedSource):
    """float8 e4m3 weights with a float32 `weight_scale_inv` per 128 x 128 tile."""

    codec = Fp8Codec("block")
    description = "fp8 e4m3 with 128x128 block scales"

    def __init__(self, quantization: dict):
        for key, value in quantization.items():
            if key in IGNORED_KEYS:
                continue
            if key not in SUPPORTED or value not in SUPPORTED[key]:
                raise UnsupportedModelError(f"config.json: quantization_config {key} {value!r} is not supported "
                                            f"(Colibri imports fp8 with {_supported_words()})")

    def expert_format(self):
        return dict(expert_dtype="fp8", expert_scales="block")

    def weights(self, tensors: Mapping[str, TensorInfo]):
        return {name: (name, name + SCALE_SUFFIX) for name, info in tensors.items()
                if name.endswith(".weight") and info.dtype == "F8_E4M3"}

    def check(self, tensors, weight, shape):
        expect_tensor(tensors, weight, ("F8_E4M3",), shape)
        expect_tensor(tensors, weight + SCALE_SUFFIX, SCALE_DTYPES, self.codec.matrix_tensors(*shape)[1][2])

    def read(self, checkpoint: HFCheckpoint, weight, shape):
        values = checkpoint.read(weight)  # [out, in] e4m3
        scale = checkpoint.read(weight + SCALE_SUFFIX).astype(np.float32)  # [ceil(out/128), ceil(in/128)]
        if np.isnan(values.astype(np.float32)).any() or not np.isfinite(scale).all():
            raise CheckpointError(f"{weight} holds NaN values or non-finite scales: the checkpoint is corrupt")
        return {"": values, "_scale": scale}


def _supported_words() -> str:
    return ", ".join(f"{key} {' or '.join(map(repr, values))}" for key, values in SUPPORTED.items())
