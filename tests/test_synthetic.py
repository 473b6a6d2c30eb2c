"""Synthetic random-weight models (the benchmarks' models) build through the normal loading path on the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from colibri_stream.checkpoint import dense_tensor_specs
from colibri_stream.model.batch import single_sequence_batch
from colibri_stream.synthetic import SHAPES, RandomDense, RandomExpertStore, shape_config, synthetic_model


@pytest.mark.parametrize("name", list(SHAPES))
def test_named_shapes_are_valid_configs(name):
    config = shape_config(name, num_layers=3)
    assert config.num_layers == 3 and config.moe_layers == (0, 1, 2)
    assert shape_config(name).num_layers == SHAPES[name]["num_layers"]


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("llama-70b")


def tiny_config():
    return dataclasses.replace(shape_config("qwen3-30b-a3b", 2), vocab_size=300, hidden_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                               max_position_embeddings=128)


def test_random_weights_have_the_checkpoint_shapes_and_repeat():
    config = tiny_config()
    model = synthetic_model(config, device="cpu")
    dense = RandomDense(config, model.backend, seed=0)
    for name, shape in dense_tensor_specs(config).items():
        assert dense.get(name).shape == shape
    store = RandomExpertStore(config, model.backend, seed=0)
    first, again = store.expert(1, 3), store.expert(1, 3)
    assert all(np.array_equal(first[n].view(np.uint16), again[n].view(np.uint16)) for n in first)
    assert not np.array_equal(first["gate"], store.expert(1, 4)["gate"])
    kv = model.allocate_kv_cache(4, 8)
    logits = model.forward(single_sequence_batch(np.arange(7), 0, np.arange(4), 8), kv)
    assert logits.shape == (1, 300) and np.isfinite(logits).all() and logits.std() > 0.1
