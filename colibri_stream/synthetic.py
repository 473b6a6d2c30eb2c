"""Random-weight models of real shapes, built in the backend's memory (no files) through the normal loading path.

`synthetic_model("mixtral-8x7b", num_layers=4, device="cuda")` takes the dimensions of a published model (fewer
layers if asked), and gives `MoETransformer` a dense-tensor source and an expert store that draw random weights on
the backend (`Backend.random_weight`: on the GPU for CuPy) instead of reading a model folder; everything after that
(prepare_weight, prepare_experts, the forward) is the code real weights go through. Matrices are N(0, 1/fan_in),
so activations keep unit scale; the router is random too, so routing is close to uniform, unlike a trained model.

`write_synthetic_folder(path, "mixtral-8x7b", num_layers=8)` writes the same kind of model as a native model folder
(config.json, dense.safetensors, experts.bin; no tokenizer files), for benchmarks that read experts from disk.
Both draw from one recipe (`dense_draws`, `expert_draws`: shape, std, seed and dtype of every tensor), biases,
attention sinks and biased experts' biases (gpt-oss) included: small random values, never zeros.
`write_synthetic_folder(path, "mixtral-8x7b", 8, expert_dtype="int4")` writes the same model with quantized experts
(int8, int4, fp8 or mxfp4, expert_codecs.py): each expert drawn as the bf16 folder's, then quantized from those bf16
values, so the bf16 and the quantized folders of one shape and seed hold the same weights up to the format's
rounding.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .backends.base import Array, Backend
from .checkpoint import (CONFIG_FILE, NUMPY_DTYPES, DenseFileWriter, ExpertFileWriter, dense_tensor_dtype,
                         dense_tensor_specs, expert_block_layout, write_config)
from .config import ModelConfig, RopeConfig
from .expert_codecs import EXPERT_BIASES, FP8_BLOCK, ExpertCodec, PlainCodec, expert_codec
from .experts.store import ExpertStore
from .loader import select_backend
from .model.transformer import MoETransformer

# Dimensions of published checkpoints (their config.json), as ModelConfig fields.
_GPT_OSS = dict(architecture="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
                num_kv_heads=8, head_dim=64, num_experts=32, top_k=4, moe_intermediate_size=2880,
                norm_topk_prob=True, router_bias=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                qkv_bias=True, o_bias=True, attention_sinks=True, window_pattern=(128, None),
                rope=RopeConfig(type="yarn", theta=150000.0, factor=32.0, original_max_position_embeddings=4096,
                                beta_fast=32.0, beta_slow=1.0, truncate=False),
                rms_norm_eps=1e-5, max_position_embeddings=131072)  # gpt-oss-20b; 120b differs in layers and experts

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
    "glm-4.5-air": dict(architecture="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
                        num_kv_heads=8, head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=1408,
                        first_dense_layers=1, intermediate_size=10944, shared_expert_intermediate_size=1408,
                        router_scoring="sigmoid", score_correction_bias=True, n_group=1, topk_group=1,
                        routed_scaling_factor=1.0, norm_topk_prob=True, qkv_bias=True, rotary_dim=64,
                        rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5, max_position_embeddings=131072),
    "minimax-m2": dict(architecture="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=62, num_heads=48,
                       num_kv_heads=8, head_dim=128, num_experts=256, top_k=8, moe_intermediate_size=1536,
                       router_scoring="sigmoid", score_correction_bias=True, norm_topk_prob=True, qk_norm="full",
                       rotary_dim=64, rope=RopeConfig(theta=5e6), rms_norm_eps=1e-6,
                       max_position_embeddings=196608),
    # (Kimi K2 is this architecture with 384 experts, 64 heads, n_group 1)
    "deepseek-v3": dict(architecture="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61,
                        num_heads=128, num_kv_heads=128, head_dim=192, num_experts=256, top_k=8,
                        moe_intermediate_size=2048, first_dense_layers=3, intermediate_size=18432,
                        shared_expert_intermediate_size=2048, router_scoring="sigmoid", score_correction_bias=True,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5, attention="mla", q_lora_rank=1536,
                        kv_lora_rank=512, v_head_dim=128, rotary_dim=64, rope_interleave=True,
                        softmax_scale=192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2,  # YaRN's mscale_all_dim, squared
                        rope=RopeConfig(type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                        max_position_embeddings=163840),
    # gpt-oss: sliding windows of 128 tokens at even layers (window_pattern, repeated), full attention at odd ones
    "gpt-oss-20b": _GPT_OSS,
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128),
}


def shape_config(name: str, num_layers: int | None = None, dtype: str = "bfloat16",
                 yarn_truncate: bool | None = None) -> ModelConfig:
    """The ModelConfig of a named shape (SHAPES), optionally with fewer layers: every layer MoE but the shape's
    `first_dense_layers` leading ones (GLM-4.5's first_k_dense_replace), which are dense MLPs; each layer's attention
    window from the shape's `window_pattern` repeated over the layers (None: full attention; the default).

    `yarn_truncate` sets a YaRN shape's `truncate` (None: the shape's own): True gives gpt-oss the rounded
    correction range llama.cpp computes (its published config has truncate false), for the llama.cpp comparison;
    a few rotary frequencies move, the work is the same."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    if yarn_truncate is not None:
        fields["rope"] = _with_yarn_truncate(name, fields["rope"], yarn_truncate)
    layers = num_layers or fields["num_layers"]
    fields["num_layers"] = layers
    first_moe = min(fields.pop("first_dense_layers", 0), layers)
    pattern = fields.pop("window_pattern", (None,))
    return ModelConfig(**fields, moe_layers=tuple(range(first_moe, layers)),
                       sliding_windows=tuple(pattern[layer % len(pattern)] for layer in range(layers)),
                       dtype=dtype, expert_dtype=dtype)


