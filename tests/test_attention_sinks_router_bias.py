"""gpt-oss's attention sinks, router logit bias and YaRN on the NumPy backend, against transformers' functions.

gpt-oss adds a learned logit per query head to each attention softmax's denominator and a bias to its router's
logits, then takes the top-k logits and a softmax over those k (the same weights as a softmax over all experts
renormalised over the chosen k, which is how the backend routes).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.backends.sequence_attention import attention_per_sequence
from colibri_stream.batch import ForwardBatch, single_sequence_batch
from colibri_stream.config import ModelConfig, RopeConfig
from colibri_stream.checkpoint import dense_tensor_specs
from colibri_stream.errors import CheckpointError
from colibri_stream.model.rope import cos_sin_table, inverse_frequencies
from colibri_stream.model.transformer import MoETransformer
from colibri_stream.synthetic import RandomDense, RandomExpertStore

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

B = NumpyBackend()


def one_sequence_batch(context: int, queries: int, block_size: int, num_blocks: int,
                       rng: np.random.Generator) -> ForwardBatch:
    """The last `queries` of `context` tokens of one sequence whose blocks are scattered over the cache."""
    blocks = rng.permutation(num_blocks)[: -(-context // block_size)]
    positions = np.arange(context - queries, context)
    return ForwardBatch(token_ids=np.zeros(queries, np.int64), positions=positions,
                        query_start=np.array([0, queries], np.int64), context_lens=np.array([context]),
                        block_tables=blocks[None, :].astype(np.int64),
                        slot_mapping=blocks[positions // block_size] * block_size + positions % block_size,
                        logits_indices=np.arange(queries, dtype=np.int64))


def transformers_attention(query, keys, values, sinks, scale, window, positions):
    """gpt-oss's eager attention: query [t, Q, D] at `positions`, keys/values [S, K, D] -> [t, Q, D]."""
    q_pos, k_pos = positions[:, None], np.arange(keys.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    mask = torch.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32))[None, None]  # [1, 1, t, S]
    module = SimpleNamespace(sinks=torch.from_numpy(sinks), num_key_value_groups=query.shape[1] // keys.shape[1],
                             training=False)

    def heads_first(a):
        return torch.from_numpy(np.ascontiguousarray(a.transpose(1, 0, 2)))[None]  # [1, heads, n, D]

    out, _ = gpt_oss.eager_attention_forward(module, heads_first(query), heads_first(keys), heads_first(values),
                                             mask, scale)  # [1, t, Q, D]
    return out[0].numpy()


@pytest.mark.parametrize("queries", [1, 7])  # a decode step, a prefill chunk
@pytest.mark.parametrize("window", [None, 6])
def test_attention_with_sinks_matches_transformers(queries, window):
    rng = np.random.default_rng(queries * 10 + (window or 0))
    num_heads, num_kv_heads, head_dim, block_size, num_blocks, context = 8, 2, 16, 4, 12, 19
    batch = one_sequence_batch(context, queries, block_size, num_blocks, rng)
    key_cache, value_cache = rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim),
                                                 dtype=np.float32)
    query = rng.standard_normal((queries, num_heads, head_dim), dtype=np.float32)
    sinks = rng.normal(0.0, 2.0, num_heads).astype(np.float32)  # [Q]: some above the scores, some below
    ours = B.paged_attention(query, key_cache, value_cache, batch, {}, 0.25, window, sinks=sinks)
    keys = key_cache[batch.block_tables[0]].reshape(-1, num_kv_heads, head_dim)[:context]  # [S, K, D]
    values = value_cache[batch.block_tables[0]].reshape(-1, num_kv_heads, head_dim)[:context]
    expected = transformers_attention(query, keys, values, sinks, 0.25, window, batch.positions)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
    without = B.paged_attention(query, key_cache, value_cache, batch, {}, 0.25, window)
    assert np.abs(ours - without).max() > 1e-3  # the sinks take a share of every row's probability


def test_decode_with_sinks_matches_one_sequence_at_a_time():
    """The batched decode path (keys padded to the longest context) and the per-sequence path agree with sinks."""
    rng = np.random.default_rng(5)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    contexts = np.array([3, 11, 6])
    tables = np.arange(1, 1 + 3 * 3).reshape(3, 3)
    positions = contexts - 1
    batch = ForwardBatch(token_ids=np.zeros(3, np.int64), positions=positions,
                         query_start=np.arange(4, dtype=np.int64), context_lens=contexts, block_tables=tables,
                         slot_mapping=tables[np.arange(3), positions // block_size] * block_size
                         + positions % block_size, logits_indices=np.arange(3, dtype=np.int64))
    key_cache, value_cache = rng.standard_normal((2, 10, block_size, num_kv_heads, head_dim), dtype=np.float32)
    query = rng.standard_normal((3, num_heads, head_dim), dtype=np.float32)
    sinks = np.array([3.0, -1.0, 0.5, 8.0], np.float32)
    batched = B.paged_attention(query, key_cache, value_cache, batch, {}, 0.3, None, sinks=sinks)
    one_by_one = attention_per_sequence(np, lambda rows, scale: rows, query, key_cache, value_cache, batch, 0.3, None,
                                        sinks=sinks)
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [2, 4])
def test_biased_router_matches_transformers_topk_router(top_k):
    rng = np.random.default_rng(top_k)
    tokens, hidden, experts = 9, 16, 8
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    router = rng.standard_normal((experts, hidden), dtype=np.float32)
    bias = rng.normal(0.0, 1.5, experts).astype(np.float32)  # large enough to change the choice
    module = gpt_oss.GptOssTopKRouter(SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=experts,
                                                      hidden_size=hidden))
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(router))
        module.bias.copy_(torch.from_numpy(bias))
        _, scores, indices = module(torch.from_numpy(x))
    weights, ids = B.route(x, router, top_k, True, router_bias=bias)
    assert np.array_equal(ids, indices.numpy())
    np.testing.assert_allclose(weights, scores.numpy(), rtol=1e-5, atol=1e-6)
    _, unbiased_ids = B.route(x, router, top_k, True)
    assert not np.array_equal(unbiased_ids, ids)


