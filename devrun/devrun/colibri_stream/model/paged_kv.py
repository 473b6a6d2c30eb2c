"""The paged key/value cache arrays: per layer, keys and values in fixed-size blocks of token rows."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Array, Backend
from ..config import ModelConfig

KV_DTYPE_BYTES = 4  # float32 keys and values


@dataclass
class PagedKVCache:
    """keys[l], values[l]: [num_blocks, block_size, K, D] of layer l; block ids come from the block manager."""

    keys: list[Array]
    values: list[Array]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int, backend: Backend) -> PagedKVCache:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("the KV cache needs at least one block of at least one token")
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(
            keys=[backend.zeros(shape) for _ in range(config.num_layers)],
            values=[backend.zeros(shape) for _ in range(config.num_layers)],
            num_blocks=num_blocks,
            block_size=block_size,
        )

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int) -> int:
        """Memory one block takes over all layers, keys and values."""
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * KV_DTYPE_BYTES