def _with_yarn_truncate(name: str, rope: RopeConfig, truncate: bool) -> RopeConfig:
    """`rope` (shape `name`'s) with YaRN's `truncate` set; a shape of another rope has no such option."""
    if rope.type != "yarn":
        raise ValueError(f"shape {name!r} has {rope.type} rope, not yarn: yarn_truncate does not apply")
    return dataclasses.replace(rope, truncate=truncate)


@dataclasses.dataclass(frozen=True)
class WeightDraw:
    """One synthetic tensor: Normal(0, std) values of `shape` drawn from `seed`, in storage `dtype`, plus `shift`
    (added in float32: `draw_on` returns float32 for a shifted draw, as `dense_draws` makes them)."""

    shape: tuple[int, ...]
    std: float
    seed: int
    dtype: str
    shift: float = 0.0


# Spread of a synthetic router's score correction bias: half the spread of its sigmoid scores (about 0.2 for the
# unit-scale logits of a random router), so the bias changes which experts are chosen for many tokens.
CORRECTION_BIAS_STD = 0.1
# Spread of every bias but the correction bias, attention sinks and routed experts' biases included (float32).
BIAS_STD = 0.02
# Added to the seeds of a biased expert's gate, up and down matrices: the seeds of its biases, apart from every
# matrix's seed (of any layer, expert and model seed below about 5e9), and below 2**63 (CuPy's seeds are 64-bit).
EXPERT_BIAS_SEEDS = 1 << 60


def _vector_std(name: str) -> float:
    """The spread of a 1-D dense tensor's draw: norm weights 0.1 (about 1), correction biases CORRECTION_BIAS_STD,
    other biases and attention sinks BIAS_STD."""
    if name.endswith("norm"):
        return 0.1
    return CORRECTION_BIAS_STD if name.endswith("score_correction_bias") else BIAS_STD


