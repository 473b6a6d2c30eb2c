"""benchmarks/gguf_writer.py's write_gguf: what it writes for each architecture, read back with gguf-py's reader.

The tiny models are benchmarks/llama_cpp_parity.py's (the ones llama.cpp is compared with there). The file checks
need llama.cpp's gguf-py (COLIBRI_GGUF_PY: its folder in a llama.cpp tree); the refusals, and gpt-oss's MoE block
recomputed from the planned tensors as llama.cpp's graph computes it, need nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import imported_benchmarks

from colibri_stream.backends.rotary import rotate
from colibri_stream.checkpoint import ModelFolder
from colibri_stream.config import RopeConfig
from colibri_stream.loader import load_model
from colibri_stream.model.rope import cos_sin_table, yarn_mscale
from colibri_stream.synthetic import shape_config, write_synthetic_folder

GGUF_PY = os.environ.get("COLIBRI_GGUF_PY")
needs_gguf_py = pytest.mark.skipif(not GGUF_PY or not (Path(GGUF_PY) / "gguf").is_dir(),
                                   reason="COLIBRI_GGUF_PY names no gguf-py folder of a llama.cpp tree")
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


@pytest.fixture(scope="module")
def benchmarks():
    """(benchmarks/gguf_writer.py, benchmarks/llama_cpp_parity.py) imported."""
    with imported_benchmarks("gguf_writer", "llama_cpp_parity") as modules:
        yield modules


def written(benchmarks, family: str, folder: Path, matrices: str = "bf16"):
    """The tiny `family` model's folder (random weights) and its GGUF file, opened with gguf-py's reader."""
    writer, parity = benchmarks
    parity.write_tiny_folder(folder, parity.tiny_config(family))
    path = writer.write_gguf(folder, folder.with_suffix(".gguf"), GGUF_PY, matrices=matrices)
    import gguf

    return ModelFolder(folder), gguf.GGUFReader(str(path))


def value(reader, key: str):
    return reader.fields[key].contents()


def tensors(reader) -> dict:
    """name -> (shape in numpy order, GGML type name) of every tensor."""
    return {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}


def data(reader, name: str) -> np.ndarray:
    """A tensor's values: float32 as they are, bf16 as their uint16 bits (the reader gives bf16 as bytes)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return np.asarray(tensor.data).view(np.uint16) if tensor.tensor_type.name == "BF16" else np.asarray(tensor.data)


@needs_gguf_py
def test_glm4moe_tensors_and_keys(benchmarks, tmp_path):
    """GLM-4.5: layer 0 dense, layers 1-2 MoE with a shared expert and the correction bias; q/k/v biases; the
    routing keys; rotary over half of each head; q and k rows as Colibri holds them (NEOX rotary)."""
    folder, reader = written(benchmarks, "glm4_moe", tmp_path / "glm")
    config = folder.config
    found = tensors(reader)
    assert value(reader, "general.architecture") == "glm4moe"
    h, e, i, d = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.head_dim
    assert found["blk.0.ffn_gate.weight"] == ((config.intermediate_size, h), "BF16")
    assert "blk.0.ffn_gate_inp.weight" not in found and "blk.0.exp_probs_b.bias" not in found
    assert found["blk.1.post_attention_norm.weight"] == ((h,), "F32") and "blk.1.ffn_norm.weight" not in found
    assert found["blk.1.ffn_gate_inp.weight"] == ((e, h), "F32")
    assert found["blk.1.exp_probs_b.bias"] == ((e,), "F32")
    assert found["blk.2.ffn_up_exps.weight"] == ((e, i, h), "BF16")
    assert found["blk.2.ffn_down_shexp.weight"] == ((h, config.shared_expert_intermediate_size), "BF16")
    assert found["blk.1.attn_k.bias"] == ((config.num_kv_heads * d,), "F32")
    assert "blk.1.attn_q_norm.weight" not in found
    keys = {"glm4moe.expert_count": e, "glm4moe.expert_used_count": config.top_k, "glm4moe.expert_shared_count": 1,
            "glm4moe.leading_dense_block_count": 1, "glm4moe.expert_gating_func": SIGMOID,
            "glm4moe.expert_weights_norm": True, "glm4moe.nextn_predict_layers": 0,
            "glm4moe.rope.dimension_count": d // 2, "glm4moe.feed_forward_length": config.intermediate_size,
            "glm4moe.expert_feed_forward_length": i, "general.file_type": 32}  # MOSTLY_BF16
    assert {key: value(reader, key) for key in keys} == keys
    assert value(reader, "glm4moe.expert_weights_scale") == pytest.approx(1.0)
    assert "glm4moe.expert_group_count" not in reader.fields
    bias = folder.dense.get("layers.1.score_correction_bias")
    assert np.abs(bias).max() > 0 and np.array_equal(data(reader, "blk.1.exp_probs_b.bias"), bias)
    assert np.array_equal(data(reader, "blk.2.attn_q.weight"), folder.dense.get("layers.2.q_proj").view(np.uint16))


