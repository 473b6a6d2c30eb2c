"""Long prompts and long conversations: Colibri's engine against llama.cpp on the same weights, same GPU, one run.

For each shape (`--shapes SHAPE:LAYERS`, random bf16 weights of the published dimensions, written once under
`--folder-root` with a word-level tokenizer, and as GGUF beside it for llama.cpp), each KV cache dtype
(`--kv-dtypes`), each of Colibri's matmul precisions (`--matmul-precisions`: medium, the engine's default, bf16
activations into tensor-core products as llama.cpp computes them, and high, two bf16 parts; llama.cpp runs once),
each step token budget (`--max-num-batched-tokens`), each context C (`--contexts`) and batch B (`--batches`):

  colibri_prefill_tok_s  B requests of C random prompt tokens each added to `EngineCore` at once (chunked prefill
                         with the engine's default token budget, as `colibri serve` runs it): B * C over the wall
                         time until every request has its first token
  ttft_s                 that wall time (batch 1: the time to the first token of one C-token prompt)
  colibri_decode_tok_s   then `--decode-tokens` - 1 more steps, every one a pure decode step of all B requests
                         (an early request decodes while the others prefill, so none is near its end): their
                         tokens over their wall time
  llama_prefill_tok_s, llama_decode_tok_s  llama-batched-bench (flash attention on, whole model on the GPU) with
                         -npp C -ntg decode_tokens -npl B: its speed_pp and speed_tg. Its KV cache is f16 for
                         Colibri's bf16 and fp16 (the same bytes), q8_0 for fp8, f32 for fp32.
  roofline_decode_tok_s  B over the seconds one decode step must take at least: the bytes it reads (every dense
                         weight, the lm_head, the experts the batch touches under uniform routing, and the KV cache
                         of B sequences of C tokens at the dtype's size) over the device-to-device copy
                         bandwidth measured in this run (bytes read plus written, as decode.py counts it)

With `--phases`, the engine's step timer is on during each case (timing.py's phases: attention, routing,
experts, sample ...) and the record adds `prefill_phase_seconds`: each phase's seconds summed over the steps
that computed prompt tokens, beside their wall time (`prefill_step_seconds`); a diagnostic run, since the timer's
events add a little to each step.

`--expert-dtype mxfp4` stores the routed experts as mxfp4 (gpt-oss's format) in the folder, and the GGUF file
holds the same codes as llama.cpp's MXFP4 (gguf_writer); the roofline counts the experts at their bytes.

A shape whose published rope llama.cpp does not compute (gpt-oss: YaRN with truncate off, which
`gguf_writer.write_gguf` refuses, since llama.cpp always rounds YaRN's correction range to whole dimensions) is
written with truncate on (`needs_yarn_truncate`, `shape_folder`), and both engines run that model: it moves a few
rotary frequencies, not any cost.

An entry SHAPE:LAYERS:DENSE names the split: DENSE leading dense layers, the others MoE, in place of the shape's
own (`benchmark_config`; DeepSeek-V3's 3 leading dense layers would leave no MoE layer in a 3-layer cut), in a
folder of its own name (`folder_path`). `--gguf-root` puts the GGUF files on another folder, such as /dev/shm where
the disk cannot hold both copies. Before writing anything, each file's bytes are predicted (`folder_bytes`,
`gguf_bytes`) and printed with where it goes and that filesystem's free space, and the run is refused in one line
when the files still to write would not fit (`plan_files`: every shape's files summed where they are kept, with
`--write-only` or `--keep-models`, else each shape's alone, since its files are removed before the next one's).
Each record names its split (`dense_layers`, `moe_layers`, `shape_spec`), its files and their bytes
(`model_folder`, `gguf_file`), and one token's KV cache bytes over all layers, Colibri's
(`colibri_kv_bytes_per_token`: 576 values a layer for DeepSeek-V3's latent cache) and llama.cpp's at the cache
type it ran (`llama_kv_bytes_per_token`: deepseek2 caches the same one row, q8_0 in blocks of 32 values in 34
bytes). A latent-attention model's roofline counts its own projections and latent cache (`decode_step_bytes`).
DeepSeek-V3 on a 64 GB disk (51 GB a copy of 1 dense + 2 MoE layers):

    python benchmarks/long_context.py --shapes deepseek-v3:3:1 --gguf-root /dev/shm/colibri-long-context \
        --batches 1 16 64 --batched-bench /tmp/llama-build/bin/llama-batched-bench --gguf-py <llama.cpp>/gguf-py

A case whose predicted Colibri prefill (from the same shape's batch-1 rate) exceeds `--max-case-seconds` is
recorded as skipped. Records (`bench: "long_context"`) go to `--out`; the Markdown table is printed.

    python benchmarks/long_context.py --batched-bench /tmp/llama-build/bin/llama-batched-bench \
        --gguf-py <llama.cpp>/gguf-py --out benchmarks/results/long_context_h200.json

`--write-only` writes each shape's folder and GGUF and stops (no GPU needed: drawn on the GPU where CuPy finds
one, else on the CPU), for a later run to time:

    python benchmarks/long_context.py --shapes gpt-oss-20b:4 --write-only --gguf-py <llama.cpp>/gguf-py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from conditions import machine as host_machine
from conditions import require_gpu
from serving_gpu import model_folder, word_tokenizer_files

DEFAULT_SHAPES = ("mixtral-8x7b:8", "qwen3-30b-a3b:16")
LLAMA_KV_TYPES = {"bf16": "f16", "fp16": "f16", "fp8": "q8_0", "fp32": "f32"}
KV_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}  # bytes a cached key or value element takes
PREFILL_BUDGET = 2048  # the engine's default token budget a step: prefill steps of B * C prompt tokens
# prompt tokens of each warm-up request (at most the longest context): kernels compiled, each batch's decode graph
# captured, and a whole prefill chunk run, so its transients are in the memory pool and its GEMMs' kernels loaded
# before anything is timed (as in a server that has answered a few prompts)
WARM_UP_TOKENS = PREFILL_BUDGET
FIRST_PROMPT_ID = 16  # prompt ids are drawn from [FIRST_PROMPT_ID, vocab), past small vocabularies' special tokens


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def needs_yarn_truncate(shape: str) -> bool:
    """Whether `shape` (a SHAPES name) has YaRN with truncate off (gpt-oss's published rope), which llama.cpp does
    not compute: the benchmark's model of such a shape has truncate on."""
    from colibri_stream.synthetic import SHAPES

    rope = SHAPES[shape]["rope"] if shape in SHAPES else None
    return rope is not None and rope.type == "yarn" and not rope.truncate


def benchmark_config(shape: str, layers: int, dense_layers: int | None = None, expert_dtype: str = "bfloat16"):
    """The ModelConfig of the model of a `--shapes` entry: the shape's with `layers` layers, YaRN's truncate on
    where it `needs_yarn_truncate`, with `dense_layers` given, that many leading dense layers (the rest MoE) in
    place of the shape's own `first_dense_layers`, and its routed experts stored as `expert_dtype`."""
    from colibri_stream.synthetic import shape_config, with_expert_format

    config = shape_config(shape, layers, yarn_truncate=True if needs_yarn_truncate(shape) else None)
    if expert_dtype != "bfloat16":
        config = with_expert_format(config, expert_dtype)
    if dense_layers is None:
        return config
    if not 0 <= dense_layers <= layers:
        raise ValueError(f"{shape}: {dense_layers} dense layers of {layers}")
    if dense_layers and not config.intermediate_size:
        raise ValueError(f"{shape} has no dense MLP width (intermediate_size): it has no dense layers to lead with")
    return dataclasses.replace(config, moe_layers=tuple(range(dense_layers, layers)))


def folder_path(shape: str, layers: int, dense_layers: int | None, root: Path, expert_dtype: str = "bfloat16") -> Path:
    """Where the model folder of a `--shapes` entry is written: serving_gpu.model_folder's name
    (SHAPE-LAYERS-layers), with -yarn-truncate for a shape that `needs_yarn_truncate`, -DENSE-dense for an entry
    that names its dense layers and -EXPERT_DTYPE for experts other than bf16."""
    name = f"{shape}-{layers}-layers"
    if needs_yarn_truncate(shape):
        name += "-yarn-truncate"
    if dense_layers is not None:
        name += f"-{dense_layers}-dense"
    if expert_dtype != "bfloat16":
        name += f"-{expert_dtype}"
    return root / name


def folder_is_written(folder: Path) -> bool:
    """Whether a model folder holds what the benchmark reads (config.json, written last, and tokenizer.json)."""
    from colibri_stream.checkpoint import CONFIG_FILE

    return (folder / CONFIG_FILE).is_file() and (folder / "tokenizer.json").is_file()


def shape_folder(shape: str, layers: int, root: Path, device: str, dense_layers: int | None = None,
                 expert_dtype: str = "bfloat16") -> tuple[Path, str]:
    """(folder, description) of the model of a `--shapes` entry, written under `root` if absent (drawn on
    `device`, with a word-level tokenizer; experts stored as `expert_dtype`): serving_gpu.model_folder's, but for a
    shape that `needs_yarn_truncate` (whose folder has YaRN's truncate on), an entry naming its `dense_layers` or
    experts other than bf16, a folder of its own (`folder_path`, `benchmark_config`)."""
    from colibri_stream.synthetic import write_synthetic_folder

    if not needs_yarn_truncate(shape) and dense_layers is None and expert_dtype == "bfloat16":
        return model_folder(shape, layers, root, device)
    folder = folder_path(shape, layers, dense_layers, root, expert_dtype)
    config = benchmark_config(shape, layers, dense_layers)
    split = f"{layers} layers" if dense_layers is None else layer_split(config)
    if not folder_is_written(folder):
        log(f"writing a random {shape} model of {split} to {folder}")
        write_synthetic_folder(folder, config, device=device, expert_dtype=expert_dtype)
        word_tokenizer_files(folder, config.vocab_size)
        os.sync()  # the page cache's write-back must not run beside the timed runs
    yarn = " with YaRN's truncate on (as llama.cpp computes it)" if needs_yarn_truncate(shape) else ""
    experts = "" if expert_dtype == "bfloat16" else f" ({expert_dtype} experts)"
    return folder, f"{shape} shape{yarn}, {split}, random bf16 weights{experts}, word-level tokenizer"


def layer_split(config) -> str:
    """The layers of a config in words: "3 layers (1 dense + 2 MoE)"."""
    moe = len(config.moe_layers)
    return f"{config.num_layers} layers ({config.num_layers - moe} dense + {moe} MoE)"


def gguf_path(folder: Path, gguf_root: Path | None) -> Path:
    """The GGUF file of a model folder: its name with .gguf added, under `gguf_root` (None: beside the folder)."""
    return (folder.parent if gguf_root is None else gguf_root) / (folder.name + ".gguf")


def gguf_beside(folder: Path, gguf_py: str | None, gguf_root: Path | None = None) -> Path:
    """The GGUF file of a model folder (`gguf_path`: beside it, or under `gguf_root`), written from the folder
    with llama.cpp's gguf-py (`gguf_py`) if absent."""
    gguf = gguf_path(folder, gguf_root)
    if not gguf.is_file():
        from gguf_writer import write_gguf

        if gguf_py is None:
            sys.exit(f"{gguf} is absent: --gguf-py (llama.cpp's gguf-py folder) writes it")

        log(f"writing {gguf}")
        gguf.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(folder, gguf, gguf_py)
        os.sync()
    return gguf


def parse_shape(spec: str) -> tuple[str, int, int | None]:
    """A `--shapes` entry SHAPE:LAYERS or SHAPE:LAYERS:DENSE -> (shape, layers, leading dense layers or None for
    the shape's own)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--shapes entry {spec!r}: SHAPE:LAYERS or SHAPE:LAYERS:DENSE")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None


# ----------------------------------------------------------------------------------------------------------------
# Sizes of the files and of a cached token, before anything is written
# ----------------------------------------------------------------------------------------------------------------

WEIGHT_BYTES = 2  # bf16 matrices, as the folders and GGUF files of this benchmark hold them
TOKENIZER_BYTES_PER_TOKEN = 24  # tokenizer.json of the word-level vocabulary, about 16 bytes a token, with room
GGUF_BYTES_PER_TOKEN = 32  # the GGUF's placeholder vocabulary (a short name, a score and a type), with room
FILE_ALLOWANCE = 1 << 20  # headers, config.json, each tensor's alignment
FREE_MARGIN = 1 << 30  # left free on a filesystem after the files (logs, the page cache's dirty pages)


def folder_bytes(config) -> int:
    """Bytes of the model folder of `config`: dense.safetensors (every dense tensor in config.dtype), experts.bin
    (a block of `expert_block_layout` per routed expert of each MoE layer) and the word-level tokenizer."""
    from colibri_stream.checkpoint import NUMPY_DTYPES, dense_tensor_specs, expert_block_layout

    dense = sum(int(np.prod(shape)) for shape in dense_tensor_specs(config).values())
    experts = len(config.moe_layers) * config.num_experts * expert_block_layout(config)[1]
    return (dense * NUMPY_DTYPES[config.dtype].itemsize + experts + config.vocab_size * TOKENIZER_BYTES_PER_TOKEN
            + FILE_ALLOWANCE)


def expert_matrix_bytes(config) -> int:
    """Bytes of one routed expert's three matrices in its format (bf16; mxfp4: codes and exponent bytes), as the
    folder's blocks (less alignment) and the GGUF file hold them."""
    from colibri_stream.checkpoint import NUMPY_DTYPES
    from colibri_stream.expert_codecs import expert_codec

    tensors = expert_codec(config).expert_tensors(config.hidden_size, config.moe_intermediate_size)
    return sum(int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize for _, dtype, shape in tensors)


def gguf_bytes(config) -> int:
    """Bytes of the GGUF file `gguf_writer.write_gguf` writes of `config`: every dense matrix bf16, every vector
    and the router float32 (a sigmoid router's correction bias too, zeros where the model has none), each MoE
    layer's experts stacked (bf16 or mxfp4 matrices, float32 biases where the model has them), and the placeholder
    vocabulary. A few tensors llama.cpp adds as zeros (gpt-oss's absent biases) are left out: kilobytes."""
    from colibri_stream.checkpoint import dense_tensor_specs

    total = 0
    for name, shape in dense_tensor_specs(config).items():
        float32 = len(shape) == 1 or name.endswith("router")
        total += int(np.prod(shape)) * (4 if float32 else WEIGHT_BYTES)
    h, i = config.hidden_size, config.moe_intermediate_size
    expert = expert_matrix_bytes(config) + ((2 * i + h) * 4 if config.expert_bias else 0)
    correction_bias = 0 if config.score_correction_bias or config.router_scoring != "sigmoid" else 4
    total += len(config.moe_layers) * config.num_experts * (expert + correction_bias)
    return total + config.vocab_size * GGUF_BYTES_PER_TOKEN + FILE_ALLOWANCE


GGML_ROW = {"f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32)}  # type -> (bytes, elements) of a block


def llama_kv_bytes_per_token(config, cache_type: str) -> int:
    """Bytes one token takes in llama.cpp's KV cache over all layers at `cache_type` (its -ctk / -ctv): a K row of
    every KV head's key_length and a V row of value_length in each layer, each ggml_row_size (q8_0: 34 bytes a
    block of 32), as llama_kv_cache sizes them; for latent attention (deepseek2, key_length_mla written) only the
    K row, one head of kv_lora_rank + rotary_dim, which attention reads as values too. Sliding-window layers are
    counted as full ones (llama.cpp caps their cache at the window)."""
    block_bytes, block = GGML_ROW[cache_type]

    def row(elements: int) -> int:
        return elements // block * block_bytes

    if config.attention == "mla":
        return config.num_layers * row(config.kv_lora_rank + config.rotary_dim)
    return config.num_layers * 2 * row(config.num_kv_heads * config.head_dim)


def colibri_kv_bytes_per_token(config, kv_dtype: str) -> int:
    """Bytes one token takes in Colibri's KV cache over all layers at `--kv-dtypes` entry `kv_dtype`
    (paged_kv.kv_bytes_per_token: latent attention's one row of kv_lora_rank + rotary_dim a layer)."""
    from colibri_stream.model.paged_kv import KV_CACHE_STORAGE, kv_bytes_per_token

    return kv_bytes_per_token(config, KV_CACHE_STORAGE[kv_dtype])


@dataclasses.dataclass(frozen=True)
class PlannedFile:
    """A file (or model folder) a shape needs: what it is, where, its bytes, whether it is written already."""

    what: str  # "folder" or "GGUF"
    spec: str  # the --shapes entry
    path: Path
    bytes: int
    present: bool


def shape_files(spec: str, folder_root: Path, gguf_root: Path | None, with_gguf: bool,
                expert_dtype: str = "bfloat16") -> list[PlannedFile]:
    """The files of a `--shapes` entry: its model folder and, `with_gguf`, its GGUF file, each with its predicted
    bytes (`folder_bytes`, `gguf_bytes`)."""
    shape, layers, dense = parse_shape(spec)
    config = benchmark_config(shape, layers, dense, expert_dtype)
    folder = folder_path(shape, layers, dense, folder_root, expert_dtype)
    files = [PlannedFile("folder", spec, folder, folder_bytes(config), folder_is_written(folder))]
    if with_gguf:
        gguf = gguf_path(folder, gguf_root)
        files.append(PlannedFile("GGUF", spec, gguf, gguf_bytes(config), gguf.is_file()))
    return files


def filesystem(path: Path) -> tuple[int, Path]:
    """(device id, nearest existing folder) of the filesystem a file written at `path` lands on."""
    where = path
    while not where.is_dir():
        where = where.parent
    return os.stat(where).st_dev, where


def room_refusal(files: list[PlannedFile]) -> str | None:
    """One line refusing `files` where those not yet written need more than a filesystem's free space
    (shutil.disk_usage) less FREE_MARGIN, files landing on one filesystem summed; None when they fit."""
    groups: dict[int, tuple[Path, list[PlannedFile]]] = {}
    for file in files:
        if not file.present:
            device, where = filesystem(file.path)
            groups.setdefault(device, (where, []))[1].append(file)
    short = []
    for where, group in groups.values():
        need, free = sum(f.bytes for f in group), shutil.disk_usage(where).free
        if need + FREE_MARGIN > free:
            parts = ", ".join(f"{f.spec} {f.what} {f.bytes / 1e9:.1f}" for f in group)
            short.append(f"{where} has {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB to write ({parts}) "
                         f"+ {FREE_MARGIN / 1e9:.1f} margin")
    if not short:
        return None
    return ("refused, the files would not fit: " + "; ".join(short)
            + " (--gguf-root puts the GGUF files on another filesystem, e.g. /dev/shm; fewer layers shrink both)")


def plan_files(shapes: list[str], folder_root: Path, gguf_root: Path | None, with_gguf: bool,
               kept: bool, expert_dtype: str = "bfloat16") -> str | None:
    """Print each shape's files, their bytes and where they go, and refuse (`room_refusal`'s line) when they would
    not fit: all shapes' files together when they are `kept`, else each shape's alone (its files are removed
    before the next shape's are written). None when everything fits."""
    planned = [shape_files(spec, folder_root, gguf_root, with_gguf, expert_dtype) for spec in shapes]
    for files in planned:
        for f in files:
            state = "written already" if f.present else "to write"
            log(f"{f.spec} {f.what}: {f.path}, {f.bytes / 1e9:.2f} GB ({state}), on "
                f"{filesystem(f.path)[1]} with {shutil.disk_usage(filesystem(f.path)[1]).free / 1e9:.1f} GB free")
    if kept:
        return room_refusal([f for files in planned for f in files])
    return next((refusal for refusal in map(room_refusal, planned) if refusal), None)


def write_only(shapes: list[str], root: Path, gguf_py: str | None, gguf_root: Path | None = None,
               expert_dtype: str = "bfloat16") -> int:
    """--write-only: each shape's folder and, with `gguf_py`, its GGUF (under `gguf_root`, None: beside it), drawn
    on the GPU where CuPy finds one, else on the CPU; nothing is timed or removed."""
    from colibri_stream.backends.cupy_backend import cuda_available

    device = "cuda" if cuda_available() else "cpu"
    for spec in shapes:
        shape, layers, dense = parse_shape(spec)
        folder, _ = shape_folder(shape, layers, root, device, dense, expert_dtype)
        if gguf_py:
            gguf_beside(folder, gguf_py, gguf_root)
    return 0


def file_bytes(path: Path) -> int:
    """Bytes of a file, or of the files of a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size


def model_fields(spec: str, config, folder: Path, gguf: Path | None) -> dict:
    """The record fields naming a shape's model and its files: the --shapes entry, its dense / MoE split, where
    the folder and the GGUF file were and their bytes."""
    return dict(shape_spec=spec, dense_layers=config.num_layers - len(config.moe_layers),
                moe_layers=len(config.moe_layers), model_folder=str(folder), model_folder_bytes=file_bytes(folder),
                gguf_file=None if gguf is None else str(gguf),
                gguf_bytes=None if gguf is None else file_bytes(gguf))


def kv_fields(config, kv_dtype: str) -> dict:
    """The record fields of one token's KV cache bytes over all layers: Colibri's at `kv_dtype` and llama.cpp's at
    the cache type it runs for that dtype (LLAMA_KV_TYPES, the record's llama_kv_type where llama.cpp ran)."""
    return dict(colibri_kv_bytes_per_token=colibri_kv_bytes_per_token(config, kv_dtype),
                llama_kv_bytes_per_token=llama_kv_bytes_per_token(config, LLAMA_KV_TYPES[kv_dtype]))


def decode_step_bytes(config, batch: int, distinct: float, context: int, kv_dtype: str) -> float:
    """Bytes one decode step reads at least (the roofline's): decode.step_bytes, which counts q, k, v and o heads
    and their cache, for every model but latent attention's; for latent attention every dense tensor but the
    embedding (its projections, norms, routers, shared experts, dense MLPs, lm_head), the `distinct` routed experts
    of each MoE layer, and `batch` sequences of `context` tokens of its latent cache (`colibri_kv_bytes_per_token`)."""
    from decode import step_bytes

    expert = expert_matrix_bytes(config)
    if config.attention != "mla":
        return step_bytes(config, batch, distinct, context, KV_BYTES[kv_dtype], expert)
    from colibri_stream.checkpoint import dense_tensor_specs

    dense = sum(int(np.prod(shape)) for name, shape in dense_tensor_specs(config).items() if name != "embed_tokens")
    return (dense * WEIGHT_BYTES + len(config.moe_layers) * distinct * expert
            + batch * context * colibri_kv_bytes_per_token(config, kv_dtype))


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts one MoE layer touches for `batch` tokens routed uniformly at random to `top_k` of `num_experts`."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_room(decode_tokens: int, batches: list[int], contexts: list[int]) -> int:
    """Tokens a request may generate: its decode steps, plus one for each prefill step of the largest case (a
    request prefilled first decodes while the others prefill), plus a margin."""
    return decode_tokens + -(-max(batches) * max(contexts) // PREFILL_BUDGET) + 8


class PrefillPhases:
    """A step sink summing the phases of the steps that computed more tokens than the batch decodes (prefill)."""

    def __init__(self):
        self.batch = 0
        self.seconds: dict[str, float] = {}
        self.step_seconds = 0.0

    def start(self, batch: int) -> None:
        self.batch, self.seconds, self.step_seconds = batch, {}, 0.0

    def __call__(self, record) -> None:
        if record.args.get("tokens", 0) > self.batch:
            self.step_seconds += record.duration
            for name, seconds in record.phase_seconds().items():
                self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def run_requests(core, prompts: list[list[int]], decode_tokens: int, room: int, tag: str) -> tuple[float, float]:
    """(seconds until every prompt has its first token, decode tok/s of the next decode_tokens - 1 steps).

    A request prefilled early decodes while the others prefill (chunked prefill), so each may generate up to
    `room` tokens: after the last first token all of them are decoding, the next steps are pure decode steps of
    the whole batch, and their tokens over their time is the decode rate. Then the requests are aborted."""
    from colibri_stream.request import SamplingParams

    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    begin = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in core.step())
    prefilled_at = time.perf_counter()
    tokens = 0
    for _ in range(decode_tokens - 1):
        tokens += sum(len(out.token_ids) for out in core.step())
    decode_s = time.perf_counter() - prefilled_at
    core.abort_all()
    while core.has_unfinished():
        core.step()
    return prefilled_at - begin, tokens / decode_s


def colibri_cases(folder: Path, config, kv_dtype: str, precision: str, contexts: list[int], batches: list[int],
                  decode_tokens: int, max_case_seconds: float, phases: bool = False,
                  step_tokens: int | None = None) -> list[dict]:
    """Colibri's records of one shape, KV dtype and matmul precision: one engine sized for the largest case, every
    case on it (with `phases`, each case's prefill phases too). `step_tokens`: the engine's token budget of one
    step (max_num_batched_tokens; None: the engine's default)."""
    import cupy

    from colibri_stream.engine import EngineCore

    room = decode_room(decode_tokens, batches, contexts)
    longest = max(contexts) + room
    blocks = max(batches) * (-(-longest // 16) + 1) + 64
    options = dict(device="cuda", max_seq_len=longest, num_kv_blocks=blocks, max_batch_size=max(batches),
                   kv_cache_dtype=kv_dtype)
    if precision != "high":  # the default, which revisions without the option compute
        options["matmul_precision"] = precision
    if step_tokens is not None:
        options["max_num_batched_tokens"] = step_tokens
    try:
        core = EngineCore.from_pretrained(str(folder), **options)
    except Exception as error:  # an option this revision lacks, or a cache that does not fit
        log(f"colibri {kv_dtype} {precision}: {error}")
        return [dict(context=c, batch=b, matmul_precision=precision,
                     colibri_error=f"{type(error).__name__}: {error}") for c in contexts for b in batches]
    rng = np.random.default_rng(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return rng.integers(FIRST_PROMPT_ID, config.vocab_size, (count, length)).tolist()  # [count, length]

    records = []
    try:
        for batch in sorted(set(batches)):  # every batch's decode graph captured before any timing
            run_requests(core, prompts(batch, min(WARM_UP_TOKENS, max(contexts))), 4, room, f"warm{batch}")
        sink = PrefillPhases()
        if phases:
            core.timer.add_sink(sink)
        prefill_rate = None  # batch-1 prefill tok/s of the context run last: predicts the larger batches
        for context in contexts:
            for batch in batches:
                record = dict(context=context, batch=batch, matmul_precision=precision, colibri_options=options)
                if prefill_rate and batch * context / prefill_rate > max_case_seconds:
                    record["colibri_skipped"] = (f"predicted prefill {batch * context / prefill_rate:.0f} s "
                                                 f"> --max-case-seconds {max_case_seconds:.0f}")
                    records.append(record)
                    continue
                sink.start(batch)
                try:
                    prefill_s, decode_rate = run_requests(core, prompts(batch, context), decode_tokens, room,
                                                          f"c{context}b{batch}")
                except Exception as error:
                    traceback.print_exc()
                    record["colibri_error"] = f"{type(error).__name__}: {error}"
                    records.append(record)
                    continue
                record.update(ttft_s=prefill_s, colibri_prefill_tok_s=batch * context / prefill_s,
                              colibri_decode_tok_s=decode_rate)
                if phases:
                    record.update(prefill_phase_seconds=sink.seconds, prefill_step_seconds=sink.step_seconds)
                    log(f"  prefill steps {sink.step_seconds:.2f} s: " + ", ".join(
                        f"{name} {seconds:.2f}" for name, seconds in sorted(sink.seconds.items())))
                if batch == 1:
                    prefill_rate = record["colibri_prefill_tok_s"]
                log(f"colibri {kv_dtype} {precision} context {context} batch {batch}: prefill "
                    f"{record['colibri_prefill_tok_s']:.0f} tok/s, decode {record['colibri_decode_tok_s']:.0f} tok/s")
                records.append(record)
    finally:
        core.close()
        del core
        cupy.get_default_memory_pool().free_all_blocks()
    return records


def llama_cases(binary: str, gguf: Path, kv_dtype: str, contexts: list[int], batches: list[int],
                decode_tokens: int, timeout: float) -> dict[tuple[int, int], dict]:
    """llama-batched-bench's figures by (context, batch) for one GGUF and KV type."""
    from llama_cpp import batched_bench

    figures = {}
    for context in contexts:
        try:
            rows = batched_bench(binary, gguf, batches, context=context, gen_tokens=decode_tokens,
                                 cache_type=LLAMA_KV_TYPES[kv_dtype], timeout=timeout)
        except Exception as error:
            log(f"llama.cpp {kv_dtype} context {context}: {error}")
            for batch in batches:
                figures[context, batch] = dict(llama_error=str(error)[-400:])
            continue
        for batch, row in rows.items():
            figures[context, batch] = dict(llama_prefill_tok_s=row["speed_pp"], llama_decode_tok_s=row["speed_tg"],
                                           llama_kv_type=LLAMA_KV_TYPES[kv_dtype], llama_command=row["command"])
            log(f"llama.cpp {kv_dtype} context {context} batch {batch}: prefill {row['speed_pp']:.0f} tok/s, "
                f"decode {row['speed_tg']:.0f} tok/s")
    return figures


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def shape_layers(record: dict) -> str:
    """The layers of a record's model for the table: their number, and its dense / MoE split where the --shapes
    entry named it."""
    if record.get("shape_spec", "").count(":") == 2:
        return f"{record['layers']}: {record['dense_layers']} dense + {record['moe_layers']} MoE"
    return str(record["layers"])


def table(records: list[dict]) -> str:
    def cell(value, digits=0):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| shape | kv | precision | context | batch | prefill tok/s Colibri / llama.cpp | x | decode tok/s "
             "Colibri / llama.cpp | x | decode / roofline | TTFT s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        budget = (r.get("colibri_options") or {}).get("max_num_batched_tokens")
        precision = r["matmul_precision"] + (f", {budget} tokens a step" if budget else "")
        lines.append(
            f"| {r['shape']} ({shape_layers(r)}) | {r['kv_dtype']} | {precision} | {r['context']} | "
            f"{r['batch']} | "
            f"{cell(r.get('colibri_prefill_tok_s'))} / {cell(r.get('llama_prefill_tok_s'))} | "
            f"{cell(ratio(r.get('colibri_prefill_tok_s'), r.get('llama_prefill_tok_s')), 2)} | "
            f"{cell(r.get('colibri_decode_tok_s'))} / {cell(r.get('llama_decode_tok_s'))} | "
            f"{cell(ratio(r.get('colibri_decode_tok_s'), r.get('llama_decode_tok_s')), 2)} | "
            f"{cell(ratio(r.get('colibri_decode_tok_s'), r.get('roofline_decode_tok_s')), 2)} | "
            f"{cell(r.get('ttft_s'), 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help="SHAPE:LAYERS entries, or SHAPE:LAYERS:DENSE: DENSE leading dense layers, the rest MoE")
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8"], choices=sorted(KV_BYTES))
    parser.add_argument("--matmul-precisions", nargs="+", default=["medium"], choices=["high", "medium"])
    parser.add_argument("--decode-tokens", type=int, default=33, help="tokens per request, the first included")
    parser.add_argument("--expert-dtype", default="bfloat16", choices=["bfloat16", "mxfp4"],
                        help="the routed experts' format in the folder and the GGUF file (mxfp4: gpt-oss's, "
                             "llama.cpp's MXFP4 of the same codes)")
    parser.add_argument("--batched-bench", help="llama-batched-bench binary (none: Colibri only)")
    parser.add_argument("--gguf-py", help="gguf-py folder of the llama.cpp source tree (writes the GGUF files)")
    parser.add_argument("--folder-root", default="/tmp/colibri-long-context")
    parser.add_argument("--gguf-root", help="folder of the GGUF files (default: beside the model folders), e.g. "
                        "/dev/shm/colibri-long-context where the disk cannot hold both")
    parser.add_argument("--keep-models", action="store_true", help="keep each shape's files after its runs")
    parser.add_argument("--write-only", action="store_true",
                        help="write each shape's folder and GGUF (with --gguf-py) and stop: a later run times them "
                             "(no GPU needed)")
    parser.add_argument("--max-case-seconds", type=float, default=60.0)
    parser.add_argument("--max-num-batched-tokens", nargs="+", type=int, default=[None],
                        help="Colibri's token budgets of one step to run in turn (default: the engine's)")
    parser.add_argument("--phases", action="store_true", help="record each case's prefill phases (step timer on)")
    parser.add_argument("--llama-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "long_context.json"))
    args = parser.parse_args(argv)
    gguf_root = Path(args.gguf_root) if args.gguf_root else None
    with_gguf = bool(args.gguf_py) if args.write_only else bool(args.batched_bench)
    refusal = plan_files(args.shapes, Path(args.folder_root), gguf_root, with_gguf,
                         kept=args.write_only or args.keep_models, expert_dtype=args.expert_dtype)
    if refusal:
        print(refusal, flush=True)
        return 2
    if args.write_only:
        return write_only(args.shapes, Path(args.folder_root), args.gguf_py, gguf_root, args.expert_dtype)
    require_gpu()
    import cupy

    from decode import machine as gpu_machine
    from decode import measure_bandwidth

    bandwidth = measure_bandwidth(cupy)  # GB/s, bytes read plus written
    common = dict(host_machine(), **gpu_machine(), bench="long_context", bandwidth_gb_s=bandwidth)
    records: list[dict] = []
    for spec in args.shapes:
        shape, layers, dense = parse_shape(spec)
        folder, description = shape_folder(shape, layers, Path(args.folder_root), "cuda", dense, args.expert_dtype)
        from colibri_stream.checkpoint import ModelFolder

        config = ModelFolder(folder).config
        # contexts past the model's positions (Mixtral's 32768 less the decoded tokens) are cut to fit, for both
        # engines alike; each record names the context it ran
        room = decode_room(args.decode_tokens, args.batches, args.contexts)
        contexts = sorted({min(c, config.max_position_embeddings - room) for c in args.contexts})
        gguf = gguf_beside(folder, args.gguf_py, gguf_root) if args.batched_bench else None
        files = model_fields(spec, config, folder, gguf)
        for kv_dtype in args.kv_dtypes:
            cases = [case for precision in args.matmul_precisions for step_tokens in args.max_num_batched_tokens
                     for case in colibri_cases(folder, config, kv_dtype, precision, contexts, args.batches,
                                               args.decode_tokens, args.max_case_seconds, args.phases,
                                               step_tokens)]
            llama = (llama_cases(args.batched_bench, gguf, kv_dtype, contexts, args.batches,
                                 args.decode_tokens, args.llama_timeout) if args.batched_bench else {})
            for case in cases:
                distinct = expected_distinct_experts(config.num_experts, config.top_k, case["batch"])
                step = decode_step_bytes(config, case["batch"], distinct, case["context"], kv_dtype)
                records.append(dict(common, shape=shape, layers=layers, model_description=description, **files,
                                    expert_dtype=config.expert_dtype,
                                    kv_dtype=kv_dtype, **kv_fields(config, kv_dtype),
                                    decode_tokens=args.decode_tokens,
                                    roofline_decode_tok_s=case["batch"] * bandwidth * 1e9 / step,
                                    **case, **llama.get((case["context"], case["batch"]), {})))
            Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
        if not args.keep_models:
            shutil.rmtree(folder, ignore_errors=True)
            if gguf is not None:
                gguf.unlink(missing_ok=True)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
