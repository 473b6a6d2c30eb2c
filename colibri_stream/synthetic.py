"""Random-weight models of real shapes, built in the backend's memory (no files) through the normal loading path.

`synthetic_model("mixtral-8x7b", num_layers=4, device="cuda")` takes the dimensions of a published model (fewer
layers if asked), and gives `MoETransformer` a dense-tensor source and an expert store that draw random weights on
the backend (`Backend.random_weight`: on the GPU for CuPy) instead of reading a model folder; everything after that
(prepare_weight, prepare_experts, the forward) is the code real weights go through. Matrices are N(0, 1/fan_in),
so activations keep unit scale; the router is random too, so routing is close to uniform, unlike a trained model.
"""

from __future__ import annotations

import numpy as np

from .backends.base import Array, Backend
from .checkpoint import dense_tensor_specs
from .config import ModelConfig, RopeConfig
from .experts.store import ExpertStore
from .model.transformer import MoETransformer, select_backend

# Dimensions of published checkpoints (their config.json), as ModelConfig fields.
SHAPES: dict[str, dict] = {
    "mixtral-8x7b": dict(architecture="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, moe_intermediate_size=14336,
                         norm_topk_prob=True, rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5,
                         max_position_embeddings=32768),
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                          num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                          moe_intermediate_size=768, norm_topk_prob=True, qk_norm="per_head",
                          rope=RopeConfig(theta=1e6), rms_norm_eps=1e-6, max_position_embeddings=40960),
    "olmoe-1b-7b": dict(architecture="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16,
                        num_kv_heads=16, head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=1024,
                        norm_topk_prob=False, qk_norm="full", rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-5,
                        max_position_embeddings=4096),
}


def shape_config(name: str, num_layers: int | None = None, dtype: str = "bfloat16") -> ModelConfig:
    """The ModelConfig of a named shape (SHAPES), every layer MoE, optionally with fewer layers."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    layers = num_layers or fields.pop("num_layers")
    fields["num_layers"] = layers
    return ModelConfig(**fields, moe_layers=tuple(range(layers)), sliding_windows=(None,) * layers, dtype=dtype,
                       expert_dtype=dtype)


class RandomDense:
    """Stands in for DenseFile: the tensor names and shapes of `dense_tensor_specs`, random values.

    Norm weights are 1 + N(0, 0.1), biases N(0, 0.02), the embedding N(0, 1), other matrices N(0, 1/fan_in).
    """

    def __init__(self, config: ModelConfig, backend: Backend, seed: int = 0):
        self.config, self.backend, self.seed = config, backend, seed
        self.specs = dense_tensor_specs(config)
        self.names = list(self.specs)
        self._order = {name: n for n, name in enumerate(self.names)}

    def get(self, name: str) -> Array:
        shape = self.specs[name]
        seed = self.seed * 1_000_003 + self._order[name]
        if len(shape) == 1:
            if name.endswith("norm"):
                return self.backend.random_weight(shape, 0.1, seed, "float32") + np.float32(1)
            return self.backend.random_weight(shape, 0.02, seed, "float32")
        std = 1.0 if name == "embed_tokens" else shape[1] ** -0.5
        return self.backend.random_weight(shape, std, seed, self.config.dtype)


class RandomExpertStore(ExpertStore):
    """Routed experts drawn at random, the same tensors on every call (seeded by layer and expert); the arrays are
    the backend's (device arrays for CuPy, which `prepare_experts` stacks on the device)."""

    def __init__(self, config: ModelConfig, backend: Backend, seed: int = 0):
        if config.expert_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"synthetic experts are float32, bfloat16 or float16, not {config.expert_dtype}")
        self.config, self.backend, self.seed = config, backend, seed

    def expert(self, layer: int, expert: int) -> dict[str, Array]:
        h, i = self.config.hidden_size, self.config.moe_intermediate_size
        seed = ((self.seed * 1009 + layer) * 65_537 + expert) * 3 + 7_000_000_007
        draw, dtype = self.backend.random_weight, self.config.expert_dtype
        return {"gate": draw((i, h), h**-0.5, seed, dtype), "up": draw((i, h), h**-0.5, seed + 1, dtype),
                "down": draw((h, i), i**-0.5, seed + 2, dtype)}


def synthetic_model(shape: str | ModelConfig, num_layers: int | None = None, device: str = "auto",
                    seed: int = 0) -> MoETransformer:
    """A random-weight model on `device` (auto, cpu, cuda): a named shape with `num_layers` layers (None: all of
    them), or exactly the given config."""
    config = shape if isinstance(shape, ModelConfig) else shape_config(shape, num_layers)
    backend = select_backend(device)
    return MoETransformer(config, RandomDense(config, backend, seed), RandomExpertStore(config, backend, seed),
                          backend)
