"""benchmarks/llama_cpp.py's write_gguf: what it writes for each architecture, read back with gguf-py's reader.

The tiny models are benchmarks/llama_cpp_parity.py's (the ones llama.cpp is compared with there). The file checks
need llama.cpp's gguf-py (COLIBRI_GGUF_PY: its folder in a llama.cpp tree); the refusals need nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_stream.checkpoint import ModelFolder
from colibri_stream.synthetic import write_synthetic_folder

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
GGUF_PY = os.environ.get("COLIBRI_GGUF_PY")
needs_gguf_py = pytest.mark.skipif(not GGUF_PY or not (Path(GGUF_PY) / "gguf").is_dir(),
                                   reason="COLIBRI_GGUF_PY names no gguf-py folder of a llama.cpp tree")
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


@pytest.fixture(scope="module")
def benchmarks():
    """(benchmarks/llama_cpp.py, benchmarks/llama_cpp_parity.py) imported."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("llama_cpp"), importlib.import_module("llama_cpp_parity")
    finally:
        sys.path.remove(str(BENCHMARKS))


def written(benchmarks, family: str, folder: Path, matrices: str = "bf16"):
    """The tiny `family` model's folder (random weights) and its GGUF file, opened with gguf-py's reader."""
    writer, parity = benchmarks
    write_synthetic_folder(folder, parity.tiny_config(family), device="cpu")
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
