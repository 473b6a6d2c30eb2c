"""What a reader of one pre-quantized checkpoint format provides to the exporter (export/quantized_sources.py picks
the reader from config.json's quantization_config).

A quantized Linear weight `<module>.weight` [out, in] is stored as several checkpoint tensors (the values and their
scales, under names of the format's own). A reader lists those tensors per weight, checks their dtypes and shapes
from the headers, and reads a weight as the tensors of one of our expert codecs (expert_codecs.py): routed experts
are written to experts.bin as they are, dense weights are dequantized by the same codec. A format that quantizes
fused experts (gpt-oss's MXFP4, `stacked`) stores a layer's experts as one weight, a stack [E, out, in] named as
the unquantized stack (`...experts.gate_up_proj`), and reads one expert's rows of it at a time (`read_expert`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np

from ..errors import CheckpointError
from ..expert_codecs import ExpertCodec
from .hf_checkpoint import HFCheckpoint, TensorInfo


class QuantizedSource(ABC):
    """A checkpoint format whose Linear weights are stored quantized, read as `codec`'s tensors."""

    codec: ExpertCodec  # the routed experts' format in experts.bin
    description: str  # the format in words, for messages
    stacked = False  # whether weights may be stacks of experts' matrices [E, out, in] (read_expert)

    @abstractmethod
    def expert_format(self) -> dict:
        """config.json's expert format fields (expert_dtype and its parameters) of the imported experts."""

    @abstractmethod
    def weights(self, tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[str, ...]]:
        """Each quantized weight `<module>.weight` (or stack) of the checkpoint -> the names of the tensors that
        store it."""

    @abstractmethod
    def check(self, tensors: Mapping[str, TensorInfo], weight: str, shape: tuple[int, ...]) -> None:
        """CheckpointError unless the tensors of `weight` have the dtypes and shapes of a [out, in] = `shape` matrix
        (or, `stacked`, of a stack [E, out, in] = `shape`)."""

    @abstractmethod
    def read(self, checkpoint: HFCheckpoint, weight: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """The codec's tensors of `weight` by suffix ("", "_scale", "_zero"), from the checkpoint's own values."""

    def read_expert(self, checkpoint: HFCheckpoint, weight: str, expert: int, rows: slice) -> dict[str, np.ndarray]:
        """The codec's tensors of rows `rows` of expert `expert`'s matrix in the stack `weight` (`stacked` only)."""
        raise NotImplementedError(f"{self.description} stores no stacks of experts")


def expect_tensor(tensors: Mapping[str, TensorInfo], name: str, dtypes: tuple[str, ...],
                  shape: tuple[int, ...]) -> None:
    """CheckpointError unless tensor `name` exists with one of `dtypes` (safetensors codes) and `shape`."""
    info = tensors.get(name)
    if info is None:
        raise CheckpointError(f"{name} is missing from the checkpoint")
    if info.dtype not in dtypes:
        raise CheckpointError(f"{name} is stored as {info.dtype}; the format stores it as {' or '.join(dtypes)}")
    if info.shape != tuple(shape):
        raise CheckpointError(f"{name} has shape {list(info.shape)}, its weight implies {list(shape)}")
