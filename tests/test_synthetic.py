"""Synthetic random-weight models (the benchmarks' models) build through the normal loading path on the CPU; gpt-oss
with its biases, and with the YaRN llama.cpp computes where benchmarks/long_context.py compares with it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import imported_benchmarks

from colibri_stream import synthetic
from colibri_stream.backends.numpy_backend import NumpyBackend
from colibri_stream.checkpoint import TOKENIZER_FILES, ModelFolder, dense_tensor_specs
from colibri_stream.config import ModelConfig
from colibri_stream.errors import CheckpointError
from colibri_stream.export.architectures import translate_config
from colibri_stream.batch import single_sequence_batch
from colibri_stream.loader import load_model
from colibri_stream.synthetic import (BIAS_STD, CORRECTION_BIAS_STD, SHAPES, RandomDense, RandomExpertStore,
                                      WeightDraw, dense_draws, expert_draws, pooled_normal, shape_config,
                                      synthetic_model, write_synthetic_folder)



@pytest.mark.parametrize("name", list(SHAPES))
def test_named_shapes_are_valid_configs(name):
    config = shape_config(name, num_layers=3)
    assert config.num_layers == 3 and config.moe_layers == tuple(range(SHAPES[name].get("first_dense_layers", 0), 3))
    assert shape_config(name).num_layers == SHAPES[name]["num_layers"]


# Each named shape and the stored published config.json it is taken from (tests/data/hf_configs): MiniMax-M2.5
# keeps MiniMax-M2's architecture and dimensions; gpt-oss-20b's is gpt-oss-120b's with its own sizes (SIZES).
PUBLISHED = {"mixtral-8x7b": "mixtral-8x7b-v0.1", "qwen3-30b-a3b": "qwen3-30b-a3b", "olmoe-1b-7b": "olmoe-1b-7b",
             "glm-4.5-air": "glm-4.5-air", "minimax-m2": "minimax-m2.5-bf16", "deepseek-v3": "deepseek-v3",
             "gpt-oss-20b": "gpt-oss-120b", "gpt-oss-120b": "gpt-oss-120b"}
# Where a shape's published config.json differs from the stored file it names: openai/gpt-oss-20b has 24 layers
# (their layer_types the first 24 of gpt-oss-120b's) and 32 experts.
SIZES = {"gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32)}
# The router tensors that tell the exporter a published checkpoint has score correction biases.
CORRECTION_BIASES = {"model.layers.1.mlp.gate.e_score_correction_bias",
                     "model.layers.3.mlp.gate.e_score_correction_bias",
                     "model.layers.0.block_sparse_moe.e_score_correction_bias"}


def test_every_shape_names_its_published_config():
    assert set(PUBLISHED) == set(SHAPES)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shape_is_what_its_published_config_translates_to(name):
    """Every field the exporter derives from the published config.json, but the special tokens (a synthetic model
    has no tokenizer)."""
    raw = json.loads((Path(__file__).parent / "data" / "hf_configs" / f"{PUBLISHED[name]}.json").read_text())
    raw.update(SIZES.get(name, {}))
    if "layer_types" in raw:
        raw["layer_types"] = raw["layer_types"][:raw["num_hidden_layers"]]
    published = translate_config(raw, {}, CORRECTION_BIASES, "bfloat16", "bfloat16")
    published = dataclasses.replace(published, bos_token_id=None, eos_token_ids=(), pad_token_id=None)
    assert shape_config(name) == published


@pytest.mark.parametrize("name, sizes", [("gpt-oss-120b", {}), ("gpt-oss-20b", SIZES["gpt-oss-20b"])])
def test_gpt_oss_shapes_are_transformers_defaults(name, sizes):
    """transformers' GptOssConfig defaults are gpt-oss-120b's published values (its layer_types filled in as
    sliding at even layers, YaRN factor 32 over 4096 positions without truncation); with 24 layers and 32 experts,
    gpt-oss-20b's. Both translate to the shapes, windows and all."""
    transformers = pytest.importorskip("transformers")
    raw = transformers.GptOssConfig(**sizes).to_dict()
    assert shape_config(name) == translate_config(raw, {}, set(), "bfloat16", "bfloat16")
    config = shape_config(name, num_layers=3)
    assert config.sliding_windows == (128, None, 128) and config.rope.truncate is False