@needs_gguf_py
def test_glm4moe_groups_scaling_and_per_head_qk_norm(benchmarks, tmp_path):
    folder, reader = written(benchmarks, "glm4_moe-grouped", tmp_path / "glm")
    config = folder.config
    found = tensors(reader)
    assert found["blk.1.attn_q_norm.weight"] == ((config.head_dim,), "F32")
    assert value(reader, "glm4moe.expert_group_count") == 4 and value(reader, "glm4moe.expert_group_used_count") == 2
    assert value(reader, "glm4moe.expert_weights_scale") == pytest.approx(2.5)
    assert value(reader, "glm4moe.expert_shared_count") == 2


@needs_gguf_py
def test_minimax_m2_tensors_and_keys(benchmarks, tmp_path):
    """MiniMax-M2: every layer MoE, no shared expert, q and k norms over all heads, the correction bias, experts
    sized by feed_forward_length."""
    folder, reader = written(benchmarks, "minimax_m2", tmp_path / "minimax")
    config = folder.config
    found = tensors(reader)
    assert value(reader, "general.architecture") == "minimax-m2"
    d = config.head_dim
    assert found["blk.0.attn_q_norm.weight"] == ((config.num_heads * d,), "F32")
    assert found["blk.0.attn_k_norm.weight"] == ((config.num_kv_heads * d,), "F32")
    assert found["blk.0.ffn_norm.weight"] == ((config.hidden_size,), "F32")
    assert found["blk.2.exp_probs_b.bias"] == ((config.num_experts,), "F32")
    assert not [name for name in found if "shexp" in name or ".bias" in name and "exp_probs_b" not in name]
    keys = {"minimax-m2.expert_gating_func": SIGMOID,
            "minimax-m2.rope.dimension_count": config.rotary_dim,
            "minimax-m2.feed_forward_length": config.moe_intermediate_size,
            "minimax-m2.expert_count": config.num_experts, "minimax-m2.expert_used_count": config.top_k}
    assert {key: value(reader, key) for key in keys} == keys
    assert not [key for key in reader.fields
                if "shared" in key or "leading_dense" in key or "nextn" in key or "weights_norm" in key]


@needs_gguf_py
def test_mixtral_rows_permuted_and_f32_matrices(benchmarks, tmp_path):
    """Mixtral's q rows go to llama.cpp's interleaved rotary layout; f32 matrices hold the same bf16 values."""
    writer, _ = benchmarks
    folder, reader = written(benchmarks, "mixtral", tmp_path / "mixtral", matrices="f32")
    config = folder.config
    assert value(reader, "general.architecture") == "llama"
    assert tensors(reader)["blk.0.attn_q.weight"][1] == "F32"
    q = folder.dense.get("layers.0.q_proj").astype(np.float32)
    assert np.array_equal(data(reader, "blk.0.attn_q.weight"), writer._rotary_rows(q, config.num_heads))
    assert not [key for key in reader.fields if "gating_func" in key]