def dense_draws(config: ModelConfig, seed: int = 0) -> dict[str, WeightDraw]:
    """The draw of every dense tensor (`dense_tensor_specs` order). Norm weights are 1 + N(0, 0.1), a router's
    score correction bias N(0, CORRECTION_BIAS_STD), other biases (q/k/v, o, the router's) and attention sinks
    N(0, BIAS_STD), all float32; the embedding is N(0, 1), other matrices N(0, 1/fan_in), in `config.dtype`."""
    draws = {}
    for order, (name, shape) in enumerate(dense_tensor_specs(config).items()):
        tensor_seed = seed * 1_000_003 + order
        if len(shape) == 1:
            shift = 1.0 if name.endswith("norm") else 0.0
            draws[name] = WeightDraw(shape, _vector_std(name), tensor_seed, "float32", shift)
        else:
            std = 1.0 if name == "embed_tokens" else shape[1] ** -0.5
            draws[name] = WeightDraw(shape, std, tensor_seed, config.dtype)
    return draws


def expert_draws(config: ModelConfig, layer: int, expert: int, seed: int = 0) -> dict[str, WeightDraw]:
    """The draws of one routed expert's gate [I, H], up [I, H] and down [H, I] (N(0, 1/fan_in), expert_dtype), then,
    for biased experts (config.expert_bias: gpt-oss), its gate_bias [I], up_bias [I] and down_bias [H]
    (`expert_bias_draws`)."""
    if config.expert_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"synthetic experts are float32, bfloat16 or float16, not {config.expert_dtype}")
    h, i = config.hidden_size, config.moe_intermediate_size
    tensor_seed = ((seed * 1009 + layer) * 65_537 + expert) * 3 + 7_000_000_007
    dtype = config.expert_dtype
    draws = {"gate": WeightDraw((i, h), h**-0.5, tensor_seed, dtype),
             "up": WeightDraw((i, h), h**-0.5, tensor_seed + 1, dtype),
             "down": WeightDraw((h, i), i**-0.5, tensor_seed + 2, dtype)}
    if config.expert_bias:
        draws.update(expert_bias_draws(h, i, tensor_seed + EXPERT_BIAS_SEEDS))
    return draws


def expert_bias_draws(hidden: int, inter: int, first_seed: int) -> dict[str, WeightDraw]:
    """The draws of a biased expert's biases, N(0, BIAS_STD) float32 (as the expert block stores them): gate_bias
    [I], up_bias [I] and down_bias [H], seeded `first_seed`, + 1 and + 2 (EXPERT_BIASES order)."""
    widths = {"gate_bias": inter, "up_bias": inter, "down_bias": hidden}
    return {name: WeightDraw((widths[name],), BIAS_STD, first_seed + order, "float32")
            for order, name in enumerate(EXPERT_BIASES)}


def draw_on(backend: Backend, draw: WeightDraw) -> Array:
    """The tensor of `draw` on the backend (`Backend.random_weight`, then the shift)."""
    values = backend.random_weight(draw.shape, draw.std, draw.seed, draw.dtype)
    return values + np.float32(draw.shift) if draw.shift else values


class RandomDense:
    """Stands in for DenseFile: the tensor names and shapes of `dense_tensor_specs`, values from `dense_draws`."""

    def __init__(self, config: ModelConfig, backend: Backend, seed: int = 0):
        self.config, self.backend, self.seed = config, backend, seed
        self.draws = dense_draws(config, seed)
        self.names = list(self.draws)

    def get(self, name: str) -> Array:
        return draw_on(self.backend, self.draws[name])


class RandomExpertStore(ExpertStore):
    """Routed experts drawn at random (`expert_draws`), the same tensors on every call (seeded by layer and
    expert); the arrays are the backend's (device arrays for CuPy, which `prepare_experts` stacks on the device)."""

    def __init__(self, config: ModelConfig, backend: Backend, seed: int = 0):
        expert_draws(config, 0, 0)  # refuses expert dtypes that cannot be drawn
        self.config, self.backend, self.seed = config, backend, seed

    def expert(self, layer: int, expert: int) -> dict[str, Array]:
        return {name: draw_on(self.backend, draw)
                for name, draw in expert_draws(self.config, layer, expert, self.seed).items()}