def test_correction_biases_are_drawn_wide_enough_to_change_the_choice():
    draws = dense_draws(shape_config("glm-4.5-air", num_layers=2))
    assert draws["layers.1.score_correction_bias"].std == CORRECTION_BIAS_STD
    assert draws["layers.1.q_bias"].std == 0.02 and draws["layers.1.input_norm"].shift == 1.0


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


def expert_values(folder: ModelFolder, layer: int, expert: int) -> dict[str, np.ndarray]:
    return {name: array.astype(np.float32) for name, array in folder.experts.tensors(layer, expert).items()}


def test_written_folder_verifies_loads_and_holds_the_synthetic_weights(tmp_path):
    config = tiny_config()
    assert write_synthetic_folder(tmp_path, config, device="cpu") == config
    assert not any((tmp_path / name).exists() for name in TOKENIZER_FILES)
    folder = ModelFolder(tmp_path, verify=True)  # every checksum
    assert folder.config == config
    # Small tensors are drawn exactly as the in-memory synthetic model draws them (one recipe).
    store = RandomExpertStore(config, NumpyBackend())
    for layer, expert in ((0, 0), (1, 5)):
        drawn = store.expert(layer, expert)
        assert all(np.array_equal(folder.experts.tensors(layer, expert)[n].view(np.uint16), drawn[n].view(np.uint16))
                   for n in drawn)
    dense = RandomDense(config, NumpyBackend())
    q_proj = folder.dense.get("layers.1.q_proj")
    assert np.array_equal(q_proj.view(np.uint16), dense.get("layers.1.q_proj").view(np.uint16))
    norm = folder.dense.get("layers.0.input_norm").astype(np.float32)
    assert np.allclose(norm, dense.get("layers.0.input_norm"), rtol=1e-2) and abs(norm.mean() - 1) < 0.05
    model = load_model(str(tmp_path), device="cpu")
    kv = model.allocate_kv_cache(4, 8)
    logits = model.forward(single_sequence_batch(np.arange(7), 0, np.arange(4), 8), kv)
    assert logits.shape == (1, 300) and np.isfinite(logits).all() and logits.std() > 0.1


def test_large_tensors_come_from_windows_of_a_random_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "POOL_VALUES", 1024)  # every expert matrix (2048 values) takes the pooled path
    monkeypatch.setattr(synthetic, "POOL_WINDOW", 64)
    config = tiny_config()
    write_synthetic_folder(tmp_path / "a", config, device="cpu")
    write_synthetic_folder(tmp_path / "b", config, seed=1, device="cpu")
    a, b = ModelFolder(tmp_path / "a", verify=True), ModelFolder(tmp_path / "b", verify=True)
    h, i = config.hidden_size, config.moe_intermediate_size
    for layer, expert in ((0, 0), (1, 7)):
        tensors, other = expert_values(a, layer, expert), expert_values(b, layer, expert)
        for name, std in (("gate", h**-0.5), ("up", h**-0.5), ("down", i**-0.5)):
            values = tensors[name]
            assert values.std() == pytest.approx(std, rel=0.15) and abs(values.mean()) < 0.2 * std
            assert len(np.unique(values)) > 500  # not zeros, not one repeated value
            assert not np.array_equal(values, other[name])  # another seed, other weights
    assert not np.array_equal(expert_values(a, 0, 0)["gate"], expert_values(a, 0, 1)["gate"])
    model = load_model(str(tmp_path / "a"), device="cpu")
    logits = model.forward(single_sequence_batch(np.arange(7), 0, np.arange(4), 8), model.allocate_kv_cache(4, 8))
    assert np.isfinite(logits).all()


