"""The NumPy backend's own logic in the attention prologue: padding slots store nothing, and `qk_norm_rope_write`
applies full norm, clamp, per-head norm, rotary and the KV write in the model's order (checked against the formulas
written out here); a decode step's batched attention equals attention one sequence at a time; partial rotary,
sigmoid and group-limited routing against hand-worked scores."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.config import RopeConfig
from colibri_stream.batch import ForwardBatch
from colibri_stream.backends.sequence_attention import attention_per_sequence
from colibri_stream.model.rope import cos_sin_table

B = NumpyBackend()
EPS = 1e-6


def test_write_kv_skips_negative_slots():
    rng = np.random.default_rng(0)
    key_cache, value_cache = rng.standard_normal((2, 4, 8, 2, 16)).astype(np.float32)  # [blocks, rows, K, D]
    keys_before, values_before = key_cache.copy(), value_cache.copy()
    key, value = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)  # [T, K, D]
    B.write_kv(key_cache, value_cache, key, value, np.array([9, -1, 30]))
    assert np.array_equal(key_cache[1, 1], key[0]) and np.array_equal(value_cache[3, 6], value[2])
    written = np.zeros((4, 8), bool)
    written[1, 1] = written[3, 6] = True
    assert np.array_equal(key_cache[~written], keys_before[~written])  # the padding row (slot -1) stored nothing
    assert np.array_equal(value_cache[~written], values_before[~written])


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(EPS)) * w


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, D] rotated with cos, sin [T, D/2] ("rotate half")."""
    half = x.shape[-1] // 2
    c, s = cos[:, None], sin[:, None]
    return np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], axis=-1)


@pytest.mark.parametrize("qk_norm", ["none", "per_head", "full"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_qk_norm_rope_write_order(qk_norm, clip):
    rng = np.random.default_rng(len(qk_norm))
    t, heads, kv_heads, d = 3, 4, 2, 8
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), d, 64)
    q = rng.standard_normal((t, heads * d)).astype(np.float32)
    k, v = rng.standard_normal((2, t, kv_heads * d)).astype(np.float32)
    q_norm = k_norm = None
    if qk_norm != "none":
        q_width, k_width = (heads * d, kv_heads * d) if qk_norm == "full" else (d, d)
        q_norm, k_norm = ((1 + 0.2 * rng.standard_normal(n)).astype(np.float32) for n in (q_width, k_width))
    positions, slots = np.array([5, 0, 63]), np.array([3, -1, 12])
    key_cache, value_cache = np.zeros((2, 4, 4, kv_heads, d), np.float32)

    out = B.qk_norm_rope_write(q, k, v, q_norm, k_norm, qk_norm, EPS, clip, cos, sin, positions, key_cache,
                               value_cache, slots)

    def clamp(x):
        return x if clip is None else np.clip(x, -clip, clip)

    if qk_norm == "full":
        q, k = rms(q, q_norm), rms(k, k_norm)
    q, k, v = clamp(q).reshape(t, heads, d), clamp(k).reshape(t, kv_heads, d), clamp(v).reshape(t, kv_heads, d)
    if qk_norm == "per_head":
        q, k = rms(q, q_norm), rms(k, k_norm)
    q, k = rotate(q, cos[positions], sin[positions]), rotate(k, cos[positions], sin[positions])
    assert out.shape == (t, heads, d)
    np.testing.assert_allclose(out, q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(key_cache.reshape(-1, kv_heads, d)[[3, 12]], k[[0, 2]], rtol=1e-6, atol=1e-6)
    assert np.array_equal(value_cache.reshape(-1, kv_heads, d)[[3, 12]], v[[0, 2]])
    stored = np.zeros(16, bool)
    stored[[3, 12]] = True
    assert not key_cache.reshape(16, -1)[~stored].any() and not value_cache.reshape(16, -1)[~stored].any()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_decode_attention_matches_one_sequence_at_a_time(window, heads):
    """Sequences of different contexts, their blocks scattered (the padded table entries point at other
    sequences' blocks, whose values must not leak in), one query token each."""
    rng = np.random.default_rng(len(heads) + (window or 0))
    num_heads, num_kv_heads, head_dim, block_size = *heads, 16, 4
    contexts = np.array([1, 9, 30, 4, 17])
    per_seq = -(-contexts // block_size)
    num_blocks = int(per_seq.sum()) + 2
    owned = np.split(rng.permutation(np.arange(1, num_blocks))[:per_seq.sum()], np.cumsum(per_seq)[:-1])
    tables = np.zeros((len(contexts), per_seq.max()), np.int64)
    for b, blocks in enumerate(owned):
        tables[b, :len(blocks)] = blocks
    positions = contexts - 1
    seqs = len(contexts)
    batch = ForwardBatch(token_ids=np.zeros(seqs, np.int64), positions=positions,
                         query_start=np.arange(seqs + 1, dtype=np.int64), context_lens=contexts, block_tables=tables,
                         slot_mapping=tables[np.arange(seqs), positions // block_size] * block_size
                         + positions % block_size, logits_indices=np.arange(seqs, dtype=np.int64))
    key_cache, value_cache = rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    key_cache[0] = value_cache[0] = np.nan  # block 0: no sequence's, but every padded table entry's
    query = rng.standard_normal((seqs, num_heads, head_dim)).astype(np.float32)
    batched = B.paged_attention(query, key_cache, value_cache, batch, {}, 0.25, window)
    one_by_one = attention_per_sequence(np, lambda rows, scale: rows, query, key_cache, value_cache, batch, 0.25,
                                        window)
    assert np.isfinite(batched).all()
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-5, atol=1e-6)


def test_partial_rotary_rotates_the_leading_dimensions_only():
    rng = np.random.default_rng(3)
    t, heads, d, rotated = 3, 2, 12, 4
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), rotated, 32)  # [P, R/2]
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    positions = np.array([0, 7, 31])
    out = B.rotary(x, cos, sin, positions)
    np.testing.assert_allclose(out[..., :rotated], rotate(x[..., :rotated], cos[positions], sin[positions]),
                               rtol=1e-6, atol=1e-6)
    assert np.array_equal(out[..., rotated:], x[..., rotated:])


