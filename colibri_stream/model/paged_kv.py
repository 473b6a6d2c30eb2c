"""The paged key/value cache arrays: per layer, keys and values in fixed-size blocks of token rows.

The element type is a property of the cache, not of the model (`--kv-cache-dtype`): bfloat16 by default (float16
for a float16 model), fp8 e4m3 on request, float32 for the reference. Keys and values are rounded once, when they
are written; every read widens them to float32, so attention computes in float32 on either backend. An fp8 cache
stores key / k_scale and value / v_scale (saturated at +-448) and reads them times the scale: per layer, 1.0
(vLLM's fp8 without scales from the checkpoint; docs/KV_CACHE.md says why).

Sliding-window layers may keep their blocks in a pool of their own (`SlidingLayers`): their arrays hold that pool's
blocks and one more, the placeholder that released table entries name (sliding_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import Array, Backend
from ..config import ModelConfig
from ..errors import ConfigError

# --kv-cache-dtype option -> storage dtype of the cache arrays ("auto" resolves through resolve_kv_dtype)
KV_CACHE_STORAGE = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3", "fp32": "float32"}
KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float8_e4m3": 1, "float32": 4}  # bytes per key or value element


def resolve_kv_dtype(option: str, model: ModelConfig) -> str:
    """The storage dtype of the KV cache for the option `option` (auto | bf16 | fp16 | fp8 | fp32).

    auto: float16 when the model's dense weights are float16 (its activations were trained to fit that range),
    otherwise bfloat16 (bfloat16 and float32 models alike: float32 only where asked for, as the reference)."""
    if option == "auto":
        return "float16" if model.dtype == "float16" else "bfloat16"
    if option not in KV_CACHE_STORAGE:
        raise ConfigError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_STORAGE)}, got {option!r}")
    return KV_CACHE_STORAGE[option]


def kv_row_shape(config: ModelConfig) -> tuple[int, int]:
    """(heads, width) of what a token stores in one layer's cache arrays: K heads of D (keys, and values as many),
    or MLA's one row of its latent and rotated rope key [kv_lora_rank + rotary_dim], the keys and values of every
    query head at once (attention reads the one array as both)."""
    if config.attention == "mla":
        return 1, config.kv_lora_rank + config.rotary_dim
    return config.num_kv_heads, config.head_dim


def kv_bytes_per_token(config: ModelConfig, dtype: str, num_layers: int | None = None) -> int:
    """Memory one token's keys and values take over `num_layers` layers (all by default), in the cache's storage
    dtype."""
    heads, width = kv_row_shape(config)
    arrays = 1 if config.attention == "mla" else 2
    return arrays * (config.num_layers if num_layers is None else num_layers) * heads * width * KV_DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class SlidingLayers:
    """The layers whose KV a pool of their own holds, each sequence only its last `window` tokens' blocks there."""

    layers: tuple[int, ...]
    window: int  # the largest of their windows: what the pool keeps of every sequence

    @classmethod
    def of(cls, config: ModelConfig, max_seq_len: int) -> SlidingLayers | None:
        """The layers whose window is shorter than `max_seq_len` (a longer one reads a sequence's whole context),
        or None when there are none."""
        layers = tuple(layer for layer, w in enumerate(config.sliding_windows) if w is not None and w < max_seq_len)
        if not layers:
            return None
        return cls(layers, max(config.sliding_windows[layer] for layer in layers))


@dataclass
class PagedKVCache:
    """keys[l], values[l]: [num_blocks, block_size, K, D] of layer l in `dtype` (MLA: one array [num_blocks,
    block_size, 1, kv_lora_rank + rotary_dim], values[l] the same object as keys[l]; a layer of `sliding_layers`:
    [num_sliding_blocks + 1, block_size, K, D]); block ids come from the block manager. k_scales[l], v_scales[l]:
    what a stored key or value of layer l is multiplied by when read (1.0 but for an fp8 cache given other
    scales)."""

    keys: list[Array]
    values: list[Array]
    num_blocks: int
    block_size: int
    dtype: str  # storage dtype of every array: bfloat16, float16, float8_e4m3 or float32
    k_scales: list[float]
    v_scales: list[float]
    sliding_layers: frozenset[int] = frozenset()  # layers whose arrays hold the sliding pool's blocks instead
    num_sliding_blocks: int = 0  # blocks of the sliding pool; its layers' arrays hold one more, the placeholder

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int, backend: Backend,
                 dtype: str = "bfloat16", sliding: SlidingLayers | None = None,
                 num_sliding_blocks: int = 0) -> PagedKVCache:
        """Zeroed arrays for every layer: `num_blocks` blocks, or for the layers of `sliding` the sliding pool's
        `num_sliding_blocks` and its placeholder."""
        if num_blocks <= 0 or block_size <= 0 or (sliding is not None and num_sliding_blocks <= 0):
            raise ValueError("the KV cache needs at least one block of at least one token")
        if dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
        sliding_layers = frozenset(() if sliding is None else sliding.layers)
        keys = [backend.zeros((num_sliding_blocks + 1 if layer in sliding_layers else num_blocks, block_size,
                               *kv_row_shape(config)), dtype) for layer in range(config.num_layers)]
        return cls(
            keys=keys,
            values=list(keys) if config.attention == "mla" else [backend.zeros(k.shape, dtype) for k in keys],
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            k_scales=[1.0] * config.num_layers,
            v_scales=[1.0] * config.num_layers,
            sliding_layers=sliding_layers,
            num_sliding_blocks=0 if sliding is None else num_sliding_blocks,
        )