def test_pooled_normal_is_seeded_and_not_a_repeated_pattern(monkeypatch):
    monkeypatch.setattr(synthetic, "POOL_VALUES", 1 << 14)
    draw = WeightDraw((256, 4096), 0.5, 42, "bfloat16")  # rows of 4 windows, from a pool of 16 windows' values
    values = pooled_normal(draw)
    assert values.shape == (256, 4096) and values.dtype == NumpyBackend().random_weight((1,), 1, 0, "bfloat16").dtype
    assert np.array_equal(values.view(np.uint16), pooled_normal(draw).view(np.uint16))
    assert not np.array_equal(values, pooled_normal(WeightDraw((256, 4096), 0.5, 43, "bfloat16")))
    rows = values.astype(np.float32)
    assert rows.std() == pytest.approx(0.5, rel=0.05) and abs(rows.mean()) < 0.02
    assert len(np.unique(rows.view(np.uint32), axis=0)) == 256  # every row differs from every other
    for size in (100, 1 << 16):  # a shift (norm weights) keeps the storage dtype, small and pooled alike
        shifted = pooled_normal(WeightDraw((size,), 0.1, 7, "bfloat16", 1.0))
        assert shifted.dtype == values.dtype and shifted.shape == (size,)
        assert abs(shifted.astype(np.float32).mean() - 1) < 0.05


def test_write_refuses_what_it_cannot_draw(tmp_path):
    with pytest.raises(CheckpointError, match="int3"):
        write_synthetic_folder(tmp_path, tiny_config(), expert_dtype="int3", device="cpu")
    with pytest.raises(ValueError, match="num_layers"):
        write_synthetic_folder(tmp_path, tiny_config(), num_layers=1, device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# Fixed draws of the shapes without biased experts, and gpt-oss's biases
# ---------------------------------------------------------------------------------------------------------------

def small(name: str, layers: int = 2) -> ModelConfig:
    """A named shape at tiny widths (tiny_config's), its options kept."""
    return dataclasses.replace(shape_config(name, layers), vocab_size=300, hidden_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32,
                               max_position_embeddings=128)


def hashed(digest, name: str, array) -> None:
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(array).tobytes())


def folder_digest(path: Path) -> str:
    """SHA-256 of every tensor of a model folder by name, as stored: dense ones in file order, then each expert's."""
    folder = ModelFolder(path, verify=True)
    digest = hashlib.sha256()
    for name in folder.dense.names:
        hashed(digest, name, folder.dense.get(name))
    for layer in folder.config.moe_layers:
        for expert in range(folder.config.num_experts):
            for name, array in sorted(folder.experts.tensors(layer, expert).items()):
                hashed(digest, name, array)
    return digest.hexdigest()


def memory_digest(config) -> str:
    """SHA-256 of every tensor `synthetic_model`'s dense source and expert store draw on the NumPy backend."""
    backend, digest = NumpyBackend(), hashlib.sha256()
    dense = RandomDense(config, backend)
    for name in dense.names:
        hashed(digest, name, dense.get(name))
    store = RandomExpertStore(config, backend)
    for layer in config.moe_layers:
        for expert in range(config.num_experts):
            for name, array in sorted(store.expert(layer, expert).items()):
                hashed(digest, name, array)
    return digest.hexdigest()


# Digests of the tensors the recipe draws for shapes without biased experts (NumPy 2.4's Generator): drawing
# gpt-oss's expert biases changes none of their values. "pooled" writes with a pool of 1024 values in windows of 64
# (every expert matrix pooled).
FIXED_DIGESTS = {
    ("mixtral-8x7b", "folder", 0): "0409358f4b65a9fd5fe46c6925c0e742f733abbacc256be49d9ba64e53aa19c8",
    ("qwen3-30b-a3b", "folder", 3): "542744771fa156f6578980256a96421fa7e33a62717ba160279d2f4b7251594d",
    ("mixtral-8x7b", "pooled", 0): "083ef2047be8509edaad9d978e6ba95d1cf725cb577cdb47bd32a9c5dfc854e5",
    ("mixtral-8x7b", "memory", 0): "ec00332ceb1c6cc8993aa0f9eb3e11be430ab8f5c37fb3069b0469322108b9e6",
    ("qwen3-30b-a3b", "memory", 0): "b2e7af693ba39907a5672a2eb2f25f3538826db2f0ee9cfe5857c902e13d81b2",
}