def test_options_llama_cpp_would_compute_otherwise_are_refused(benchmarks):
    writer, parity = benchmarks
    glm = parity.tiny_config("glm4_moe")
    arch = writer.ARCHITECTURES["glm4_moe"]
    assert writer.unwritable(glm, arch) == []
    assert writer.unwritable(dataclasses.replace(glm, shared_expert_gate=True), arch) == [
        "a gated shared expert, or one not a whole number of routed widths"]
    assert writer.unwritable(dataclasses.replace(glm, moe_layers=(1,)), arch) == [
        "dense layers other than the leading ones"]
    assert writer.unwritable(dataclasses.replace(glm, router_scoring="softmax"), arch) == [
        "router_scoring softmax (llama.cpp's glm4moe computes sigmoid)"]
    minimax, minimax_arch = parity.tiny_config("minimax_m2"), writer.ARCHITECTURES["minimax_m2"]
    assert writer.unwritable(dataclasses.replace(minimax, qk_norm="per_head"), minimax_arch) == ["qk_norm per_head"]
    assert writer.unwritable(dataclasses.replace(minimax, norm_topk_prob=False), minimax_arch) == [
        "unnormalised top-k weights"]
    assert writer.unwritable(dataclasses.replace(glm, norm_topk_prob=False), arch) == []
    mixtral = parity.tiny_config("mixtral")
    assert writer.unwritable(dataclasses.replace(mixtral, rotary_dim=16), writer.ARCHITECTURES["mixtral"]) == [
        "partial rotary"]


