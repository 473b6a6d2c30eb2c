"""Routed experts with biases and gpt-oss's clamped SwiGLU on the CPU reference, against transformers' experts."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_stream.checkpoint import expert_block_layout
from colibri_stream.config import ClampedSwiglu, ModelConfig
from colibri_stream.errors import CheckpointError
from colibri_stream.expert_codecs import (EXPERT_BIASES, Fp8Codec, Int4Codec, Int8Codec, Mxfp4Codec, PlainCodec,
                                          dequantize_expert)
from colibri_stream.experts import cpu_executor
from colibri_stream.experts.cpu_executor import CpuExpertExecutor, numpy_expert
from colibri_stream.experts.jit import numba

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

HIDDEN, INTER, EXPERTS = 16, 12, 3


def transformers_experts(rng: np.random.Generator, limit: float):
    """GptOssExperts with random weights and biases large enough that both clamps act."""
    import transformers

    hf = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                   swiglu_limit=limit, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   num_hidden_layers=1)
    hf._experts_implementation = "eager"  # the loop over experts of the modeling file
    module = gpt_oss.GptOssExperts(hf)
    with torch.no_grad():
        for parameter, std in ((module.gate_up_proj, 1.0), (module.gate_up_proj_bias, 1.0),
                               (module.down_proj, 0.3), (module.down_proj_bias, 0.5)):
            parameter.copy_(torch.from_numpy(rng.normal(0.0, std, tuple(parameter.shape)).astype(np.float32)))
    return module


def our_tensors(module, expert: int) -> dict[str, np.ndarray]:
    """One expert of GptOssExperts in our layout: its fused gate_up_proj [H, 2I] interleaves gate (even columns)
    and up (odd columns), and down_proj is [I, H]; ours are [out, in]."""
    gate_up = module.gate_up_proj[expert].detach().numpy()  # [H, 2I]
    bias = module.gate_up_proj_bias[expert].detach().numpy()  # [2I]
    return {"gate": np.ascontiguousarray(gate_up[:, ::2].T), "up": np.ascontiguousarray(gate_up[:, 1::2].T),
            "down": np.ascontiguousarray(module.down_proj[expert].detach().numpy().T),
            "gate_bias": bias[::2].copy(), "up_bias": bias[1::2].copy(),
            "down_bias": module.down_proj_bias[expert].detach().numpy().copy()}


def test_biased_clamped_swiglu_expert_matches_transformers():
    rng = np.random.default_rng(0)
    limit = 1.5  # below the spread of the random products: the clamps change the result
    module = transformers_experts(rng, limit)
    x = rng.standard_normal((7, HIDDEN), dtype=np.float32)
    ids = np.array([[1]] * 7)
    with torch.no_grad():
        expected = module(torch.from_numpy(x), torch.from_numpy(ids), torch.ones(7, 1)).numpy()
    tensors = our_tensors(module, 1)
    swiglu = ClampedSwiglu(limit, module.alpha)
    ours = CpuExpertExecutor().run(x, tensors, swiglu=swiglu)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    unclamped = numpy_expert(x, tensors, ClampedSwiglu(1e9, module.alpha))
    assert np.abs(unclamped - expected).max() > 1e-2  # the limit acted
    unbiased = numpy_expert(x, {n: tensors[n] for n in ("gate", "up", "down")}, swiglu)
    assert np.abs(unbiased - expected).max() > 1e-2  # the biases acted


def test_biases_survive_dequantizing_and_refuse_row_parts():
    rng = np.random.default_rng(1)
    tensors = our_tensors(transformers_experts(rng, 7.0), 0)
    codec = Int8Codec()
    stored = {k: v for m in ("gate", "up", "down") for k, v in codec.quantize_matrix(m, tensors[m]).items()}
    stored |= {name: tensors[name] for name in EXPERT_BIASES}
    widened = dequantize_expert(stored)
    assert all(np.array_equal(widened[name], tensors[name]) for name in EXPERT_BIASES)
    x = rng.standard_normal((2, HIDDEN), dtype=np.float32)
    with pytest.raises(ValueError, match="computed whole"):
        CpuExpertExecutor().run(x, stored, rows=(0, 6))


KERNEL_CODECS = [PlainCodec("float32"), PlainCodec("bfloat16"), Int8Codec(), Int4Codec(32, False), Int4Codec(64, True),
                 Fp8Codec("block"), Fp8Codec("channel"), Mxfp4Codec()]


@pytest.mark.skipif(numba is None, reason="numba is not installed (the `cpu` extra)")
@pytest.mark.parametrize("tokens", [1, 6, 9])  # straight from the codes (int4, mxfp4); the decoded rows' dots
@pytest.mark.parametrize("codec", KERNEL_CODECS, ids=lambda c: c.describe())
def test_the_kernels_add_biases_and_clamp_as_the_reference(codec, tokens, monkeypatch):
    """Each CPU kernel (plain and grouped) on a biased expert under gpt-oss's clamped SwiGLU and under silu gives
    the NumPy reference's result on the same stored weights (the executor may not fall back to that reference)."""
    rng = np.random.default_rng(tokens)
    hidden, inter = 64, 96
    stored = {}
    for name, shape, std in (("gate", (inter, hidden), 0.5), ("up", (inter, hidden), 0.5), ("down", (hidden, inter), 0.2)):
        stored |= codec.quantize_matrix(name, rng.normal(0.0, std, shape).astype(np.float32))
    stored |= {"gate_bias": rng.normal(0.0, 1.0, inter).astype(np.float32),
               "up_bias": rng.normal(0.0, 1.0, inter).astype(np.float32),
               "down_bias": rng.normal(0.0, 0.5, hidden).astype(np.float32)}
    x = rng.normal(0.0, 1.0, (tokens, hidden)).astype(np.float32)
    executor = CpuExpertExecutor(num_threads=2, min_kernel_bytes=0)
    assert executor.computes(codec, stored["gate"].dtype, 0)
    monkeypatch.setattr(cpu_executor, "numpy_expert", None)  # a fallback to the reference would raise
    for swiglu in (ClampedSwiglu(1.5, 1.702), None):
        want = numpy_expert(x, stored, swiglu)
        np.testing.assert_allclose(executor.run(x, stored, swiglu=swiglu), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
    clamped = numpy_expert(x, stored, ClampedSwiglu(1.5, 1.702))
    assert np.abs(clamped - numpy_expert(x, stored, ClampedSwiglu(1e9, 1.702))).max() > 1e-2  # the clamp acted


def config(**fields) -> ModelConfig:
    return ModelConfig(architecture="mixtral", vocab_size=32, hidden_size=HIDDEN, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=INTER,
                       moe_layers=(0,), sliding_windows=(None,), **fields)


def test_a_biased_expert_block_ends_with_its_float32_biases():
    slots, _ = expert_block_layout(config(expert_bias=True, expert_dtype="int8"))
    assert [(s.name, s.dtype, s.shape) for s in slots[-3:]] == [
        ("gate_bias", "float32", (INTER,)), ("up_bias", "float32", (INTER,)), ("down_bias", "float32", (HIDDEN,))]
    assert [s.name for s in expert_block_layout(config())[0]] == ["gate", "up", "down"]
    assert config(swiglu_limit=7.0).clamped_swiglu() == ClampedSwiglu(7.0, 1.702)
    assert config().clamped_swiglu() is None
    with pytest.raises(CheckpointError, match="swiglu_limit must be positive"):
        config(swiglu_limit=0.0)