@pytest.mark.parametrize("name, where, seed", list(FIXED_DIGESTS))
def test_shapes_without_biased_experts_draw_what_they_drew(name, where, seed, tmp_path, monkeypatch):
    config = small(name)
    if where == "memory":
        assert memory_digest(config) == FIXED_DIGESTS[name, where, seed]
        return
    if where == "pooled":
        monkeypatch.setattr(synthetic, "POOL_VALUES", 1024)
        monkeypatch.setattr(synthetic, "POOL_WINDOW", 64)
    write_synthetic_folder(tmp_path, config, seed=seed, device="cpu")
    assert folder_digest(tmp_path) == FIXED_DIGESTS[name, where, seed]


def gpt_oss_config():
    """A tiny gpt-oss (gpt-oss-20b's options: biases, sinks, biased clamped-SwiGLU experts), a window of 8."""
    return dataclasses.replace(small("gpt-oss-20b"), sliding_windows=(8, None))


def test_gpt_oss_experts_draw_small_float32_biases_seeded_apart_from_their_matrices():
    config = gpt_oss_config()
    draws = expert_draws(config, 1, 3, seed=2)
    assert list(draws) == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
    biases = {name: draws[name] for name in ("gate_bias", "up_bias", "down_bias")}
    assert [d.shape for d in biases.values()] == [(32,), (32,), (64,)]
    assert all(d.dtype == "float32" and d.std == BIAS_STD and d.shift == 0.0 for d in biases.values())
    seeds = {d.seed for layer in (0, 1) for expert in range(8) for seed in (0, 2)
             for d in expert_draws(config, layer, expert, seed).values()}
    assert len(seeds) == 2 * 8 * 2 * 6  # every tensor of every expert, layer and seed its own stream
    assert max(seeds) < 2**63  # CuPy takes 64-bit seeds
    plain = expert_draws(dataclasses.replace(config, expert_bias=False), 1, 3, seed=2)
    assert plain == {name: draws[name] for name in ("gate", "up", "down")}  # the matrices of any expert_bias


def test_gpt_oss_folder_holds_the_drawn_biases_and_runs(tmp_path):
    config = gpt_oss_config()
    write_synthetic_folder(tmp_path, config, device="cpu")
    folder = ModelFolder(tmp_path, verify=True)
    assert folder.config == config
    store = RandomExpertStore(config, NumpyBackend())
    biases = []
    for layer, expert in ((0, 0), (1, 5)):
        stored, drawn = folder.experts.tensors(layer, expert), store.expert(layer, expert)
        assert sorted(stored) == sorted(drawn)
        assert all(np.array_equal(stored[n].view(np.uint8), drawn[n].view(np.uint8)) for n in drawn)
        biases += [stored[n] for n in ("gate_bias", "up_bias", "down_bias")]
    values = np.concatenate(biases)
    assert values.dtype == np.float32 and np.count_nonzero(values) == values.size  # never zeros
    assert values.std() == pytest.approx(BIAS_STD, rel=0.2)
    assert not np.array_equal(biases[0], biases[3])  # another expert, other biases
    for name in ("layers.0.sinks", "layers.0.q_bias", "layers.0.k_bias", "layers.0.v_bias", "layers.0.o_bias",
                 "layers.1.router_bias"):
        dense = folder.dense.get(name).astype(np.float32)
        assert np.count_nonzero(dense) == dense.size and np.abs(dense).max() < 5 * BIAS_STD, name
    model = load_model(str(tmp_path), device="cpu")
    ids = np.arange(3, 13)  # longer than the window of 8
    logits = model.forward(single_sequence_batch(ids, 0, np.arange(4), 8), model.allocate_kv_cache(4, 8))
    assert logits.shape == (1, 300) and np.isfinite(logits).all() and logits.std() > 0.1


