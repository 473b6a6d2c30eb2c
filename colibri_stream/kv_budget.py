"""How large the paged KV cache is, and the longest sequence it lets the engine accept.

Pure functions of numbers (free and total memory, bytes per token, the options), so every rule is tested without a
GPU; the engine measures the memory (`Backend.memory_info`) after the weights and expert slots are loaded and
hands it in. The rules (docs/KV_CACHE.md):

- `num_kv_blocks` or `kv_cache_memory` given: that many blocks, or that budget in blocks.
- Otherwise on a GPU: `gpu_memory_utilization` of the GPU's memory minus what is already in use (weights, expert
  slots, other processes), minus a reserve for one step's activations (`activation_reserve`).
  On the CPU: HOST_KV_SHARE of the host's available RAM.
  Either way capped at what max_batch_size sequences of max_seq_len tokens can use.
- An explicit max_seq_len that one sequence's blocks cannot hold is a ConfigError naming the flags. Without one,
  max_seq_len is the model's max_position_embeddings, lowered (with a warning) to what the cache holds when it
  does not fit, as vLLM and llama.cpp start.
- Sliding-window layers with a pool of their own (`SlidingPool`): that pool holds what max_batch_size sequences'
  windows and a step's tokens need (`sliding_pool_blocks`) and is taken off the budget first; the blocks above are
  the other layers', `bytes_per_token` theirs alone. Where every layer has a window, those blocks cost nothing
  (tables and prefix-cache keys only): max_batch_size sequences of max_seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

from .backends.tuning import LATENT_PREFILL_MAX_BYTES
from .config import CacheConfig, ModelConfig
from .memory import MemoryInfo
from .errors import ConfigError

HOST_KV_SHARE = 0.5  # of the host's available RAM at most, for the KV cache of the CPU backend
MIN_ACTIVATION_RESERVE = 256 << 20  # bytes kept free on a GPU for one step's activations, at least
SIZE_FLAGS = "--max-seq-len, --kv-cache-memory, --num-kv-blocks, --gpu-memory-utilization or --kv-cache-dtype"


@dataclass(frozen=True)
class KVCacheSize:
    """What `size_kv_cache` decided."""

    num_blocks: int
    block_size: int
    max_seq_len: int  # the longest prompt + completion the engine accepts
    budget_bytes: int | None  # the memory the blocks were cut from (None: num_kv_blocks was given)
    lowered_from: int | None = None  # the model's max_seq_len, when max_seq_len had to be lowered below it
    num_sliding_blocks: int = 0  # blocks of the sliding-window layers' pool (0: none)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def warning(self) -> str | None:
        """The message to log when max_seq_len was lowered, else None."""
        if self.lowered_from is None:
            return None
        return (f"the KV cache holds {self.capacity_tokens} tokens, fewer than one sequence of the model's "
                f"{self.lowered_from} positions: max_seq_len lowered to {self.max_seq_len}; to change it, set "
                f"{SIZE_FLAGS}")


@dataclass(frozen=True)
class SlidingPool:
    """The sliding-window layers' pool as sizing sees it."""

    num_blocks: int  # sliding_pool_blocks
    bytes_per_token: int  # keys and values of one token over the sliding-window layers

    def bytes(self, block_size: int) -> int:
        """The pool's memory, its placeholder block included."""
        return (self.num_blocks + 1) * block_size * self.bytes_per_token