def small_config(**fields) -> ModelConfig:
    return ModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=4, num_experts=4, top_k=2, moe_intermediate_size=8,
                       moe_layers=(0, 1), sliding_windows=(None, None), **fields)


def test_sinks_and_router_bias_are_dense_tensors_of_each_layer():
    specs = dense_tensor_specs(small_config(attention_sinks=True, router_bias=True))
    assert specs["layers.1.sinks"] == (4,) and specs["layers.1.router_bias"] == (4,)
    assert "layers.0.sinks" not in dense_tensor_specs(small_config())


def test_latent_attention_with_sinks_is_refused():
    with pytest.raises(CheckpointError, match="mla has no attention sinks"):
        small_config(attention="mla", attention_sinks=True, kv_lora_rank=8, v_head_dim=4, rotary_dim=2)


def test_yarn_as_gpt_oss_configures_it_matches_transformers():
    """gpt-oss's default rope: YaRN, factor 32 over 4096 positions, the correction range not rounded
    (truncate false), cos/sin scaled by YaRN's attention factor."""
    import transformers

    hf = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   num_hidden_layers=2, rope_theta=150000.0)
    params = hf.rope_parameters
    assert params["rope_type"] == "yarn" and params["truncate"] is False
    rope = RopeConfig(type="yarn", theta=params["rope_theta"], factor=params["factor"],
                      original_max_position_embeddings=params["original_max_position_embeddings"],
                      beta_fast=params["beta_fast"], beta_slow=params["beta_slow"], truncate=False)
    hf_rotary = gpt_oss.GptOssRotaryEmbedding(hf)
    inv_freq, scaling = inverse_frequencies(rope, 32)
    np.testing.assert_allclose(inv_freq, hf_rotary.inv_freq.numpy(), rtol=1e-6)
    assert scaling == pytest.approx(hf_rotary.attention_scaling, rel=1e-7)
    cos, sin = cos_sin_table(rope, 32, 300)  # [P, D/2]
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), torch.arange(300)[None])
    # transformers rounds each angle to float32 (its ulp at 300 radians is 3e-5); the table computes it in float64
    np.testing.assert_allclose(cos, hf_cos[0].numpy(), atol=5e-5)
    np.testing.assert_allclose(sin, hf_sin[0].numpy(), atol=5e-5)
    rounded = cos_sin_table(dataclasses.replace(rope, truncate=True), 32, 300)[0]
    assert np.abs(rounded - cos).max() > 1e-4  # truncate changes the table: the comparison would see it


class OverriddenDense:
    """RandomDense of `config` with some tensors replaced, and those of names outside `names` left out."""

    def __init__(self, config: ModelConfig, replaced: dict[str, np.ndarray], names: list[str]):
        self.random, self.replaced = RandomDense(config, B), replaced
        self.names = names

    def get(self, name: str) -> np.ndarray:
        return self.replaced[name] if name in self.replaced else self.random.get(name)


def test_the_model_feeds_each_layer_its_sinks_and_router_bias():
    """Sinks far below every score and a bias equal for all experts compute the model without them (a softmax
    does not see a constant shift); sinks above the scores and a varied bias change the logits."""
    plain = dataclasses.replace(small_config(), vocab_size=300, hidden_size=64, head_dim=16, num_experts=8,
                                moe_intermediate_size=32, max_position_embeddings=64)
    config = dataclasses.replace(plain, attention_sinks=True, router_bias=True)
    names = list(dense_tensor_specs(config))
    rng = np.random.default_rng(0)

    def logits(dense, model_config):
        model = MoETransformer(model_config, dense, RandomExpertStore(model_config, B), B)
        kv = model.allocate_kv_cache(4, 8)
        return model.forward(single_sequence_batch(np.arange(11), 0, np.arange(2), 8), kv)  # [1, V]

    neutral = {f"layers.{l}.{n}": np.full(shape, value, np.float32) for l in range(2)
               for n, shape, value in (("sinks", (4,), -1e4), ("router_bias", (8,), 0.7))}
    reference = logits(OverriddenDense(config, neutral, [n for n in names if n not in neutral]), plain)
    np.testing.assert_allclose(logits(OverriddenDense(config, neutral, names), config), reference,
                               rtol=1e-5, atol=1e-5)
    for name, values in (("sinks", rng.normal(2.0, 1.0, 4)), ("router_bias", rng.normal(0.0, 2.0, 8))):
        changed = dict(neutral, **{f"layers.{l}.{name}": values.astype(np.float32) for l in range(2)})
        assert np.abs(logits(OverriddenDense(config, changed, names), config) - reference).max() > 1e-3, name