def test_gpt_oss_synthetic_model_draws_the_biases_of_its_folder(tmp_path):
    """The in-memory model (biased expert store) computes what the folder of the same seed computes."""
    config = gpt_oss_config()
    write_synthetic_folder(tmp_path, config, seed=1, device="cpu")
    ids = np.arange(5, 15)

    def logits(model):
        return model.forward(single_sequence_batch(ids, 0, np.arange(4), 8), model.allocate_kv_cache(4, 8))

    ours = logits(synthetic_model(config, device="cpu", seed=1))
    assert np.isfinite(ours).all() and ours.std() > 0.1
    # the folder rounds norm weights and 1-D biases to bf16 (dense_tensor_dtype): close, not equal
    assert np.allclose(ours, logits(load_model(str(tmp_path), device="cpu")), atol=0.05 * np.abs(ours).max())


@pytest.mark.parametrize("expert_dtype", ["int8", "mxfp4"])
def test_quantized_gpt_oss_folder_keeps_the_float32_biases(expert_dtype, tmp_path):
    config = gpt_oss_config()
    write_synthetic_folder(tmp_path / "bf16", config, device="cpu")
    write_synthetic_folder(tmp_path / expert_dtype, config, expert_dtype=expert_dtype, device="cpu")
    plain = ModelFolder(tmp_path / "bf16").experts.tensors(1, 6)
    quantized = ModelFolder(tmp_path / expert_dtype, verify=True).experts.tensors(1, 6)
    for name in ("gate_bias", "up_bias", "down_bias"):
        assert quantized[name].dtype == np.float32 and np.array_equal(quantized[name], plain[name])
    model = load_model(str(tmp_path / expert_dtype), device="cpu")
    logits = model.forward(single_sequence_batch(np.arange(3, 9), 0, np.arange(4), 8), model.allocate_kv_cache(4, 8))
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_yarn_truncate_is_set_for_llama_cpp_and_nothing_else(name):
    published = shape_config(name, 3)
    truncated = shape_config(name, 3, yarn_truncate=True)
    assert published.rope.truncate is False and truncated.rope.truncate is True
    assert dataclasses.replace(truncated, rope=published.rope) == published
    assert shape_config(name, 3, yarn_truncate=None) == published


def test_yarn_truncate_needs_a_yarn_shape():
    assert shape_config("deepseek-v3", 4, yarn_truncate=True) == shape_config("deepseek-v3", 4)  # truncates already
    with pytest.raises(ValueError, match="not yarn"):
        shape_config("mixtral-8x7b", 2, yarn_truncate=True)


@pytest.fixture(scope="module")
def benchmark_modules():
    """(benchmarks/long_context.py, benchmarks/gguf_writer.py) imported (neither needs a GPU or llama.cpp here)."""
    with imported_benchmarks("long_context", "gguf_writer") as modules:
        yield modules


def test_long_context_writes_what_llama_cpp_computes(benchmark_modules):
    """Every shape of an architecture llama.cpp has is written by long_context.py as a model llama.cpp computes as
    Colibri does: gpt-oss with YaRN's truncate on, the others as published."""
    long_context, gguf_writer = benchmark_modules
    assert [name for name in SHAPES if long_context.needs_yarn_truncate(name)] == ["gpt-oss-20b", "gpt-oss-120b"]
    for name in SHAPES:
        config = long_context.benchmark_config(name, 2)
        arch = gguf_writer.ARCHITECTURES.get(config.architecture)
        if arch is not None:
            assert gguf_writer.unwritable(config, arch) == [], name
        if not long_context.needs_yarn_truncate(name):
            assert config == shape_config(name, 2)
    assert gguf_writer.unwritable(shape_config("gpt-oss-20b", 2), gguf_writer.ARCHITECTURES["gpt_oss"]) == [
        "YaRN without truncate (llama.cpp rounds the correction range to whole dimensions)"]