def synthetic_model(shape: str | ModelConfig, num_layers: int | None = None, device: str = "auto",
                    seed: int = 0, matmul_precision: str = "high") -> MoETransformer:
    """A random-weight model on `device` (auto, cpu, cuda; on the GPU at `matmul_precision`, EngineConfig's): a
    named shape with `num_layers` layers (None: all of them), or exactly the given config."""
    config = shape if isinstance(shape, ModelConfig) else shape_config(shape, num_layers)
    backend = select_backend(device, matmul_precision=matmul_precision)
    return MoETransformer(config, RandomDense(config, backend, seed), RandomExpertStore(config, backend, seed),
                          backend)


# ----------------------------------------------------------------------------------------------------------------
# A synthetic model folder
# ----------------------------------------------------------------------------------------------------------------

POOL_VALUES = 1 << 20  # CPU: tensors larger than this are built from windows of a pool of this many values
POOL_WINDOW = 1024  # values per window


def pooled_normal(draw: WeightDraw) -> np.ndarray:
    """A host tensor for `draw` that is cheap to make at any size (CPU, no GPU): at most POOL_VALUES values are
    drawn exactly as `Backend.random_weight` draws them; a larger tensor is filled window by window (POOL_WINDOW
    values each, so a row of a matrix spans several windows) with slices of a pool of POOL_VALUES such values,
    each at a random offset drawn from the same seed. Every value is an N(0, std) draw in the storage dtype, but
    windows repeat values of the pool at random shifts: fine for timing, not for statistics across windows.

    Much faster than drawing every value, so a benchmark's model of real size is made in seconds on one core.
    """
    from .backends.numpy_backend import NumpyBackend

    size = int(np.prod(draw.shape))
    pool = draw_on(NumpyBackend(), dataclasses.replace(draw, shape=(min(size, POOL_VALUES),)))
    pool = pool.astype(NUMPY_DTYPES[draw.dtype], copy=False)  # a shift is added in float32
    if size <= POOL_VALUES:
        return pool.reshape(draw.shape)
    width = POOL_WINDOW
    offsets = np.random.default_rng([draw.seed, 1]).integers(0, POOL_VALUES - width + 1, -(-size // width))
    bits = np.dtype(f"u{pool.itemsize}")  # fancy indexing on plain integers of the same bits
    windows = sliding_window_view(pool.view(bits), width)[offsets]  # [windows, width], a fresh contiguous array
    return windows.reshape(-1)[:size].view(pool.dtype).reshape(draw.shape)


class _HostDraws:
    """Makes host (NumPy) tensors of draws: on the GPU through `CupyBackend.random_weight` (the values
    `synthetic_model(device="cuda")` holds) copied back, else `pooled_normal`."""

    def __init__(self, device: str):
        from .backends.cupy_backend import cuda_available

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}: use auto, cpu or cuda")
        if device == "cuda" and not cuda_available():
            raise ValueError("no CUDA GPU is usable (CuPy is missing or finds no device)")
        self.gpu = None
        if device == "cuda" or (device == "auto" and cuda_available()):
            from .backends.cupy_backend import CupyBackend

            self.gpu = CupyBackend()

    def __call__(self, draw: WeightDraw, dtype: str | None = None) -> np.ndarray:
        """The tensor of `draw` on the host, converted to `dtype` if given (norm weights stored as bf16)."""
        if self.gpu is None:
            values = pooled_normal(draw)
        else:
            values = self.gpu.to_host(draw_on(self.gpu, draw))
            values = values.view(NUMPY_DTYPES[draw.dtype])  # bfloat16 comes back as its uint16 bits
        return values if dtype is None or dtype == draw.dtype else values.astype(NUMPY_DTYPES[dtype])

    def release(self) -> None:
        if self.gpu is not None:
            self.gpu.cp.get_default_memory_pool().free_all_blocks()
            self.gpu.cp.get_default_pinned_memory_pool().free_all_blocks()


def _one_ahead(jobs: Iterable[Callable[[], dict]]) -> Iterator[dict]:
    """The results of `jobs` in order, each made on a worker thread while the caller consumes the one before
    (NumPy, CuPy, zlib and file writes release the GIL, so drawing overlaps with writing)."""
    with ThreadPoolExecutor(1) as worker:
        pending = None
        for job in jobs:
            following = worker.submit(job)
            if pending is not None:
                result = pending.result()
                pending = following
                yield result
                del result
            else:
                pending = following
        if pending is not None:
            yield pending.result()


QUANTIZED_FROM = "bfloat16"  # quantized experts are drawn in this dtype (the bf16 folder's values), then quantized
QUANTIZE_ROWS = 512  # rows of one quantizing task: a multiple of FP8_BLOCK, the most rows any codec's scale spans


def with_expert_format(config: ModelConfig, expert_dtype: str, group_size: int = 128, zero_point: bool = False,
                       scales: str = "block") -> ModelConfig:
    """`config` with its routed experts stored as `expert_dtype`, with the parameters that format takes: int4's
    `group_size` and `zero_point`, fp8's `scales` ("block" or "channel"); the other formats' fields cleared."""
    int4, fp8 = expert_dtype == "int4", expert_dtype == "fp8"
    return dataclasses.replace(config, expert_dtype=expert_dtype, expert_group_size=group_size if int4 else 0,
                               expert_zero_point=zero_point if int4 else False, expert_scales=scales if fp8 else "")


def quantize_expert(codec: ExpertCodec, matrices: dict[str, np.ndarray], pool: ThreadPoolExecutor,
                    rows: int = QUANTIZE_ROWS) -> dict[str, np.ndarray]:
    """An expert's gate, up and down (any float dtype) -> its block tensors by name in `codec`'s format, every matrix
    quantized in chunks of `rows` rows on `pool`'s threads (NumPy releases the GIL in its array operations).

    Equal to `codec.quantize_matrix` of each whole matrix: every codec's scales cover one row or one FP8_BLOCK-row
    tile, so chunks of a multiple of FP8_BLOCK rows quantize independently and their tensors stack along rows."""
    if rows % FP8_BLOCK:
        raise ValueError(f"quantizing chunks must be a multiple of {FP8_BLOCK} rows, not {rows}")

    def chunk(name: str, values: np.ndarray) -> dict[str, np.ndarray]:
        return codec.quantize_matrix(name, values.astype(np.float32))  # [rows, in] -> its tensors of those rows

    futures = {name: [pool.submit(chunk, name, matrix[start:start + rows]) for start in range(0, len(matrix), rows)]
               for name, matrix in matrices.items()}
    tensors = {}
    for name, pending in futures.items():
        parts = [future.result() for future in pending]
        for key in parts[0]:
            tensors[key] = parts[0][key] if len(parts) == 1 else np.concatenate([part[key] for part in parts])
    return tensors


def quantize_matrices(codec: ExpertCodec, tensors: dict[str, np.ndarray],
                      pool: ThreadPoolExecutor) -> dict[str, np.ndarray]:
    """An expert's drawn tensors in `codec`'s format: its gate, up and down quantized (`quantize_expert`, chunks of
    QUANTIZE_ROWS rows), its biases (if any) as drawn, float32 in every format."""
    biases = {name: tensors[name] for name in EXPERT_BIASES if name in tensors}
    matrices = {name: array for name, array in tensors.items() if name not in biases}
    return {**quantize_expert(codec, matrices, pool, QUANTIZE_ROWS), **biases}


def write_synthetic_folder(path: str | os.PathLike, shape: str | ModelConfig, num_layers: int | None = None,
                           seed: int = 0, expert_dtype: str = "bfloat16", device: str = "auto",
                           group_size: int = 128, zero_point: bool = False, scales: str = "block") -> ModelConfig:
    """Write a native model folder (config.json, dense.safetensors, experts.bin, as `colibri export` writes them;
    no tokenizer files) of random weights: a named shape (SHAPES) with `num_layers` layers (None: all), or exactly
    the given config; experts stored as `expert_dtype`: float32, bfloat16 or float16 as drawn, or quantized (int8,
    int4 with groups of `group_size` input channels and, with `zero_point`, zero points, fp8 with `scales` "block"
    or "channel", mxfp4: `with_expert_format`). Returns the config.

    Values follow `dense_draws` / `expert_draws` (the recipe of `synthetic_model`), biased experts' biases (gpt-oss)
    included. With a GPU (device auto or cuda) every tensor is drawn on it, so the files hold
    `synthetic_model(device="cuda")`'s matrices exactly and writing is bound by the disk; on the CPU tensors come
    from `pooled_normal`. Dense tensors are all stored in `config.dtype` (norm weights rounded to it). A quantized
    expert is drawn in bfloat16 (QUANTIZED_FROM: the bf16 folder's values, so both folders hold the same weights up
    to the format's rounding) and quantized by its codec (round to nearest, expert_codecs.py) in row chunks on a
    pool of os.cpu_count() threads, its biases kept float32 as drawn. Tensors are made one expert at a time, the
    next expert (drawn, and quantized) while the one before is written, so memory peaks at about two experts (plus
    the largest dense tensor). config.json is written last: a folder whose writing failed does not open. Writing and
    CRC32 bound it on a GPU host (the draws run on the GPU), the page cache's writeback on a small VM, and quantizing
    (all cores) a quantized folder.
    """
    if isinstance(shape, ModelConfig):
        if num_layers is not None:
            raise ValueError("num_layers applies to a named shape, not to a given ModelConfig")
        config = shape
    else:
        config = shape_config(shape, num_layers)
    config = with_expert_format(config, expert_dtype, group_size, zero_point, scales)
    codec = expert_codec(config)
    quantized = not isinstance(codec, PlainCodec)
    drawn = with_expert_format(config, QUANTIZED_FROM) if quantized else config  # the experts' draws
    expert_draws(drawn, 0, 0, seed)  # refuses an expert dtype that cannot be drawn
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    draws = dense_draws(config, seed)
    dense_bytes = sum(int(np.prod(d.shape)) * NUMPY_DTYPES[config.dtype].itemsize for d in draws.values())
    expert_bytes = len(config.moe_layers) * config.num_experts * expert_block_layout(config)[1]
    free = shutil.disk_usage(folder).free
    if dense_bytes + expert_bytes > free:
        raise OSError(f"{folder}: {(dense_bytes + expert_bytes) / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")
    (folder / CONFIG_FILE).unlink(missing_ok=True)
    host = _HostDraws(device)
    pool = ThreadPoolExecutor(os.cpu_count() or 1) if quantized else None
    try:
        dense = DenseFileWriter(folder / config.dense_file,
                                {name: (d.shape, dense_tensor_dtype(name, config)) for name, d in draws.items()})
        for name, draw in draws.items():
            dense.write(name, host(draw, dense_tensor_dtype(name, config)))
        dense.close()
        experts = [(layer, expert) for layer in config.moe_layers for expert in range(config.num_experts)]

        def make(layer: int, expert: int) -> dict[str, np.ndarray]:
            tensors = {name: host(d) for name, d in expert_draws(drawn, layer, expert, seed).items()}
            return quantize_matrices(codec, tensors, pool) if quantized else tensors

        jobs = ((lambda layer=layer, expert=expert: make(layer, expert)) for layer, expert in experts)
        with ExpertFileWriter(folder / config.experts_file, config) as writer:
            for (layer, expert), tensors in zip(experts, _one_ahead(jobs)):
                writer.write_expert(layer, expert, tensors)
                del tensors
    finally:
        host.release()
        if pool is not None:
            pool.shutdown()
    write_config(folder, config)
    return config