@needs_gguf_py
def test_deepseek2_tensors_and_keys(benchmarks, tmp_path):
    """DeepSeek-V3: latent attention as deepseek2 reads it (q LoRA, kv_a_mqa with the rope key, kv_b_proj split per
    head into attn_k_b transposed and attn_v_b, one cached KV head), YaRN's keys, groups, shared expert, layer 0
    dense; rows as Colibri holds them (its rotary already interleaved)."""
    folder, reader = written(benchmarks, "deepseek_v3", tmp_path / "deepseek")
    config = folder.config
    found = tensors(reader)
    assert value(reader, "general.architecture") == "deepseek2"
    h, heads, d, rope = config.hidden_size, config.num_heads, config.head_dim, config.rotary_dim
    rank, q_rank, dv, nope = config.kv_lora_rank, config.q_lora_rank, config.v_head_dim, d - rope
    assert found["blk.1.attn_q_a.weight"] == ((q_rank, h), "BF16")
    assert found["blk.1.attn_q_a_norm.weight"] == ((q_rank,), "F32")
    assert found["blk.1.attn_q_b.weight"] == ((heads * d, q_rank), "BF16")
    assert found["blk.1.attn_kv_a_mqa.weight"] == ((rank + rope, h), "BF16")
    assert found["blk.1.attn_kv_a_norm.weight"] == ((rank,), "F32")
    assert found["blk.1.attn_k_b.weight"] == ((heads, rank, nope), "BF16")
    assert found["blk.1.attn_v_b.weight"] == ((heads, dv, rank), "BF16")
    assert found["blk.1.attn_output.weight"] == ((h, heads * dv), "BF16")
    assert found["blk.0.ffn_gate.weight"] == ((config.intermediate_size, h), "BF16")
    assert found["blk.1.ffn_norm.weight"] == ((h,), "F32")
    assert found["blk.2.exp_probs_b.bias"] == ((config.num_experts,), "F32")
    assert not [name for name in found if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight"))]
    kv_b = folder.dense.get("layers.1.kv_b_proj").view(np.uint16).reshape(heads, nope + dv, rank)
    assert np.array_equal(data(reader, "blk.1.attn_k_b.weight").reshape(heads, rank, nope),
                          kv_b[:, :nope].transpose(0, 2, 1))
    assert np.array_equal(data(reader, "blk.1.attn_v_b.weight").reshape(heads, dv, rank), kv_b[:, nope:])
    assert np.array_equal(data(reader, "blk.1.attn_q_b.weight"), folder.dense.get("layers.1.q_b_proj").view(np.uint16))
    keys = {"deepseek2.attention.head_count": heads, "deepseek2.attention.head_count_kv": 1,
            "deepseek2.attention.key_length": rank + rope, "deepseek2.attention.value_length": rank,
            "deepseek2.attention.key_length_mla": d, "deepseek2.attention.value_length_mla": dv,
            "deepseek2.attention.q_lora_rank": q_rank, "deepseek2.attention.kv_lora_rank": rank,
            "deepseek2.rope.dimension_count": rope, "deepseek2.rope.scaling.type": "yarn",
            "deepseek2.rope.scaling.original_context_length": 4096, "deepseek2.expert_group_count": 4,
            "deepseek2.expert_group_used_count": 2, "deepseek2.expert_shared_count": 1,
            "deepseek2.leading_dense_block_count": 1, "deepseek2.expert_gating_func": SIGMOID,
            "deepseek2.expert_weights_norm": True, "deepseek2.nextn_predict_layers": 0,
            "deepseek2.feed_forward_length": config.intermediate_size,
            "deepseek2.expert_feed_forward_length": config.moe_intermediate_size}
    assert {key: value(reader, key) for key in keys} == keys
    floats = {"deepseek2.rope.scaling.factor": 40.0, "deepseek2.rope.scaling.yarn_beta_fast": 32.0,
              "deepseek2.rope.scaling.yarn_beta_slow": 1.0, "deepseek2.rope.scaling.yarn_log_multiplier": 0.1,
              "deepseek2.expert_weights_scale": 2.5, "deepseek2.attention.layer_norm_rms_epsilon": 1e-6}
    assert {key: value(reader, key) for key in floats} == pytest.approx(floats)


@needs_gguf_py
def test_deepseek2_without_q_lora_rope_rows_interleaved(benchmarks, tmp_path):
    """No q LoRA: one attn_q (q_lora_rank 0); Colibri's rotate-half rotary: each head's rope rows of q and the rope
    key's rows of kv_a_proj permuted to llama.cpp's interleaved pairs; no YaRN: no scaling keys but the type."""
    writer, parity = benchmarks
    config = dataclasses.replace(parity.tiny_config("deepseek_v3"), q_lora_rank=0, rope_interleave=False,
                                 rope=RopeConfig(theta=10000.0), softmax_scale=None)
    folder = tmp_path / "deepseek"
    write_synthetic_folder(folder, config, device="cpu")
    import gguf

    reader = gguf.GGUFReader(str(writer.write_gguf(folder, folder.with_suffix(".gguf"), GGUF_PY)))
    found, dense = tensors(reader), ModelFolder(folder).dense
    heads, d, rope = config.num_heads, config.head_dim, config.rotary_dim
    assert found["blk.1.attn_q.weight"] == ((heads * d, config.hidden_size), "BF16")
    assert not [name for name in found if "attn_q_a" in name or "attn_q_b" in name]
    assert value(reader, "deepseek2.attention.q_lora_rank") == 0
    assert value(reader, "deepseek2.rope.scaling.type") == "none"
    assert "deepseek2.rope.scaling.yarn_log_multiplier" not in reader.fields
    q = dense.get("layers.1.q_proj").view(np.uint16).reshape(heads, d, -1)
    expected = np.concatenate([q[:, :d - rope], writer._rotary_rows(q[:, d - rope:].reshape(heads * rope, -1), heads)
                               .reshape(heads, rope, -1)], axis=1)
    assert np.array_equal(data(reader, "blk.1.attn_q.weight").reshape(heads, d, -1), expected)
    kv_a = dense.get("layers.1.kv_a_proj").view(np.uint16)
    written_kv_a = data(reader, "blk.1.attn_kv_a_mqa.weight")
    assert np.array_equal(written_kv_a[:config.kv_lora_rank], kv_a[:config.kv_lora_rank])
    assert np.array_equal(written_kv_a[config.kv_lora_rank:], writer._rotary_rows(kv_a[config.kv_lora_rank:], 1))


def test_rope_rows_interleaved_keep_rotated_products(benchmarks):
    """Rope rows permuted by the writer and rotated in interleaved pairs give the query-key products that the rows
    as Colibri holds them give rotated in rotate-half pairs (so llama.cpp's NORM rope computes Colibri's scores)."""
    writer, _ = benchmarks
    rng = np.random.default_rng(0)
    heads, nope, rope, cols, positions = 3, 4, 8, 5, np.array([0, 3, 17])
    weight = rng.standard_normal((heads * (nope + rope), cols))
    x = rng.standard_normal((len(positions), cols))
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), rope, 32)

    def rotated_products(w: np.ndarray, interleaved: bool) -> np.ndarray:  # [T, T, heads]: rope parts' products
        part = (x @ w.T).reshape(len(positions), heads, nope + rope)[..., nope:]
        turned = rotate(np, part, cos, sin, positions, interleaved)
        return np.einsum("thd,shd->tsh", turned, turned)

    permuted = writer._rope_part_interleaved(weight, heads, rope)
    assert np.array_equal(permuted.reshape(heads, nope + rope, cols)[:, :nope],
                          weight.reshape(heads, nope + rope, cols)[:, :nope])
    assert np.allclose(rotated_products(permuted, True), rotated_products(weight, False), atol=1e-10)
    assert not np.allclose(rotated_products(weight, True), rotated_products(weight, False), atol=1e-3)