def test_long_context_shape_entries_name_their_dense_layers(benchmark_modules):
    """SHAPE:LAYERS:DENSE gives that many leading dense layers, the rest MoE, in a folder of its own name; the
    entries without DENSE keep the shape's own split and serving_gpu's folder name."""
    long_context, _ = benchmark_modules
    assert long_context.parse_shape("deepseek-v3:3:1") == ("deepseek-v3", 3, 1)
    assert long_context.parse_shape("mixtral-8x7b:8") == ("mixtral-8x7b", 8, None)
    config = long_context.benchmark_config("deepseek-v3", 3, 1)
    assert config.moe_layers == (1, 2) and long_context.layer_split(config) == "3 layers (1 dense + 2 MoE)"
    assert dataclasses.replace(config, moe_layers=()) == shape_config("deepseek-v3", 3)
    assert long_context.benchmark_config("deepseek-v3", 3).moe_layers == ()
    root = Path("/models")
    assert long_context.folder_path("deepseek-v3", 3, 1, root) == root / "deepseek-v3-3-layers-1-dense"
    assert long_context.folder_path("qwen3-30b-a3b", 16, None, root) == root / "qwen3-30b-a3b-16-layers"
    with pytest.raises(ValueError, match="no dense MLP width"):
        long_context.benchmark_config("mixtral-8x7b", 2, 1)


def test_long_context_predicts_the_bytes_it_writes(benchmark_modules, tmp_path):
    """folder_bytes is the written folder's size up to its allowances; a DeepSeek-V3 layer of routed experts is
    22.5 GB in the folder and in the GGUF file alike; a cached token is 576 values a layer in both engines."""
    long_context, _ = benchmark_modules
    config = dataclasses.replace(long_context.benchmark_config("deepseek-v3", 2, 1), vocab_size=512,
                                 hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=48, rotary_dim=16,
                                 v_head_dim=32, q_lora_rank=96, kv_lora_rank=64, num_experts=16, top_k=4, n_group=4,
                                 topk_group=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                 intermediate_size=192)
    folder = tmp_path / "tiny"
    write_synthetic_folder(folder, config, device="cpu")
    synthetic_word_tokenizer(folder, config.vocab_size)
    written = long_context.file_bytes(folder)
    predicted = long_context.folder_bytes(config)
    assert written <= predicted <= written + long_context.FILE_ALLOWANCE + 24 * config.vocab_size
    big = long_context.benchmark_config("deepseek-v3", 3, 1)
    one_more_moe = long_context.benchmark_config("deepseek-v3", 4, 1)
    for size in (long_context.folder_bytes, long_context.gguf_bytes):
        assert size(one_more_moe) - size(big) == pytest.approx(256 * 3 * 7168 * 2048 * 2 + 0.4e9, rel=0.01)
    assert long_context.colibri_kv_bytes_per_token(big, "bf16") == 3 * 576 * 2
    assert long_context.llama_kv_bytes_per_token(big, "f16") == 3 * 576 * 2
    assert long_context.llama_kv_bytes_per_token(big, "q8_0") == 3 * 18 * 34  # blocks of 32 values in 34 bytes
    assert long_context.colibri_kv_bytes_per_token(big, "fp8") == 3 * 576
    mixtral = long_context.benchmark_config("mixtral-8x7b", 2)
    assert long_context.llama_kv_bytes_per_token(mixtral, "f16") == 2 * 2 * 8 * 128 * 2  # keys and values
    assert long_context.colibri_kv_bytes_per_token(mixtral, "bf16") == 2 * 2 * 8 * 128 * 2


def test_long_context_mxfp4_experts(benchmark_modules, tmp_path):
    """--expert-dtype mxfp4: a folder of its own name, with mxfp4 experts (as written), whose bytes folder_bytes
    predicts; gpt-oss-20b's 24 layers are 13.8 GB in the GGUF (bf16: 41.4 GB), and the roofline counts an expert
    at 17 bytes a 32 weights."""
    long_context, _ = benchmark_modules
    root = tmp_path / "models"
    assert long_context.folder_path("gpt-oss-20b", 24, None, root, "mxfp4") == \
        root / "gpt-oss-20b-24-layers-yarn-truncate-mxfp4"
    small = dataclasses.replace(long_context.benchmark_config("gpt-oss-20b", 2), vocab_size=512, hidden_size=64,
                                num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2,
                                moe_intermediate_size=96)
    folder = tmp_path / "tiny"
    write_synthetic_folder(folder, small, device="cpu", expert_dtype="mxfp4")
    synthetic_word_tokenizer(folder, small.vocab_size)
    config = ModelFolder(folder).config
    assert config.expert_dtype == "mxfp4"
    written = long_context.file_bytes(folder)
    assert written <= long_context.folder_bytes(config) <= written + long_context.FILE_ALLOWANCE + 24 * 512
    big = long_context.benchmark_config("gpt-oss-20b", 24, expert_dtype="mxfp4")
    assert big.expert_dtype == "mxfp4" and big.rope.truncate
    assert long_context.gguf_bytes(big) == pytest.approx(13.8e9, rel=0.02)
    assert long_context.gguf_bytes(long_context.benchmark_config("gpt-oss-20b", 24)) == pytest.approx(41.4e9, rel=0.02)
    h, i = big.hidden_size, big.moe_intermediate_size
    assert long_context.expert_matrix_bytes(big) == 3 * h * i * 17 // 32


