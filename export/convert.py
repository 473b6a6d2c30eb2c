"""Hugging Face checkpoint -> native model folder, streamed.

The export is planned from the safetensors headers alone (every source tensor's name, dtype and shape is checked
against the translated config before anything is written), then written tensor by tensor: dense tensors in
`dense_tensor_specs` order through DenseFileWriter, then routed experts one at a time through ExpertFileWriter.
Rows are read and converted in chunks of a few MiB, so memory peaks at about one expert (or one dense tensor).

A pre-quantized checkpoint (config.json's quantization_config, export/quantized_sources.py) keeps its routed
experts' values and scales in the matching codec, and its quantized dense weights are dequantized to the dense
dtype; such a checkpoint is not quantized again (`quantize` is refused).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from ..checkpoint import (CONFIG_FILE, NUMPY_DTYPES, TOKENIZER_FILES, DenseFileWriter, ExpertFileWriter,
                          dense_tensor_dtype, dense_tensor_specs, expert_block_layout, write_config)
from ..config import ModelConfig
from ..config import FP8_SCALES, INT4_GROUP_SIZES
from ..errors import CheckpointError, ColibriError, UnsupportedModelError
from ..expert_codecs import EXPERT_BIASES, ExpertCodec, expert_codec
from .architectures import multi_token_prediction_layers, translate_config
from .hf_checkpoint import SOURCE_DTYPES, HFCheckpoint
from .quantized_source import QuantizedSource
from .quantized_sources import quantized_source
from .tensor_names import IGNORED_SUFFIXES, hf_dense_candidates, hf_expert_names

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
QUANTIZE = ("int8", "int4", "fp8", "mxfp4")  # --quantize: the routed experts' codec (expert_codecs.py)
_CHUNK_BYTES = 16 << 20  # float32 bytes of the rows read and converted at once
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """Rows `row0 : row0 + shape[0]` of checkpoint tensor `name` indexed by `lead`.

    A whole tensor has lead () and row0 0; one expert of a fused [E, 2I, H] gate_up_proj has lead (e,) and row0
    0 (gate) or I (up). `transposed` reads the rows of tensor[lead].T, `step` every step-th row from row0: gpt-oss's
    gate is gate_up_proj[e].T (gate_up_proj [E, H, 2I]) from row 0 in steps of 2, its up the same from row 1. A
    quantized stack is read one expert's rows at a time by the format's reader, rows of [out, in] as its format
    stores them (gpt-oss's MXFP4 gate_up_proj: [E, 2I, H], so not transposed).
    """

    name: str
    shape: tuple[int, ...]  # of what is read: [n] or [rows, cols]
    lead: tuple[int, ...] = ()
    row0: int = 0
    stored: tuple[str, ...] = ()  # the tensors of a weight the checkpoint stores quantized (none: plain)
    step: int = 1
    transposed: bool = False

    @property
    def quantized(self) -> bool:
        """Whether the source is a quantized weight, read by the checkpoint's format reader (a matrix whole, a
        stack one expert's rows)."""
        return bool(self.stored)

    @property
    def rows(self) -> slice:
        """The rows read, of tensor[lead] (of its transpose when `transposed`)."""
        return slice(self.row0, self.row0 + self.step * self.shape[0], self.step)

    def chunks(self) -> Iterator[tuple[int, int]]:
        """Row ranges [a, b) of at most _CHUNK_BYTES as float32."""
        step = max(1, _CHUNK_BYTES // (4 * int(np.prod(self.shape[1:]))))
        for start in range(0, self.shape[0], step):
            yield start, min(start + step, self.shape[0])

    def index(self, start: int, stop: int) -> tuple:
        return self.lead + (slice(self.row0 + start, self.row0 + stop),)


@dataclass(frozen=True)
class ExportPlan:
    """What to read for every tensor of the native folder."""

    config: ModelConfig
    dense: dict[str, Source]  # our dense tensor name -> source, in dense_tensor_specs order
    experts: dict[int, list[dict[str, Source]]]  # MoE layer -> per expert {"gate", "up", "down"} (and biases)
    source_bytes: int  # bytes read from the checkpoint in all
    quantization: QuantizedSource | None = None  # the reader of the checkpoint's quantized weights


def plan_export(checkpoint: HFCheckpoint, config: ModelConfig, quantization: QuantizedSource | None = None,
                skipped_layers: range = range(0)) -> ExportPlan:
    """Map every native tensor to its checkpoint source, checking names, dtypes and shapes; reads headers only.

    With `quantization`, a weight it stores quantized is named as in an unquantized checkpoint (`<module>.weight`,
    or a fused stack's name), and stands for the format's tensors; every routed expert must be one (config's expert
    format is the checkpoint's). The tensors of `skipped_layers` (multi-token-prediction modules after the
    decoder's layers) are left out.
    """
    used: set[str] = set()
    imported = quantization.weights(checkpoint.tensors) if quantization else {}  # weight -> its stored tensors
    names = checkpoint.tensors.keys() | imported.keys()

    def checked(name: str, shape: tuple[int, ...]) -> str:
        if name in imported:
            if len(shape) != 2 and not (len(shape) == 3 and quantization.stacked):
                raise UnsupportedModelError(f"{name} is quantized with {len(shape)} dimensions; Colibri imports "
                                            "quantized matrices [out, in] (one per expert)")
            quantization.check(checkpoint.tensors, name, shape)
            used.update(imported[name])
            return name
        info = checkpoint.tensors[name]
        if info.dtype not in SOURCE_DTYPES:
            raise UnsupportedModelError(f"{name} is stored as {info.dtype}; Colibri exports plain weights from BF16, "
                                        "F16 or F32, and quantized ones in the formats of config.json's "
                                        "quantization_config that it imports (fp8 block-scaled, compressed-tensors "
                                        "pack-quantized int4, gpt-oss MXFP4)")
        if info.shape != shape:
            raise CheckpointError(f"{name} has shape {list(info.shape)}, config.json implies {list(shape)}")
        used.add(name)
        return name

    dense: dict[str, Source] = {}
    for name, shape in dense_tensor_specs(config).items():
        candidates = hf_dense_candidates(name)
        found = next((c for c in candidates if c in names), None)
        if found is None:
            raise CheckpointError(f"{candidates[0]} is missing from the checkpoint")
        dense[name] = Source(checked(found, shape), shape, stored=imported.get(found, ()))

    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    experts: dict[int, list[dict[str, Source]]] = {}

    def interleaved_stack(name: str, out: int, inp: int) -> tuple[str, tuple[str, ...]]:
        """gpt-oss's stack `name` checked, and its stored tensors: a plain one is [E, in, out] (gate_up_proj
        [E, H, 2I], read transposed), a quantized one [E, out, in] as MXFP4 stores it."""
        stored = imported.get(name, ())
        return checked(name, (e, out, inp) if stored else (e, inp, out)), stored

    for layer in config.moe_layers:
        layout = hf_expert_names(layer, names)
        if layout.interleaved:  # gate in the even outputs of gate_up, up in the odd ones
            (gate_up, gate_up_stored), (down, down_stored) = (interleaved_stack(layout.gate, 2 * i, h),
                                                              interleaved_stack(layout.down, h, i))
            gate_up_bias, down_bias = checked(layout.gate_up_bias, (e, 2 * i)), checked(layout.down_bias, (e, h))
            experts[layer] = [dict(gate=Source(gate_up, (i, h), (x,), 0, gate_up_stored, step=2,
                                               transposed=not gate_up_stored),
                                   up=Source(gate_up, (i, h), (x,), 1, gate_up_stored, step=2,
                                             transposed=not gate_up_stored),
                                   down=Source(down, (h, i), (x,), stored=down_stored, transposed=not down_stored),
                                   gate_bias=Source(gate_up_bias, (i,), (x,), 0, step=2),
                                   up_bias=Source(gate_up_bias, (i,), (x,), 1, step=2),
                                   down_bias=Source(down_bias, (h,), (x,))) for x in range(e)]
            continue
        if layout.fused:
            gate_up, down = checked(layout.gate, (e, 2 * i, h)), checked(layout.down, (e, h, i))
            gate_up_stored, down_stored = imported.get(gate_up, ()), imported.get(down, ())
            experts[layer] = [dict(gate=Source(gate_up, (i, h), (x,), 0, gate_up_stored),
                                   up=Source(gate_up, (i, h), (x,), i, gate_up_stored),
                                   down=Source(down, (h, i), (x,), stored=down_stored)) for x in range(e)]
            continue
        experts[layer] = []
        for x in range(e):
            tensors = {}
            for part, pattern, shape in (("gate", layout.gate, (i, h)), ("up", layout.up, (i, h)),
                                         ("down", layout.down, (h, i))):
                name = pattern.format(e=x)
                if name not in names:
                    raise CheckpointError(f"{name} is missing from the checkpoint")
                tensors[part] = Source(checked(name, shape), shape, stored=imported.get(name, ()))
            experts[layer].append(tensors)
    if quantization:
        plain = [s.name for parts in experts.values() for expert in parts for part, s in expert.items()
                 if part not in EXPERT_BIASES and not s.quantized]
        if plain:
            raise UnsupportedModelError(f"the checkpoint stores {len(plain)} routed expert matrices unquantized "
                                        f"(first: {plain[0]}); Colibri imports {quantization.description} "
                                        "checkpoints whose routed experts are all quantized")

    tolerated = {"lm_head.weight"} if config.tie_word_embeddings else set()
    # Tensors of no element hold nothing (transformers builds Qwen2-MoE's shared expert even at width 0); with no
    # shared expert its gate scales a zero output
    tolerated |= {n for n, t in checkpoint.tensors.items() if 0 in t.shape}
    if not config.shared_expert_intermediate_size:
        tolerated |= {n for n in checkpoint.tensors if ".mlp.shared_expert_gate." in n}
    skipped = {n for n in checkpoint.tensors if n.startswith(tuple(f"model.layers.{i}." for i in skipped_layers))}
    if skipped:
        log.warning("skipping %d tensors of the multi-token-prediction layers %d-%d (speculative decoding does not "
                    "use them yet)", len(skipped), skipped_layers[0], skipped_layers[-1])
    unused = sorted(n for n in set(checkpoint.tensors) - used - tolerated - skipped
                    if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(f"the checkpoint holds {len(unused)} tensors that config.json does not account for "
                              f"(first: {unused[0]})")
    return ExportPlan(config, dense, experts, sum(checkpoint.tensors[n].nbytes for n in used), quantization)


def untie_differing_lm_head(checkpoint: HFCheckpoint, config: ModelConfig) -> ModelConfig:
    """`config`, untied when the checkpoint holds an lm_head that differs from the embeddings.

    transformers ties lm_head to the embeddings only when the checkpoint lacks lm_head.weight or holds an equal
    one (torch .bin checkpoints store both); a different lm_head.weight is loaded untied, whatever
    tie_word_embeddings says. Compared in row chunks, as float32 (the reference dtype).
    """
    (embed,), (head,) = hf_dense_candidates("embed_tokens"), hf_dense_candidates("lm_head")
    if not config.tie_word_embeddings or head not in checkpoint.tensors or embed not in checkpoint.tensors:
        return config
    shape = checkpoint.tensors[embed].shape
    if checkpoint.tensors[head].shape == shape:
        source = Source(embed, shape)
        if all(np.array_equal(checkpoint.read(embed, source.index(a, b)).astype(np.float32),
                              checkpoint.read(head, source.index(a, b)).astype(np.float32))
               for a, b in source.chunks()):
            return config
    return dataclasses.replace(config, tie_word_embeddings=False)


def _cast(rows: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """Rows in the storage dtype, converted through float32 when the dtypes differ."""
    if rows.dtype == dtype:
        return rows
    wide = rows.astype(np.float32)
    narrow = wide.astype(dtype)
    if dtype == np.float16 and np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise ColibriError(f"{name} has values beyond float16's range; export with --dtype bf16 or fp32")
    return narrow


class _Reader:
    """Reads sources chunk by chunk into storage arrays, counting the bytes read on a progress bar; quantized
    sources whole, through the checkpoint's format reader."""

    def __init__(self, checkpoint: HFCheckpoint, bar: tqdm, quantization: QuantizedSource | None):
        self.checkpoint = checkpoint
        self.bar = bar
        self.quantization = quantization

    def imported(self, source: Source) -> dict[str, np.ndarray]:
        """A quantized source as the format's codec tensors by suffix, its values and scales as stored."""
        if source.lead:  # one expert's rows of a stack: the bytes of those rows
            parts = self.quantization.read_expert(self.checkpoint, source.name, *source.lead, source.rows)
            self.bar.update(sum(part.nbytes for part in parts.values()))
            return parts
        parts = self.quantization.read(self.checkpoint, source.name, source.shape)
        self.bar.update(sum(self.checkpoint.tensors[name].nbytes for name in source.stored))
        return parts

    def _rows(self, source: Source) -> Iterator[tuple[int, int, np.ndarray]]:
        if source.transposed or source.step != 1:  # read whole (one expert's matrix), then its rows picked
            whole = self.checkpoint.read(source.name, source.lead)
            whole = whole.T if source.transposed else whole
            rows = whole[source.rows]
            self.bar.update(rows.nbytes)
            yield 0, source.shape[0], rows
            return
        for start, stop in source.chunks():
            rows = self.checkpoint.read(source.name, source.index(start, stop))  # [stop - start, ...] stored dtype
            self.bar.update(rows.nbytes)
            yield start, stop, rows

    def converted(self, source: Source, dtype: str) -> np.ndarray:
        """The whole source in `dtype` (a quantized one dequantized first).  # source.shape"""
        if source.quantized:
            codec = self.quantization.codec
            return _cast(codec.dequantize(self.imported(source), source.shape[1]), NUMPY_DTYPES[dtype], source.name)
        out = np.empty(source.shape, NUMPY_DTYPES[dtype])
        for start, stop, rows in self._rows(source):
            out[start:stop] = _cast(rows, out.dtype, source.name)
        return out

    def quantized(self, source: Source, part: str, codec: ExpertCodec) -> dict[str, np.ndarray]:
        """The whole source (one expert matrix) as float32, quantized by `codec`: its block tensors by name
        (scales of fp8's 128-row tiles span row chunks, so the matrix is read first)."""
        return codec.quantize_matrix(part, self.converted(source, "float32"))


def _write_weights(plan: ExportPlan, checkpoint: HFCheckpoint, out: Path, progress: bool,
                   keep_quantized: bool = True) -> None:
    config = plan.config
    with tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="export",
              file=sys.stderr, disable=not progress) as bar:
        reader = _Reader(checkpoint, bar, plan.quantization)
        specs = dense_tensor_specs(config)
        dense = DenseFileWriter(out / config.dense_file,
                                {n: (shape, dense_tensor_dtype(n, config)) for n, shape in specs.items()})
        for name, source in plan.dense.items():
            dense.write(name, reader.converted(source, dense_tensor_dtype(name, config)))
        dense.close()
        codec = expert_codec(config)
        quantized = config.expert_dtype in QUANTIZE
        with ExpertFileWriter(out / config.experts_file, config) as experts:
            for layer, sources in plan.experts.items():
                for expert, parts in enumerate(sources):
                    tensors: dict[str, np.ndarray] = {}
                    for part, source in parts.items():
                        if part in EXPERT_BIASES:
                            tensors[part] = reader.converted(source, "float32")
                        elif source.quantized and keep_quantized:  # the checkpoint's values in its codec
                            tensors.update({part + suffix: a for suffix, a in reader.imported(source).items()})
                        elif quantized:
                            tensors.update(reader.quantized(source, part, codec))
                        else:
                            tensors[part] = reader.converted(source, config.expert_dtype)
                    experts.write_expert(layer, expert, tensors)


def _prepare_output(out: Path, source: Path, config: ModelConfig, force: bool, needed: int) -> bool:
    """Make `out` ready to receive a model of `needed` bytes; returns whether it was created."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.exists() and out.resolve() == source.resolve():
        raise CheckpointError("the output folder must not be the Hugging Face folder")
    created = not out.exists()
    if not created and any(out.iterdir()):
        if not force:
            raise CheckpointError(f"{out} is not empty (use --force to overwrite it)")
        # config.json first: until the new one is written last, the folder must not look like a valid model.
        for name in (CONFIG_FILE, config.dense_file, config.experts_file, *TOKENIZER_FILES):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < needed:
        if created:
            out.rmdir()
        raise CheckpointError(f"{out} has {free / 2**30:.1f} GiB free, the export needs {needed / 2**30:.1f} GiB")
    return created


def expert_format(quantize: str | None, group_size: int | None, zero_point: bool,
                  fp8_scales: str | None) -> dict:
    """config.json's expert format fields for the export's options (None: the dense storage dtype stays);
    options of another format than `quantize` are refused."""
    if quantize not in (None, *QUANTIZE):
        raise ColibriError(f"quantize {quantize!r} is not supported ({', '.join(QUANTIZE)})")
    if quantize != "int4" and (group_size is not None or zero_point):
        raise ColibriError("--group-size and --int4-zero-point are options of --quantize int4")
    if quantize != "fp8" and fp8_scales is not None:
        raise ColibriError("--fp8-scales is an option of --quantize fp8")
    if quantize == "int4":
        group_size = 128 if group_size is None else group_size
        if group_size not in INT4_GROUP_SIZES:
            raise ColibriError(f"int4 group size {group_size} is not one of {', '.join(map(str, INT4_GROUP_SIZES))}")
        return dict(expert_dtype="int4", expert_group_size=group_size, expert_zero_point=zero_point)
    if quantize == "fp8":
        fp8_scales = fp8_scales or "block"
        if fp8_scales not in FP8_SCALES:
            raise ColibriError(f"fp8 scales {fp8_scales!r} are not one of {', '.join(FP8_SCALES)}")
        return dict(expert_dtype="fp8", expert_scales=fp8_scales)
    return dict(expert_dtype=quantize) if quantize else {}


def export_model(hf_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", quantize: str | None = None,
                 force: bool = False, progress: bool = True, group_size: int | None = None, zero_point: bool = False,
                 fp8_scales: str | None = None, dequantize: bool = False) -> ModelConfig:
    """Convert a Hugging Face MoE checkpoint into a native model folder and return its config.

    dtype: "bf16", "fp16" or "fp32", the storage dtype of every tensor; quantize: None, or the routed experts'
    format, rounded to nearest (expert_codecs.py): "int8" (symmetric, per output channel), "int4" (a scale per
    `group_size` input channels, 32, 64 or 128 (default); with `zero_point` asymmetric), "fp8" (e4m3; `fp8_scales`
    "block": per 128 x 128 tile (default), "channel": per output channel), "mxfp4" (e2m1, a power of two per 32
    input channels). A non-empty `out_dir` is refused unless `force`. A pre-quantized checkpoint
    (export/quantized_sources.py) keeps its experts' format and is refused with `quantize`, unless `dequantize`:
    then its experts are dequantized and stored in `dtype` (or re-quantized by `quantize`), as a checkpoint of
    those values would export (`dequantize` is refused for a checkpoint that is not quantized). config.json is
    written last, and a failed export leaves no config.json behind.
    """
    if dtype not in DTYPE_NAMES:
        raise ColibriError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    formats = expert_format(quantize, group_size, zero_point, fp8_scales)
    checkpoint = HFCheckpoint(hf_dir)
    quantization = quantized_source(checkpoint.config)
    if dequantize and quantization is None:
        raise ColibriError("--dequantize is an option of pre-quantized checkpoints; this one is not quantized")
    if quantization is not None and not dequantize:
        if formats:
            raise ColibriError(f"the checkpoint is already quantized ({quantization.description}); export it "
                               "without --quantize and its options (its experts keep their format), or with "
                               "--dequantize")
        formats = quantization.expert_format()
    storage = DTYPE_NAMES[dtype]
    config = translate_config(checkpoint.config, checkpoint.generation_config, checkpoint.tensors.keys(),
                              storage, storage)
    config = untie_differing_lm_head(checkpoint, dataclasses.replace(config, **formats))
    plan = plan_export(checkpoint, config, quantization, multi_token_prediction_layers(checkpoint.config))
    dense_bytes = sum(int(np.prod(s)) for s in dense_tensor_specs(config).values()) * NUMPY_DTYPES[storage].itemsize
    expert_bytes = len(config.moe_layers) * config.num_experts * expert_block_layout(config)[1]
    out = Path(out_dir)
    created = _prepare_output(out, checkpoint.folder, config, force, dense_bytes + expert_bytes)
    try:
        _write_weights(plan, checkpoint, out, progress, keep_quantized=not dequantize)
        for name in TOKENIZER_FILES:
            if (checkpoint.folder / name).is_file():
                shutil.copyfile(checkpoint.folder / name, out / name)
        write_config(out, config)
    except BaseException as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for name in (CONFIG_FILE, config.dense_file, config.experts_file):
                (out / name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            where = f" ({exc.filename})" if exc.filename else ""
            raise CheckpointError(f"export failed: {exc.strerror or exc}{where}") from None
        raise
    return config