def test_deepseek2_refusals(benchmarks):
    """What llama.cpp's deepseek2 would compute otherwise: one line each; the published shapes pass."""
    writer, parity = benchmarks
    arch = writer.ARCHITECTURES["deepseek_v3"]
    tiny = parity.tiny_config("deepseek_v3")
    assert writer.unwritable(tiny, arch) == []
    assert writer.unwritable(shape_config("deepseek-v3", 5), arch) == []
    kimi = dataclasses.replace(shape_config("deepseek-v3", 5), num_experts=384, num_heads=64, num_kv_heads=64,
                               n_group=1, topk_group=1)
    assert writer.unwritable(kimi, arch) == []
    # DeepSeek-V2's YaRN (mscale = mscale_all_dim = 0.707): cos and sin unscaled, the softmax scale squared mscale
    v2_rope = dataclasses.replace(tiny.rope, mscale=0.707, mscale_all_dim=0.707)
    v2_scale = 48**-0.5 * (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2
    assert writer.unwritable(dataclasses.replace(tiny, rope=v2_rope, softmax_scale=v2_scale), arch) == []
    yarn_scales = ("YaRN's rotary magnitude or a softmax scale other than llama.cpp's (mscale equal to "
                   "mscale_all_dim, softmax scale head_dim^-0.5 times yarn_mscale(factor, mscale_all_dim)^2)")
    assert writer.unwritable(dataclasses.replace(tiny, rope=dataclasses.replace(tiny.rope, mscale=0.5)), arch) == [
        yarn_scales]
    assert writer.unwritable(dataclasses.replace(tiny, softmax_scale=48**-0.5), arch) == [yarn_scales]
    assert writer.unwritable(dataclasses.replace(tiny, latent_norm_eps=1e-5), arch) == [
        "latent norms of another epsilon than rms_norm_eps (llama.cpp's deepseek2 has one for every norm)"]
    assert writer.unwritable(dataclasses.replace(tiny, shared_expert_intermediate_size=0), arch) == [
        "MoE layers without a shared expert (llama.cpp's deepseek2 needs one)"]
    assert writer.unwritable(dataclasses.replace(tiny, rope=dataclasses.replace(tiny.rope, truncate=False)), arch) == [
        "YaRN without truncate (llama.cpp rounds the correction range to whole dimensions)"]
    linear = RopeConfig(type="linear", theta=10000.0, factor=4.0)
    assert writer.unwritable(dataclasses.replace(tiny, rope=linear, softmax_scale=None), arch) == [
        "rope type linear (llama.cpp's deepseek2 is written with default or yarn)"]
    lite = shape_config("deepseek-v3", 27)
    assert writer.unwritable(lite, arch) == [
        "a q LoRA in 26 or 27 layers (llama.cpp's deepseek2 reads those as DeepSeek-V2-Lite, without one)"]
    assert writer.unwritable(dataclasses.replace(lite, q_lora_rank=0), arch) == []
    assert "gqa attention (llama.cpp's deepseek2 computes mla)" in writer.unwritable(
        parity.tiny_config("glm4_moe"), arch)
    assert writer.unwritable(tiny, writer.ARCHITECTURES["glm4_moe"]) == [
        "mla attention (llama.cpp's glm4moe computes gqa)", "interleaved or scaled rope"]


@needs_gguf_py
def test_gpt_oss_tensors_and_keys(benchmarks, tmp_path):
    """gpt-oss: q/k/v/o biases, each head's sink, the post-attention norm, the router with its bias, separate gate,
    up and down expert stacks with their biases beside them (stacked from each expert's block), rows as Colibri
    holds them (NEOX rotary over the whole head); the window, its per-layer pattern and YaRN's keys."""
    folder, reader = written(benchmarks, "gpt_oss", tmp_path / "gpt-oss")
    config = folder.config
    found = tensors(reader)
    assert value(reader, "general.architecture") == "gpt-oss"
    h, e, i, d = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.head_dim
    heads, kv_rows = config.num_heads, config.num_kv_heads * d
    assert found["blk.1.attn_k.bias"] == ((kv_rows,), "F32") and found["blk.1.attn_output.bias"] == ((h,), "F32")
    assert found["blk.1.attn_sinks.weight"] == ((heads,), "F32")
    assert found["blk.1.post_attention_norm.weight"] == ((h,), "F32") and "blk.1.ffn_norm.weight" not in found
    assert found["blk.1.ffn_gate_inp.weight"] == ((e, h), "F32") and found["blk.1.ffn_gate_inp.bias"] == ((e,), "F32")
    assert found["blk.1.ffn_gate_exps.weight"] == ((e, i, h), "BF16")
    assert found["blk.1.ffn_down_exps.weight"] == ((e, h, i), "BF16")
    assert found["blk.1.ffn_up_exps.bias"] == ((e, i), "F32") and found["blk.1.ffn_down_exps.bias"] == ((e, h), "F32")
    assert not [name for name in found if "exp_probs_b" in name or "shexp" in name or "q_norm" in name]
    dense = folder.dense
    sinks = dense.get("layers.1.sinks").astype(np.float32)
    assert np.abs(sinks).max() > 0 and np.array_equal(data(reader, "blk.1.attn_sinks.weight"), sinks)
    assert np.array_equal(data(reader, "blk.2.attn_output.bias"), dense.get("layers.2.o_bias").astype(np.float32))
    assert np.array_equal(data(reader, "blk.2.ffn_gate_inp.bias"), dense.get("layers.2.router_bias").astype(np.float32))
    assert np.array_equal(data(reader, "blk.2.attn_q.weight"), dense.get("layers.2.q_proj").view(np.uint16))
    expert = folder.experts.tensors(3, 5)
    assert np.array_equal(data(reader, "blk.3.ffn_up_exps.weight").reshape(e, i, h)[5], expert["up"].view(np.uint16))
    assert np.array_equal(data(reader, "blk.3.ffn_gate_exps.bias").reshape(e, i)[5], expert["gate_bias"])
    assert np.array_equal(data(reader, "blk.3.ffn_down_exps.bias").reshape(e, h)[5], expert["down_bias"])
    assert np.abs(expert["up_bias"]).max() > 0
    keys = {"gpt-oss.attention.sliding_window": 8, "gpt-oss.expert_feed_forward_length": i,
            "gpt-oss.rope.dimension_count": d, "gpt-oss.attention.key_length": d,
            "gpt-oss.attention.head_count_kv": config.num_kv_heads, "gpt-oss.expert_count": e,
            "gpt-oss.expert_used_count": config.top_k, "gpt-oss.rope.scaling.type": "yarn",
            "gpt-oss.rope.scaling.original_context_length": 4096}
    assert {key: value(reader, key) for key in keys} == keys
    assert list(value(reader, "gpt-oss.attention.sliding_window_pattern")) == [True, False, True, False]
    floats = {"gpt-oss.rope.scaling.factor": 32.0, "gpt-oss.rope.scaling.yarn_beta_fast": 32.0,
              "gpt-oss.rope.scaling.yarn_beta_slow": 1.0, "gpt-oss.rope.freq_base": 150000.0}
    assert {key: value(reader, key) for key in floats} == pytest.approx(floats)
    assert not [key for key in reader.fields
                if "attn_factor" in key or "gating_func" in key or "shared" in key or "weights_norm" in key]


@needs_gguf_py
def test_gpt_oss_biases_it_lacks_are_zeros_and_attention_factor(benchmarks, tmp_path):
    """Without q/k/v/o, router or expert biases: no q/k/v biases, zeros for those llama.cpp requires; a YaRN
    attention_factor of the model's as rope.scaling.attn_factor over yarn_mscale(factor) (llama.cpp's own); a
    pattern of windows other than alternating, written layer by layer."""
    writer, parity = benchmarks
    tiny = parity.tiny_config("gpt_oss")
    config = dataclasses.replace(tiny, qkv_bias=False, o_bias=False, router_bias=False, expert_bias=False,
                                 sliding_windows=(None, 8, 8, None),
                                 rope=dataclasses.replace(tiny.rope, attention_factor=1.7))
    folder = tmp_path / "gpt-oss"
    parity.write_tiny_folder(folder, config)
    import gguf

    reader = gguf.GGUFReader(str(writer.write_gguf(folder, folder.with_suffix(".gguf"), GGUF_PY)))
    found = tensors(reader)
    assert not [name for name in found if name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias"))]
    for name in ("blk.0.attn_output.bias", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias",
                 "blk.3.ffn_down_exps.bias"):
        assert found[name][1] == "F32" and not np.any(data(reader, name))
    assert list(value(reader, "gpt-oss.attention.sliding_window_pattern")) == [False, True, True, False]
    assert value(reader, "gpt-oss.rope.scaling.attn_factor") == pytest.approx(1.7 / yarn_mscale(32.0))


def test_gpt_oss_refusals(benchmarks):
    """What llama.cpp's gpt-oss would compute otherwise: one line each. The published shapes' YaRN without
    truncate is refused; with truncate they pass."""
    writer, parity = benchmarks
    arch = writer.ARCHITECTURES["gpt_oss"]
    tiny = parity.tiny_config("gpt_oss")
    assert writer.unwritable(tiny, arch) == []
    untruncated = ["YaRN without truncate (llama.cpp rounds the correction range to whole dimensions)"]
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        published = shape_config(name, 4)
        assert (published.swiglu_alpha, published.swiglu_limit) == arch.swiglu_oai
        assert writer.unwritable(published, arch) == untruncated
        truncated = dataclasses.replace(published.rope, truncate=True)
        assert writer.unwritable(dataclasses.replace(published, rope=truncated), arch) == []

    def refused(**changes) -> list[str]:
        return writer.unwritable(dataclasses.replace(tiny, **changes), arch)

    experts = "experts other than the clamped SwiGLU llama.cpp's gpt-oss computes (alpha 1.702, limit 7)"
    assert refused(swiglu_limit=6.0) == [experts]
    assert refused(swiglu_alpha=1.5) == [experts]
    assert refused(swiglu_limit=None) == [experts]
    assert refused(attention_sinks=False) == ["no attention sinks (llama.cpp's gpt-oss reads them in every layer)"]
    assert refused(sliding_windows=(None,) * 4) == ["no sliding-window layer (llama.cpp's gpt-oss needs one)"]
    assert refused(sliding_windows=(8, None, 16, None)) == ["sliding windows of more than one width"]
    assert refused(n_group=2, topk_group=2) == [
        "expert groups (llama.cpp's gpt-oss would rank them by router logits)"]
    assert refused(norm_topk_prob=False) == ["unnormalised top-k weights"]
    assert refused(rotary_dim=16) == ["partial rotary"]
    assert refused(softmax_scale=0.2) == ["a softmax scale other than head_dim^-0.5"]
    assert refused(clip_qkv=8.0) == ["clip_qkv"]
    assert refused(rope=RopeConfig(type="linear", theta=150000.0, factor=4.0)) == [
        "rope type linear (llama.cpp's gpt-oss is written with default or yarn)"]
    assert refused(rope=RopeConfig(theta=150000.0)) == []
    assert writer.unwritable(tiny, writer.ARCHITECTURES["qwen3_moe"]) == [
        "qk_norm none", "q/k/v biases", "an o bias, attention sinks or sliding windows", "interleaved or scaled rope",
        "a router bias, expert biases or a clamped SwiGLU"]


def test_gpt_oss_moe_as_llama_cpp_computes_it_from_the_planned_tensors(benchmarks, tmp_path):
    """llama.cpp's gpt-oss MoE block (its graph's steps redone in NumPy: router logits plus bias, the top-k,
    a softmax over those k, gate and up with their biases, gpt-oss's clamped SwiGLU with (up + 1), down plus its
    bias, the weighted sum) on the tensors write_gguf plans (f32 matrices) equals Colibri's MoE block, with inputs
    large enough for the clamp at 7 to bite."""
    writer, parity = benchmarks
    config = parity.tiny_config("gpt_oss")
    parity.write_tiny_folder(tmp_path / "gpt-oss", config)
    folder = ModelFolder(tmp_path / "gpt-oss")
    types_stub = types.SimpleNamespace(GGMLQuantizationType=types.SimpleNamespace(F32="F32", BF16="BF16"))
    plan = writer._tensor_plan(folder, config, writer.ARCHITECTURES["gpt_oss"], types_stub, "f32")

    def tensor(name: str) -> np.ndarray:
        shape, _, make = plan[name]
        return make().reshape(shape)

    layer, (alpha, limit) = 2, writer.ARCHITECTURES["gpt_oss"].swiglu_oai
    x = np.random.default_rng(3).standard_normal((6, config.hidden_size)).astype(np.float32) * 4
    b = f"blk.{layer}."
    logits = x @ tensor(b + "ffn_gate_inp.weight").T + tensor(b + "ffn_gate_inp.bias")  # [T, E]
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :config.top_k]  # [T, k]
    weights = np.exp(np.take_along_axis(logits, chosen, -1))
    weights /= weights.sum(-1, keepdims=True)  # [T, k]
    stacks = {part: tensor(b + f"ffn_{part}_exps.weight") for part in ("gate", "up", "down")}
    biases = {part: tensor(b + f"ffn_{part}_exps.bias") for part in ("gate", "up", "down")}
    expected = np.zeros_like(x)
    clamped = 0
    for t in range(len(x)):
        for e, w in zip(chosen[t], weights[t]):
            gate = np.minimum(stacks["gate"][e] @ x[t] + biases["gate"][e], limit)
            up = np.clip(stacks["up"][e] @ x[t] + biases["up"][e], -limit, limit)
            clamped += int(np.sum(gate == limit))
            hidden = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            expected[t] += w * (stacks["down"][e] @ hidden + biases["down"][e])
    assert clamped > 0
    model = load_model(str(tmp_path / "gpt-oss"), device="cpu")
    ours = np.asarray(model._mlp(layer, model.layers[layer], x))
    assert np.allclose(ours, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@needs_gguf_py
def test_mxfp4_experts_are_written_as_ggml_mxfp4_with_the_same_values(tmp_path):
    """A gpt-oss folder with mxfp4 experts: its expert stacks are GGML MXFP4 (17 bytes a block of 32), which gguf-py's
    own dequantizer reads back as exactly the values Colibri's codec decodes from the folder; the other matrices
    bf16. A folder of another quantized expert format is refused."""
    from colibri_stream.expert_codecs import dequantize_expert

    with imported_benchmarks("gguf_writer") as (writer,):
        config = dataclasses.replace(shape_config("gpt-oss-20b", 2), vocab_size=512, hidden_size=64, num_heads=4,
                                     num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=96)
        config = dataclasses.replace(config, rope=dataclasses.replace(config.rope, truncate=True))  # llama.cpp's YaRN
        write_synthetic_folder(tmp_path / "mxfp4", config, expert_dtype="mxfp4")
        path = writer.write_gguf(tmp_path / "mxfp4", tmp_path / "mxfp4.gguf", GGUF_PY)
        import gguf  # on the path write_gguf put it on
        from gguf.quants import dequantize

        reader = gguf.GGUFReader(str(path))
        folder = ModelFolder(tmp_path / "mxfp4")
        for part, (rows, cols) in (("gate", (96, 64)), ("down", (64, 96))):
            tensor = next(t for t in reader.tensors if t.name == f"blk.1.ffn_{part}_exps.weight")
            assert tensor.tensor_type == gguf.GGMLQuantizationType.MXFP4
            values = dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType.MXFP4).reshape(4, rows, cols)
            for expert in range(4):
                want = dequantize_expert(folder.experts.tensors(1, expert))[part]
                assert np.abs(want).max() > 0 and np.array_equal(values[expert], want)
        assert tensors(reader)["blk.1.attn_q.weight"][1] == "BF16"
        write_synthetic_folder(tmp_path / "int4", config, expert_dtype="int4", group_size=32)
        with pytest.raises(ValueError, match="experts other than bf16 or mxfp4"):
            writer.write_gguf(tmp_path / "int4", tmp_path / "int4.gguf", GGUF_PY)
