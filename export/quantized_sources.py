"""The reader of a checkpoint's quantization_config, or a one-line refusal naming what Colibri imports."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, UnsupportedModelError
from .fp8_blocks import Fp8BlockSource
from .mxfp4_experts import Mxfp4ExpertSource
from .pack_quantized import PackQuantizedSource
from .quantized_source import QuantizedSource

READERS = {"fp8": Fp8BlockSource, "compressed-tensors": PackQuantizedSource, "mxfp4": Mxfp4ExpertSource}
IMPORTED = ("fp8 e4m3 with 128x128 block scales (quant_method fp8), "
            "compressed-tensors pack-quantized int4 (quant_method compressed-tensors), "
            "gpt-oss's MXFP4 experts (quant_method mxfp4)")


def quantized_source(raw: dict[str, Any]) -> QuantizedSource | None:
    """The reader of config.json `raw`'s quantization_config; None for an unquantized checkpoint."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise CheckpointError(f"config.json: quantization_config must be an object, got {quantization!r}")
    method = quantization.get("quant_method")
    if method not in READERS:
        raise UnsupportedModelError(f"config.json: quantization_config quant_method {method!r} is not supported; "
                                    f"Colibri imports {IMPORTED}")
    return READERS[method](quantization)
