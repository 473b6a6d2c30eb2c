"""Attention over a paged KV cache from array operations, written once for any array module (`xp`: NumPy or CuPy):
the NumPy backend's attention, and the CuPy backend's for what its kernels do not take (latent attention's rows of
kv_lora_rank + rope width, sink logits). A decode step (one query token per sequence) is one batched product over
every sequence, keys padded to the longest context and masked; other steps go one sequence at a time. Float32
throughout; the cache's rows are widened by the caller's `widen(rows, scale)`. The batch's host arrays
(query_start, context_lens, positions, block_tables) shape the products, so a step through here is never captured
in a CUDA graph."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..batch import ForwardBatch


def softmax_with_sinks(xp: Any, scores: Any, sinks: Any | None) -> Any:
    """softmax over the last axis of scores [..., S] (-inf where masked); `sinks` (broadcast to [..., 1]) add
    each head's logit to the denominator only, so the probabilities of a row sum to less than 1."""
    peak = scores.max(axis=-1, keepdims=True)  # [..., 1]
    if sinks is not None:
        peak = xp.maximum(peak, sinks)
    probs = xp.exp(scores - peak)
    total = probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + xp.exp(sinks - peak)
    return probs / total


def paged_attention_rows(xp: Any, widen: Callable[[Any, float], Any], query: Any, key_cache: Any, value_cache: Any,
                         batch: ForwardBatch, scale: float, sliding_window: int | None,
                         kv_scales: tuple[float, float] = (1.0, 1.0), sinks: Any | None = None) -> Any:
    """`Backend.paged_attention` from array operations: decode steps batched (`decode_attention`), the others
    `attention_per_sequence`.  # query [T, Q, D] -> [T, Q, D]"""
    if batch.num_seqs and batch.num_tokens == batch.num_seqs:  # a decode step: one query token per sequence
        return decode_attention(xp, widen, query, key_cache, value_cache, batch, scale, sliding_window, kv_scales,
                                sinks)
    return attention_per_sequence(xp, widen, query, key_cache, value_cache, batch, scale, sliding_window, kv_scales,
                                  sinks)


def decode_attention(xp: Any, widen: Callable[[Any, float], Any], query: Any, key_cache: Any, value_cache: Any,
                     batch: ForwardBatch, scale: float, sliding_window: int | None,
                     kv_scales: tuple[float, float] = (1.0, 1.0), sinks: Any | None = None) -> Any:
    """One query token per sequence (query [B, Q, D]): every sequence in one batched product, keys padded to the
    longest context and masked (one product instead of a loop over sequences).  # -> [B, Q, D]"""
    seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    longest = int(batch.context_lens.max())
    blocks = xp.asarray(batch.block_tables[:, : -(-longest // block_size)])  # [B, n]
    k_scale, v_scale = kv_scales
    keys = widen(key_cache[blocks], k_scale).reshape(seqs, -1, num_kv_heads, head_dim)[:, :longest]
    values = widen(value_cache[blocks], v_scale).reshape(seqs, -1, num_kv_heads, head_dim)[:, :longest]
    # keys, values: [B, S, K, D]
    k_pos = xp.arange(longest)[None, :]  # [1, S]
    q_pos = xp.asarray(batch.positions)[:, None]  # [B, 1]
    visible = (k_pos <= q_pos) & (k_pos < xp.asarray(batch.context_lens)[:, None])  # [B, S]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    values[~visible] = 0  # padding positions hold other sequences' values (a zero weight times them is 0)
    q = query.reshape(seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, K, G, D]
    scores = xp.matmul(q, keys.transpose(0, 2, 3, 1)) * np.float32(scale)  # [B, K, G, S]
    scores = xp.where(visible[:, None, None, :], scores, np.float32(-np.inf))
    sinks = None if sinks is None else sinks.reshape(1, num_kv_heads, num_heads // num_kv_heads, 1)
    probs = softmax_with_sinks(xp, scores, sinks)  # [B, K, G, S]
    attended = xp.matmul(probs, values.transpose(0, 2, 1, 3))  # [B, K, G, D]
    return attended.reshape(seqs, num_heads, head_dim)


def attention_per_sequence(xp: Any, widen: Callable[[Any, float], Any], query: Any, key_cache: Any, value_cache: Any,
                           batch: ForwardBatch, scale: float, sliding_window: int | None,
                           kv_scales: tuple[float, float] = (1.0, 1.0), sinks: Any | None = None) -> Any:
    """Causal attention of each sequence's query tokens (query [T, Q, D]) over its cached keys and values
    [num_blocks, block_size, K, D] (positions j <= p, and j > p - window with a window), scores scaled by `scale`;
    `sinks` [Q] or None. Returns [T, Q, D] float32."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    head_sinks = None if sinks is None else sinks.reshape(num_kv_heads, group, 1, 1)
    out = xp.empty_like(query)  # [T, Q, D]
    for b in range(batch.num_seqs):
        start, end = int(batch.query_start[b]), int(batch.query_start[b + 1])
        context = int(batch.context_lens[b])
        blocks = xp.asarray(batch.block_tables[b, : -(-context // block_size)])
        keys = widen(key_cache[blocks], kv_scales[0]).reshape(-1, num_kv_heads, head_dim)[:context]  # [S, K, D]
        values = widen(value_cache[blocks], kv_scales[1]).reshape(-1, num_kv_heads, head_dim)[:context]
        t = end - start
        # Batched matmuls over the KV heads (BLAS; einsum was 1.5x slower at one query token, 7-10x at 64):
        # a KV head's G query heads and t tokens are the rows of one product.
        q = query[start:end].reshape(t, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [K, G, t, D]
        scores = xp.matmul(q.reshape(num_kv_heads, group * t, head_dim), keys.transpose(1, 2, 0))  # [K, G*t, S]
        scores = scores.reshape(num_kv_heads, group, t, context) * np.float32(scale)  # [K, G, t, S]
        q_pos = xp.asarray(batch.positions[start:end])[:, None]  # [t, 1]
        k_pos = xp.arange(context)[None, :]  # [1, S]
        visible = k_pos <= q_pos  # [t, S]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = xp.where(visible, scores, np.float32(-np.inf))
        probs = softmax_with_sinks(xp, scores, head_sinks)  # [K, G, t, S]
        attended = xp.matmul(probs.reshape(num_kv_heads, group * t, context), values.transpose(1, 0, 2))
        # [K, G*t, D] -> [t, K, G, D]
        out[start:end] = attended.reshape(num_kv_heads, group, t, head_dim).transpose(2, 0, 1, 3).reshape(
            t, num_heads, head_dim)
    return out
