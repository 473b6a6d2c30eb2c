"""The GPU slot arena: every MoE layer's expert slots and one staging block in one device allocation.

Each block is 4 KiB aligned and in experts.bin's layout, so a load is one host-to-device copy of a whole block; the
MoE kernels read the blocks in place through per-slot strides and a slot table per layer (device.LayerExperts).
The staging block serves one expert that finds every slot taken, or a cut expert's packed GPU rows (cut_layout.py).
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import BLOCK_ALIGNMENT, ExpertFile, expert_block_layout
from .cut_layout import DEVICE_DTYPES, CutLayout
from .device import LayerExperts


class DeviceSlots:
    """The GPU arena: `slots[rank]` blocks for each MoE layer, one layer after the other, then one staging block, in
    experts.bin's layout.

    `view(rank)` gives the layer's LayerExperts: tensors indexed by the layer's local slot (0 .. slots - 1; the
    staging block is local slot `staging(rank)`), with the layer's device slot table attached.
    """

    def __init__(self, expert_file: ExpertFile, slots: list[int]):
        import cupy

        config = expert_file.config
        self.block_size = expert_file.block_size
        self.first = [sum(slots[:rank]) for rank in range(len(slots))]  # each layer's first block in the arena
        self.total = sum(slots) + 1  # + staging
        self.memory = cupy.cuda.alloc(self.total * self.block_size + BLOCK_ALIGNMENT)
        self.base = self.memory.ptr + (-self.memory.ptr % BLOCK_ALIGNMENT)  # first block, 4 KiB aligned
        tensors, _ = expert_block_layout(config)
        self.tensors = tensors
        self.tables = [cupy.full(config.num_experts, -1, np.int32) for _ in config.moe_layers]  # [E] per layer
        self.cut_table = cupy.full(config.num_experts, -1, np.int32)  # [E]: the cut expert -> 0 (its packed GPU rows)
        self._views = []
        for rank, first in enumerate(self.first):
            arrays = {}
            for t in tensors:
                dtype = np.dtype(DEVICE_DTYPES[t.dtype])
                inner = [dtype.itemsize]
                for extent in reversed(t.shape[1:]):
                    inner.insert(0, inner[0] * extent)
                pointer = self.memory + (self.base - self.memory.ptr + first * self.block_size + t.offset)
                arrays[t.name] = cupy.ndarray((self.total - first, *t.shape), dtype, memptr=pointer,
                                              strides=(self.block_size, *inner))
            self._views.append(LayerExperts.from_arrays(arrays, self.tables[rank]))

    def view(self, rank: int) -> LayerExperts:
        return self._views[rank]

    def cut_view(self, layout: CutLayout, expert: int) -> LayerExperts:
        """LayerExperts of the GPU part of a cut expert packed (by `layout`) into the staging block: one slot, the
        table mapping `expert` to it."""
        table = np.full(len(self.cut_table), -1, np.int32)
        table[expert] = 0
        self.cut_table.set(table)
        arrays = layout.arrays(self.memory, self.base - self.memory.ptr + (self.total - 1) * self.block_size)
        return LayerExperts.from_arrays(arrays, self.cut_table)

    def staging(self, rank: int) -> int:
        """The staging block as a local slot of layer `rank`."""
        return self.total - 1 - self.first[rank]

    def pointer(self, rank: int, slot: int) -> int:
        """Device address of layer `rank`'s local slot."""
        return self.base + (self.first[rank] + int(slot)) * self.block_size  # Python ints: no overflow