def route_scores(logits: np.ndarray, router_width: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """x and router [E, H] whose product is `logits` [T, E]: x the identity rows padded, router its transpose."""
    t, e = logits.shape
    x = np.zeros((t, t + router_width), np.float32)
    x[:, :t] = np.eye(t)
    router = np.zeros((e, t + router_width), np.float32)
    router[:, :t] = logits.T
    return x, router


def test_sigmoid_routing_chooses_by_biased_scores_and_weights_by_unbiased_ones():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)  # [T, E]
    x, router = route_scores(logits)
    sigmoid = 1 / (1 + np.exp(-logits[0]))
    bias = np.array([0.0, 0.0, 0.6, 0.0], np.float32)  # lifts expert 2 above expert 1 (sigmoid gap 0.23)
    weights, ids = B.route(x, router, 2, False, "sigmoid", bias)
    assert ids.tolist() == [[2, 0]]
    np.testing.assert_allclose(weights[0], sigmoid[[2, 0]], rtol=1e-6)  # the bias does not enter the weights
    weights, _ = B.route(x, router, 2, True, "sigmoid", bias, scaling=2.5)
    np.testing.assert_allclose(weights[0], 2.5 * sigmoid[[2, 0]] / sigmoid[[2, 0]].sum(), rtol=1e-6)
    weights, ids = B.route(x, router, 2, True)  # softmax, as the other families route
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(weights[0], softmax[[0, 1]] / softmax[[0, 1]].sum(), rtol=1e-6)


def test_group_limited_routing_ranks_groups_by_their_two_best_scores():
    # Groups of 3: group 0 holds the single best expert (0) but group 1 the larger top-2 sum; with one group kept,
    # experts 3 and 4 are chosen over expert 0. A bias on expert 1 moves group 0 ahead.
    logits = np.array([[3.0, -3.0, -3.0, 2.0, 2.0, -3.0],
                       [3.0, -3.0, -3.0, 2.0, 2.0, -3.0]], np.float32)
    x, router = route_scores(logits)
    _, ids = B.route(x, router, 2, True, "sigmoid")
    assert ids.tolist() == [[0, 3], [0, 3]]  # without groups: the two best overall
    _, ids = B.route(x, router, 2, True, "sigmoid", n_group=2, topk_group=1)
    assert ids.tolist() == [[3, 4], [3, 4]]
    bias = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 0.0], np.float32)  # group 0's biased top-2 sum: 1.95 over 1.76
    _, ids = B.route(x[1:], router, 2, True, "sigmoid", bias, n_group=2, topk_group=1)
    assert ids.tolist() == [[1, 0]]
    _, ids = B.route(x, router, 3, True, "sigmoid", n_group=2, topk_group=2)  # every group kept: no restriction
    assert ids.tolist() == [[0, 3, 4], [0, 3, 4]]