def synthetic_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """The word-level tokenizer files long_context.py writes beside a synthetic folder."""
    with imported_benchmarks("serving_gpu") as (serving_gpu,):
        serving_gpu.word_tokenizer_files(folder, vocab_size)


class FakeDisks:
    """shutil.disk_usage and long_context.filesystem over named filesystems: a path's filesystem is its first
    component (/disk, /shm), its free bytes given."""

    def __init__(self, free: dict[str, int]):
        self.free = free

    def filesystem(self, path: Path) -> tuple[int, Path]:
        root = Path("/", path.parts[1])
        return list(self.free).index(str(root)), root

    def disk_usage(self, path):
        return type("usage", (), {"free": self.free[str(path)]})()


@pytest.fixture
def fake_disks(benchmark_modules, monkeypatch):
    """Two filesystems of 60 GB (/disk) and 55 GB (/shm) free for long_context's room checks."""
    long_context, _ = benchmark_modules
    disks = FakeDisks({"/disk": 60 * 10**9, "/shm": 55 * 10**9})
    monkeypatch.setattr(long_context, "filesystem", disks.filesystem)
    monkeypatch.setattr(long_context.shutil, "disk_usage", disks.disk_usage)
    return long_context


def test_long_context_refuses_files_that_would_not_fit(fake_disks):
    """DeepSeek-V3 of 1 dense + 2 MoE layers (51 GB a file): both on one 60 GB disk are refused before anything
    is written, in one line naming what lands where; the GGUF file on another filesystem fits; a file written
    already takes no room; 1 dense + 3 MoE layers (74 GB) fits nowhere."""
    long_context = fake_disks
    disk, shm = Path("/disk/models"), Path("/shm/models")

    def refusal(spec: str, gguf_root: Path | None, kept: bool = False) -> str | None:
        return long_context.plan_files([spec], disk, gguf_root, with_gguf=True, kept=kept)

    line = refusal("deepseek-v3:3:1", None)
    assert line.startswith("refused") and "\n" not in line
    assert "/disk has 60.0 GB free, 101.8 GB to write" in line
    assert refusal("deepseek-v3:3:1", shm) is None
    assert "/disk has 60.0 GB free, 73.9 GB" in refusal("deepseek-v3:4:1", shm)
    files = long_context.shape_files("deepseek-v3:3:1", disk, None, with_gguf=True)
    assert [f.what for f in files] == ["folder", "GGUF"] and not any(f.present for f in files)
    assert files[1].path == disk / "deepseek-v3-3-layers-1-dense.gguf"
    present = [dataclasses.replace(files[0], present=True), files[1]]
    assert long_context.room_refusal(present) is None
    # shapes run one after another fit alone; kept, they are summed
    both = ["mixtral-8x7b:8", "qwen3-30b-a3b:16"]  # 47.5 and 42.4 GB, folder and GGUF
    assert long_context.plan_files(both, disk, None, True, kept=False) is None
    assert "89.9 GB to write" in long_context.plan_files(both, disk, None, True, kept=True)
    # without llama.cpp only the folder counts
    assert long_context.plan_files(["deepseek-v3:3:1"], disk, None, with_gguf=False, kept=False) is None
