"""Perplexity of the shipped model with its routed experts in each expert format, or its KV cache in each element
type, on its held-out split.

The shipped model's experts are int8 (exported from a bf16 checkpoint that is not in the repository), so every other
format is quantized from the dequantized int8 experts (codecs.dequantize_expert, then the format's round-to-nearest
quantize) and written into a model folder of its own beside the same dense weights; the stored int8 experts are the
reference. Each folder runs on the NumPy backend (float32 KV cache), window by window, as
export/default_model_provenance/evaluate.py cuts the split: non-overlapping windows of 1025 tokens, the last 1024
predicted from the context inside the window.

Tokens: `--corpus` is the test.jsonl of export/default_model_provenance/build_corpus.py (deterministic for a Python
build; the record keeps its sha256), tokenized with the model's tokenizer. Without it, the 4 held-out windows of
benchmarks/data/default_model/traces_test.npz (1024 tokens each, the last 1023 predicted).

`--kv-dtypes fp32 bf16 fp16 fp8` runs the shipped int8 experts with the KV cache in each element type instead
(fp32 the reference; fp8 is e4m3 with scales of 1.0, docs/KV_CACHE.md). `--matmul-precisions high medium` runs the
shipped folder on the GPU (bf16 KV cache) at each matmul precision instead (high the reference; medium takes one
bf16 part of the activations in the tensor-core products of prefill, docs/PREFILL_ATTENTION.md).

Usage: python benchmarks/expert_format_quality.py [--corpus .data/default_model/corpus/test.jsonl]
           [--max-windows N] [--formats int8 int4-g64 ...] [--out benchmarks/data/default_model/expert_formats.json]
       python benchmarks/expert_format_quality.py --corpus ... --kv-dtypes fp32 bf16 fp16 fp8
           [--out benchmarks/data/default_model/kv_cache_quality.json]
       python benchmarks/expert_format_quality.py --corpus ... --matmul-precisions high medium   (a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_stream.batch import single_sequence_batch
from colibri_stream.checkpoint import (TOKENIZER_FILES, ExpertFileWriter, ModelFolder, default_model_path,
                                       expert_block_layout, write_config)
from colibri_stream.expert_codecs import dequantize_expert, expert_codec
from colibri_stream.loader import load_model
from conditions import require_gpu

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "export" / "default_model_provenance"))
from train_tokenizer import encode_split, read_documents, token_byte_lengths  # noqa: E402

TRACES = ROOT / "benchmarks" / "data" / "default_model" / "traces_test.npz"
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8")
SEQ = 1024  # tokens predicted per window (the model's max positions)
BLOCK_SIZE = 16
# Each format as config.json's expert fields; "int8" is the folder as shipped
FORMATS = {
    "int8": {},
    "int4-g64": dict(expert_dtype="int4", expert_group_size=64),
    "int4-g128": dict(expert_dtype="int4", expert_group_size=128),
    "int4-g128-zero": dict(expert_dtype="int4", expert_group_size=128, expert_zero_point=True),
    "fp8-block": dict(expert_dtype="fp8", expert_scales="block"),
    "fp8-channel": dict(expert_dtype="fp8", expert_scales="channel"),
    "mxfp4": dict(expert_dtype="mxfp4"),
}


def recode_folder(source: ModelFolder, out: Path, fields: dict) -> Path:
    """A copy of `source` (dense weights and tokenizer linked) whose experts are its dequantized experts quantized
    into the format of `fields`."""
    out.mkdir(parents=True)
    config = dataclasses.replace(source.config, **fields)
    for name in (config.dense_file, *TOKENIZER_FILES):
        if (source.path / name).is_file():
            (out / name).symlink_to((source.path / name).resolve())
    codec = expert_codec(config)
    with ExpertFileWriter(out / config.experts_file, config) as writer:
        for layer in config.moe_layers:
            for expert in range(config.num_experts):
                tensors = {}
                for name, weight in dequantize_expert(source.experts.tensors(layer, expert)).items():
                    tensors.update(codec.quantize_matrix(name, weight))
                writer.write_expert(layer, expert, tensors)
    write_config(out, config)
    return out


def held_out_windows(model: Path, corpus: Path | None, max_windows: int) -> tuple[np.ndarray, dict]:
    """[n, SEQ + 1] (corpus) or [4, SEQ] (traces) token windows and where they came from."""
    if corpus is None:
        windows = np.load(TRACES)["tokens"].astype(np.int64)  # [4, SEQ]
        source = {"tokens": str(TRACES.relative_to(ROOT)), "windows_from": "traces_test.npz"}
    else:
        from tokenizers import Tokenizer

        tokens = encode_split(Tokenizer.from_file(str(model / "tokenizer.json")), read_documents(corpus))
        count = (tokens.size - 1) // SEQ
        index = np.arange(count)[:, None] * SEQ + np.arange(SEQ + 1)[None, :]
        windows = tokens[index].astype(np.int64)  # [n, SEQ + 1]
        source = {"corpus_sha256": hashlib.sha256(corpus.read_bytes()).hexdigest(), "corpus_tokens": int(tokens.size)}
    return (windows[:max_windows] if max_windows else windows), source


def window_nll(model, window: np.ndarray, kv_dtype: str) -> float:
    """Summed negative log-likelihood of window[1:] given the tokens before it, the KV cache in `kv_dtype`."""
    ids = window[:-1]
    blocks = -(-len(ids) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE, kv_dtype)
    batch = single_sequence_batch(ids, 0, np.arange(blocks), BLOCK_SIZE)
    batch.logits_indices = np.arange(len(ids))
    logits = model.forward(batch, kv).astype(np.float64)  # [S, V]
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(ids)), window[1:]].sum())


def evaluate(folder: Path, windows: np.ndarray, token_bytes: np.ndarray, kv_dtype: str = "fp32",
             device: str = "cpu", matmul_precision: str = "high") -> dict:
    model = load_model(str(folder), device=device, matmul_precision=matmul_precision)
    slots, block_bytes = expert_block_layout(ModelFolder(folder).config)
    start = time.perf_counter()
    nll = sum(window_nll(model, w, kv_dtype) for w in windows)
    count = windows[:, 1:].size
    return {"tokens": count, "nll": nll / count, "perplexity": math.exp(nll / count),
            "bits_per_byte": nll / math.log(2) / int(token_bytes[windows[:, 1:]].sum()),
            "expert_bytes": sum(s.nbytes for s in slots), "block_bytes": block_bytes,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--corpus", type=Path, default=None, help="build_corpus.py's test.jsonl")
    parser.add_argument("--max-windows", type=int, default=0, help="0: every window")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=None,
                        help="compare KV cache element types (fp32 first, the reference) instead of expert formats")
    parser.add_argument("--matmul-precisions", nargs="+", choices=("high", "medium"), default=None,
                        help="compare the GPU's matmul precisions (high first, the reference) instead")
    parser.add_argument("--out", type=Path, default=None, help="JSON record (default: print only)")
    args = parser.parse_args()
    if args.kv_dtypes is not None and args.kv_dtypes[0] != "fp32":
        parser.error("--kv-dtypes starts with fp32, the reference")
    if args.matmul_precisions is not None and args.matmul_precisions[0] != "high":
        parser.error("--matmul-precisions starts with high, the reference")

    source = ModelFolder(args.model)
    if source.config.expert_dtype != "int8" or "int8" not in args.formats:
        parser.error("the reference is the shipped int8 experts: --model must hold int8 experts, --formats int8")
    from tokenizers import Tokenizer

    token_bytes = token_byte_lengths(Tokenizer.from_file(str(args.model / "tokenizer.json")))
    windows, origin = held_out_windows(args.model, args.corpus, args.max_windows)
    record = {"bench": "expert_format_quality", "model": str(args.model.resolve().relative_to(ROOT))
              if args.model.resolve().is_relative_to(ROOT) else str(args.model), "windows": len(windows),
              "window_tokens": int(windows.shape[1]), **origin,
              "source_of_formats": "the stored int8 experts, dequantized, then quantized (round to nearest)",
              "formats": {}}
    if args.kv_dtypes is not None:
        record["bench"] = "kv_cache_quality"
        record["source_of_formats"] = "the shipped folder (int8 experts); only the KV cache's element type changes"
        del record["formats"]
        compare(record, "kv_dtypes", args.kv_dtypes, lambda kv: evaluate(args.model, windows, token_bytes, kv))
    elif args.matmul_precisions is not None:
        require_gpu()
        record["bench"] = "matmul_precision_quality"
        record["source_of_formats"] = ("the shipped folder (int8 experts) on the GPU, KV cache bf16; only the matmul "
                                       "precision changes")
        del record["formats"]
        compare(record, "matmul_precisions", args.matmul_precisions,
                lambda precision: evaluate(args.model, windows, token_bytes, "bf16", "cuda", precision))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            formats = ["int8"] + [name for name in args.formats if name != "int8"]  # the reference first
            compare(record, "formats", formats, lambda name: recoded_result(source, args.model, Path(scratch),
                                                                                  name, windows, token_bytes))
    write_record(record, args.out)


def recoded_result(source: ModelFolder, model: Path, scratch: Path, name: str, windows: np.ndarray,
                   token_bytes: np.ndarray) -> dict:
    """The result of the expert format `name` (int8: the shipped folder), in a folder under `scratch` removed after."""
    folder = model if name == "int8" else recode_folder(source, scratch / name, FORMATS[name])
    result = {"codec": expert_codec(ModelFolder(folder).config).describe(), **evaluate(folder, windows, token_bytes)}
    if name != "int8":
        shutil.rmtree(folder)
    return result


def compare(record: dict, key: str, names: list[str], run) -> None:
    """record[key][name] = run(name) for each name (printed as it comes), each with its perplexity relative to the
    first name's (`perplexity_vs_<first>`)."""
    record[key] = {}
    for name in names:
        result = record[key][name] = run(name)
        print(name, json.dumps(result), flush=True)
    reference = record[key][names[0]]
    for result in record[key].values():
        result[f"perplexity_vs_{names[0]}"] = result["perplexity"] / reference["perplexity"] - 1


def write_record(record: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