def sliding_pool_blocks(window: int, block_size: int, max_batch_size: int, max_num_batched_tokens: int,
                        prefix_caching: bool) -> int:
    """Blocks of the sliding-window layers' pool: what max_batch_size sequences hold at most in a step of
    max_num_batched_tokens tokens (each the blocks of its last window - 1 tokens and two more, where those start
    mid-block and where its step's tokens start; the step's tokens theirs), and with prefix caching as many
    windows again, those of the cached prefixes a full batch leaves (a prefix serves only with its last window)."""
    window_blocks = -(-(window - 1) // block_size)
    running = max_batch_size * (window_blocks + 2) + -(-max_num_batched_tokens // block_size)
    return running + (max_batch_size * (window_blocks + 1) if prefix_caching else 0)


def activation_reserve(config: ModelConfig, max_num_batched_tokens: int) -> int:
    """Bytes a step's float32 activations may need at most, kept out of a GPU's KV budget: per token of the step,
    the hidden state and its norms and residuals (12 H), q, k, v and attention output (4 (Q + 2K) D), the routed or
    dense MLP's gate, up and product (3 max(k I, I_dense)), and a row of logits (V); for latent attention, the
    prefill's decompressed contexts too (bf16 keys' no-rope parts and values of every head and the latent rows, at
    most LATENT_PREFILL_MAX_BYTES)."""
    mlp = max(config.top_k * config.moe_intermediate_size, config.intermediate_size,
              config.shared_expert_intermediate_size)
    per_token = (12 * config.hidden_size + 4 * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
                 + 3 * mlp + config.vocab_size)
    decompressed = 0
    if config.attention == "mla":
        nope = config.head_dim - config.rotary_dim
        row = 2 * (config.num_heads * (nope + config.v_head_dim) + config.kv_lora_rank + config.rotary_dim)
        decompressed = min(LATENT_PREFILL_MAX_BYTES, row * config.max_position_embeddings)
    return max(MIN_ACTIVATION_RESERVE, 4 * per_token * max_num_batched_tokens + decompressed)


def default_budget(memory: MemoryInfo, gpu_memory_utilization: float, reserve: int) -> int:
    """The KV cache's share of `memory` when no size is given (bytes, 0 when nothing is left)."""
    if memory.host:
        return int(HOST_KV_SHARE * memory.free)
    in_use = memory.total - memory.free
    return max(0, int(gpu_memory_utilization * memory.total) - in_use - reserve)


def size_kv_cache(cache: CacheConfig, bytes_per_token: int, model_max_len: int, max_seq_len: int | None,
                  max_batch_size: int, default_budget_bytes: int, sliding: SlidingPool | None = None) -> KVCacheSize:
    """Blocks to allocate and the engine's max_seq_len (rules in the module docstring).

    `bytes_per_token`: keys and values of one token over the layers without a pool of their own (all but
    `sliding`'s); `max_seq_len`: the one asked for (None: the model's `model_max_len`); `default_budget_bytes`:
    `default_budget` of the measured memory."""
    if max_seq_len is not None and max_seq_len > model_max_len:
        raise ConfigError(f"max_seq_len {max_seq_len} exceeds the model's {model_max_len} positions")
    block_size = cache.block_size
    wanted = max_seq_len or model_max_len
    per_seq = -(-wanted // block_size)
    bytes_per_block = bytes_per_token * block_size
    reserved = 0 if sliding is None else sliding.bytes(block_size)
    num_sliding_blocks = 0 if sliding is None else sliding.num_blocks
    budget: int | None = None
    if cache.num_kv_blocks is None:
        budget = default_budget_bytes if cache.kv_cache_memory is None else cache.kv_cache_memory
        if budget < reserved:
            raise ConfigError(f"no memory is left for the sliding-window layers' KV blocks ({reserved} bytes; "
                              f"{budget} bytes for the cache): set {SIZE_FLAGS}")
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    elif bytes_per_block == 0:  # every layer has a window: these blocks are tables and prefix-cache keys only
        num_blocks = max_batch_size * per_seq
    elif cache.kv_cache_memory is not None:
        num_blocks = (budget - reserved) // bytes_per_block
    else:
        num_blocks = min((budget - reserved) // bytes_per_block, max_batch_size * per_seq)
    if num_blocks < 1:
        raise ConfigError(f"no memory is left for one KV-cache block ({bytes_per_block} bytes; "
                          f"{budget or 0} bytes for the cache): set {SIZE_FLAGS}")
    if num_blocks >= per_seq:
        return KVCacheSize(num_blocks, block_size, wanted, budget, num_sliding_blocks=num_sliding_blocks)
    capacity = num_blocks * block_size
    if max_seq_len is not None:
        raise ConfigError(f"the KV cache ({num_blocks} blocks of {block_size} tokens, {capacity} tokens) cannot "
                          f"hold one sequence of max_seq_len {max_seq_len}: lower --max-seq-len to {capacity} or "
                          f"less, or give the cache more memory (--kv-cache-memory, --num-kv-blocks, "
                          f"--gpu-memory-utilization, --kv-cache-dtype)")
    return KVCacheSize(num_blocks, block_size, capacity, budget, lowered_from=model_max_len,
                       num_sliding_blocks=num_sliding_blocks)
