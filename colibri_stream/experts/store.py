"""Where the model gets routed experts from.

`ExpertStore` is the interface the backends' MoE code calls; `MappedExpertStore` serves every expert straight from
the memory map of experts.bin (every expert resident: nothing to manage). `tiers.TieredExpertStore` keeps a bounded
set of slots in front of experts.bin; `trace.RoutingRecorder` wraps either to record routing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..checkpoint import ExpertFile
from ..expert_codecs import dequantize_expert
from ..timing import StepTimer

if TYPE_CHECKING:
    from .stats import ExpertStats


class ExpertStore(ABC):
    """Gives the tensors of one routed expert in the storage layout of experts.bin.

    `expert(layer, e)` returns the expert's tensors as its codec stores them (expert_codecs.py): gate [I, H],
    up [I, H], down [H, I] in the expert dtype, plus for the quantized formats their scales (int8: gate_scale [I],
    up_scale [I], down_scale [H] float32) and zero points. The arrays stay valid until the next `expert` or
    `begin_layer` call.

    The model calls `begin_layer(layer, x, expert_ids, weights)` once per MoE layer and step, after routing and
    before the first `expert` call of that layer: x [T, H] is the layer's MoE input, expert_ids [T, k] the router's
    choice and weights [T, k] its weights.
    A store that predicts later layers' experts or records routing uses it; the rest ignore it.
    A store that reads blocks times those reads as phases of `timer`, which the model sets to its step timer.
    """

    timer: StepTimer = StepTimer()  # disabled until the model hands over its own
    # Whether a step through this store can be captured in a CUDA graph: it needs nothing of the host between the
    # kernels of a layer (every expert computed on the device, nothing recorded).
    capturable: bool = False

    def begin_layer(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights=None) -> None:
        """The step reached MoE layer `layer`; its tokens chose `expert_ids` with routing `weights` [T, k]."""

    @abstractmethod
    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        ...

    def device_experts(self) -> ExpertStore | None:
        """The store (a device.DeviceExperts) the GPU backend's MoE kernels compute from (None: this store serves
        host tensors only)."""
        return None

    def on_device(self, upload: Callable[[ExpertStore], ExpertStore]) -> ExpertStore:
        """This store with its experts on the device: `upload(store)` gives a device.DeviceExperts holding a
        store's experts; a store already on the device returns itself, a wrapper wraps its inner store's."""
        return upload(self)

    def stats(self) -> ExpertStats | None:
        """A snapshot of the store's counters (None: the store counts nothing)."""
        return None

    def flush(self) -> None:
        """Write out whatever the store records (routing trace, usage counts)."""

    def close(self) -> None:
        """Stop the store's threads (joined before this returns) and close its files; nothing uses it after."""


class MappedExpertStore(ExpertStore):
    """Every expert read from the memory-mapped experts.bin; the OS page cache does the caching. A block's CRC32
    is checked the first time it is read (`ExpertFile.tensors`), so a corrupt one is a CheckpointError naming
    its layer and expert, never weights.

    With a `shard` (a rank of an expert-parallel group, experts/expert_parallel.py) the store holds those of the
    model's expert ids only, numbered 0 .. len(shard) - 1 in every MoE layer; asking it for any other number is a
    ValueError. Without, it holds every expert, numbered by its id."""

    def __init__(self, expert_file: ExpertFile, shard: range | None = None):
        self.file = expert_file
        self.shard = shard

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        if self.shard is None:
            return self.file.tensors(layer, expert)
        if not 0 <= expert < len(self.shard):
            raise ValueError(f"expert {expert} of layer {layer} is outside this store's shard: it holds the model's "
                             f"experts {self.shard.start}-{self.shard.stop - 1}, numbered 0-{len(self.shard) - 1}")
        return self.file.tensors(layer, self.shard[expert])


class Float32ExpertStore(ExpertStore):
    """A small resident model's experts, each widened to float32 once on first use and kept (their codec's
    dequantize: int8 times its per-row scales, bf16 and fp16 cast, ...), so the CPU computes them without
    converting every step. The arrays are exactly what `codecs.dequantize_expert` gives, so results do not
    change."""

    def __init__(self, inner: MappedExpertStore):
        self.inner = inner
        self._cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        tensors = self._cache.get((layer, expert))
        if tensors is None:
            tensors = dequantize_expert(self.inner.expert(layer, expert))
            self._cache[(layer, expert)] = tensors
        return tensors

    def close(self) -> None:
        self.inner.close()
