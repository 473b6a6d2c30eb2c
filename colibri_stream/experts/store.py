"""Where the model gets routed experts from.

`ExpertStore` is the interface the backends' MoE code calls; `MappedExpertStore` serves every expert straight from
the memory map of experts.bin (the tier the GPU and host caches will sit in front of).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..checkpoint import ExpertFile


class ExpertStore(ABC):
    """Gives the tensors of one routed expert in the storage layout of experts.bin.

    `expert(layer, e)` returns gate [I, H], up [I, H], down [H, I] in the expert dtype, plus gate_scale [I],
    up_scale [I], down_scale [H] (float32) for int8 experts.
    """

    @abstractmethod
    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        ...


class MappedExpertStore(ExpertStore):
    """Every expert read from the memory-mapped experts.bin; the OS page cache does the caching."""

    def __init__(self, expert_file: ExpertFile):
        self.file = expert_file

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return self.file.tensors(layer, expert)
