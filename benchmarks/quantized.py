"""Decode and offload with quantized routed experts (int4, fp8, mxfp4): Colibri against llama.cpp, same GPU, one run.
Both engines hold the same weights, llama.cpp's quantized to its nearest format.

For each shape (`--shapes SHAPE:LAYERS`: random weights of the published dimensions, fewer layers), one shape at a
time (the 64 GB disk holds about one bf16 model folder and its GGUF copy), files under `--folder-root` (made by
quantized_files.py):
  1. the bf16 model folder (write_synthetic_folder of `ensure_shape_folder`'s model), on which Colibri's own bf16
     offload at 0 % runs first, batch 1 and prefill (the reference of the quantized offload; `--no-bf16-offload`
     skips it, and it runs only where offload cases do);
  2. its bf16 GGUF (gguf_writer.write_gguf; not for mxfp4, below); the bf16 folder is deleted, then llama-quantize
     writes one GGUF per llama format (int4: Q4_0, or `--llama-int4 Q4_K_M`; fp8 and int8: Q8_0; mxfp4 with
     `--llama-dense quantized`: MXFP4_MOE) with every tensor but the routed experts kept in bf16, as a Colibri
     folder keeps them (`--llama-dense quantized`: llama-quantize's own choice for them), and the bf16 GGUF is
     deleted. Before the bf16 folder is written for it, the folder and GGUF are predicted (long_context.py's
     folder_bytes, gguf_bytes): where both would not fit the free space at once, no llama.cpp file is made (its
     records say why) and Colibri's cases run alone;
  3. per format (`--formats`; int4: groups of `--group-size` input channels, symmetric unless `--zero-point`;
     fp8: a scale per 128x128 tile; mxfp4: e2m1 codes with an e8m0 exponent per 32 input channels), the Colibri
     folder of the same draws with quantized experts (write_synthetic_folder(expert_dtype=...)), then its cases
     below.
Files already there are reused (a folder with its config.json, a GGUF file: each written whole or not at all);
without `--keep` a shape's files are deleted after its cases. Disk use is logged after every file.

mxfp4 against MXFP4: llama.cpp's MXFP4 is the same format (OCP Microscaling: 32 e2m1 values and one e8m0
exponent, 17 bytes a block, 4.25 bits a weight). With `--llama-dense bf16` (the default) the GGUF is written from
Colibri's mxfp4 folder itself (`written_directly`: gguf_writer regroups the same codes and exponents into ggml's
blocks, every other matrix bf16), so both engines compute the very same weights, and no bf16 folder, bf16 GGUF or
llama-quantize run is needed: the disk holds the mxfp4 folder and its GGUF (about 2 x 0.45 GB a gpt-oss-20b layer,
2 x 1.7 GB a gpt-oss-120b layer, plus 2 x 2.3 GB of embedding and lm_head). With `--llama-dense quantized`,
llama-quantize's MXFP4_MOE of the bf16 GGUF: the expert stacks MXFP4 (ggml's own rounding of the bf16 draws) and
every other quantizable tensor Q8_0. The router (ffn_gate_inp), norms, biases and attention sinks are float32 in
every GGUF.

gpt-oss (`gpt-oss-20b`, `gpt-oss-120b`): llama.cpp always computes YaRN with truncate on, and gguf_writer refuses
the published truncate off, so the shape's model is long_context.py's `benchmark_config` (`needs_yarn_truncate`:
truncate on; a few rotary frequencies move, not any cost) for every file of the shape: the bf16 folder, its GGUF
and the quantized folders hold the same draws of one model (files named SHAPE-LAYERS-yarn-truncate-...; records
carry `yarn_truncate`). Its experts (biases, clamped SwiGLU) offload as any others: in GPU slots, the misses copied
or computed by the tiers' CPU worker with their biases. A decode-only run: `--gpu-fractions` with no value;
`--no-bf16-offload` skips the bf16 folder altogether (each gpt-oss-20b layer is 1.65 GB of bf16, a gpt-oss-120b one
6.4 GB). The roofline counts every layer's KV cache at the whole context (its sliding-window layers read at most 128
tokens: a little less than counted).

    python benchmarks/quantized.py --shapes gpt-oss-20b:24 --formats mxfp4 --batches 1 16 64 --gpu-fractions \
        --no-bf16-offload --llama-bin /tmp/llama-build/bin --gguf-py <llama.cpp>/gguf-py \
        --out benchmarks/results/quantized_h200_gpt_oss.json

Decode (bench "decode") at `--batches`: Colibri with every expert resident on the GPU, timed as decode.py times
colibri_tok_s (a captured CUDA graph per batch, each step launched before the host reads the previous step's ids,
DECODE steps after PROMPT cached tokens of random keys and values), after checking the graph's greedy tokens (with
and without programmatic launch, and launched ahead) against the eager step's; llama-batched-bench on the quantized
GGUF (the whole model on the GPU, PROMPT prompt tokens a sequence, DECODE steps). The engines alternate round by
round (`--repeats` rounds: Colibri at every batch, then llama.cpp at every batch); medians are reported. Roofline:
the bytes one step must read (dense weights and lm_head in bf16, the distinct experts each layer's routing touched,
measured, at the format's bytes: codes, scales and zero points; the bf16 KV cache: decode.py's step_bytes) over the
device-to-device copy bandwidth measured in this run.

Offload (bench "offload") at `--gpu-fractions` of each layer's experts in GPU slots, the others in pinned host
memory and placed per step by the cost model (offload.py's colibri mode): batch-1 decode and one prefill of
`--prefill` tokens (offload.py's decode and prefill, a fresh store each); llama-bench on the quantized GGUF with
the routed experts of the layers not on the GPU computed on the CPU (--n-cpu-moe: every layer at 0 %, half of
them at 50 %). Records at 0 % carry Colibri's bf16 figure of the same shape (vs_colibri_bf16). No fraction given:
no offload case and no record of one.

Records (bench, shape, layers, batch, expert_format, llama_format, colibri_tok_s, llama_tok_s, ratio, ...) go to
`--out` after every case; a case that fails records its error and the run goes on. `--time-budget` seconds: cases
that would start later are recorded as skipped. The Markdown table is printed at the end.

    python benchmarks/quantized.py --llama-bin /tmp/llama-build/bin --gguf-py <llama.cpp>/gguf-py \
        --out benchmarks/results/quantized_h200.json

Cost on the H200 host (16 cores, 64 GB disk), Mixtral-8x7B shape with 8 layers: the bf16 folder (23.7 GB) about
30 s, Colibri's bf16 offload 45 s, the bf16 GGUF 30 s, each llama-quantize 15-20 s, each quantized folder 35-40 s
(7.2 GB int4, 12.5 GB fp8), each format's decode 20 s and offload 40 s: about 6 minutes for int4 and fp8. The disk
peaks at the bf16 folder and its GGUF (47 GB). The Qwen3-30B-A3B shape with 16 layers (`--shapes
qwen3-30b-a3b:16`, 9.6 GB in bf16) is best run as a call of its own. gpt-oss-20b's costs are not measured yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from conditions import machine as host_machine
from conditions import require_gpu
from decode import DECODE, PROMPT, Colibri, log, machine, measure_bandwidth, step_bytes
from long_context import benchmark_config
from quantized_files import (ShapeFiles, attempt, bf16_pair_refusal, ensure_shape_folder, llama_format, llama_ggufs,
                             log_disk, nbytes, prepare_shape, remove, write_direct_gguf, write_options,
                             written_directly)

from colibri_stream.config import GPU_SLOT_LAYOUTS

DEFAULT_SHAPES = ("mixtral-8x7b:8",)
FORMATS = ("int4", "fp8", "int8", "mxfp4")
LLAMA_INT4 = ("Q4_0", "Q4_K_M")
LLAMA_TOOLS = ("llama-quantize", "llama-batched-bench", "llama-bench")


class Deadline:
    """`seconds` from now (0: never): the run's time budget, after which no new case starts."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def passed(self) -> bool:
        return bool(self.seconds) and time.monotonic() - self.start > self.seconds

    def skipped(self) -> str:
        return f"skipped: past --time-budget {self.seconds:.0f} s"


def expert_figures(config) -> dict:
    """The expert format in words and its bytes: what a step reads of one expert (codes, scales, zero points) and
    the aligned block that moves between tiers."""
    from colibri_stream.checkpoint import expert_block_layout
    from colibri_stream.expert_codecs import expert_codec

    slots, block = expert_block_layout(config)
    return {"expert_format": expert_codec(config).describe(), "expert_dtype": config.expert_dtype,
            "expert_bytes": sum(slot.nbytes for slot in slots), "expert_block_bytes": block}


def check_gpu_runs(config) -> None:
    """Raise, in one line, when the CuPy backend has no kernels for the folder's experts or options."""
    from colibri_stream.backends.cupy_backend import CupyBackend
    from colibri_stream.loader import check_expert_format, check_features

    check_expert_format(config, CupyBackend)
    check_features(config, CupyBackend)


def resident_model(folder):
    """The folder's model on the CuPy backend with every expert on the GPU (offload.py's resident model)."""
    from offload import make_model

    check_gpu_runs(folder.config)
    return make_model(folder, None, None, "colibri")


def dispose(model) -> None:
    """Stop the model's expert store and give its GPU memory back."""
    from offload import release

    attempt("closing the expert store", model.close)
    release(model)


# ----------------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------------


def colibri_decoders(model, batches: list[int], records: dict) -> dict:
    """batch -> a Colibri set up for it (graphs captured, greedy checks and distinct experts in its record);
    a batch that fails records its error."""
    colibris = {}
    for batch in batches:
        colibri = Colibri(model)

        def prepare(colibri=colibri, batch=batch):
            colibri.setup(batch)
            _, matches = colibri.greedy_checks()
            records[batch].update(matches, distinct_experts_per_layer=colibri.distinct_experts(),
                                  programmatic_launch=colibri.graph.programmatic,
                                  kv_bytes=colibri.kv.keys[0].itemsize)
            colibri.decode_ahead(2)  # warm-up
            # the device's time per step alone (graph replayed back to back) and the host's per synchronous step:
            # which of the two bounds the wall-clock figure
            records[batch].update(graph_replay_us=colibri.replay_seconds(colibri.graph) * 1e6,
                                  host_step_us=colibri.host_phases())

        _, error = attempt(f"Colibri batch {batch} setup", prepare)
        if error is None:
            colibris[batch] = colibri
        else:
            records[batch]["colibri_error"] = error
    return colibris


def decode_cases(args, folder_path: Path, gguf, base: dict, bandwidth: float, deadline: Deadline) -> list[dict]:
    """Decode records of one format: Colibri and llama.cpp alternating round by round at every batch."""
    from llama_cpp import batched_bench

    from colibri_stream.checkpoint import ModelFolder

    folder = ModelFolder(folder_path)
    config = folder.config
    common = dict(base, bench="decode", **expert_figures(config), hbm_gbps_measured=bandwidth,
                  prompt_tokens=PROMPT, decode_steps=DECODE, kv_cache="bf16, random values",
                  timing="wall clock, each step launched before the previous step's ids are read (decode.py)")
    records = {batch: dict(common, batch=batch, colibri_tok_s_runs=[], llama_tok_s_runs=[])
               for batch in args.batches}
    model, error = attempt("Colibri model", resident_model, folder)
    colibris = {} if model is None else colibri_decoders(model, args.batches, records)
    for record in records.values():
        record.setdefault("colibri_error", error)
    llama_error = gguf if isinstance(gguf, str) else None
    for round_ in range(args.repeats):
        if deadline.passed():
            for record in records.values():
                record["rounds_skipped"] = f"{args.repeats - round_} of {args.repeats}: {deadline.skipped()}"
            break
        for batch, colibri in list(colibris.items()):
            seconds, error = attempt(f"Colibri batch {batch}", lambda c=colibri: c.decode_ahead(DECODE)[0])
            if error is None:
                records[batch]["colibri_tok_s_runs"].append(batch * DECODE / seconds)
            else:
                records[batch]["colibri_error"] = error
                del colibris[batch]
        if llama_error is None:
            rows, llama_error = attempt("llama-batched-bench", batched_bench, Path(args.llama_bin) /
                                        "llama-batched-bench", gguf, args.batches, context=PROMPT,
                                        gen_tokens=DECODE, threads=args.threads, timeout=args.llama_timeout)
            for batch, row in (rows or {}).items():
                if batch in records:
                    records[batch]["llama_tok_s_runs"].append(row["decode_tok_s"])
                    records[batch]["llama_command"] = row["command"]
        log(f"round {round_ + 1}: " + ", ".join(
            f"b{b} Colibri {r['colibri_tok_s_runs'][-1:]} llama.cpp {r['llama_tok_s_runs'][-1:]}"
            for b, r in records.items()))
    for batch, record in records.items():
        finish_decode(record, config, batch, bandwidth, llama_error)
    if 1 in colibris and not deadline.passed():  # where batch 1's step goes, operation by operation
        records[1]["op_profile"], records[1]["op_profile_error"] = attempt(
            "profile at batch 1", colibris[1].profile, 1, PROMPT + DECODE // 2, [], records[1]["expert_bytes"])
        log("batch 1, us a layer: " + ", ".join(f"{op['op']} {op['us_per_layer']:.1f}"
                                              for op in records[1]["op_profile"] or []))
    for colibri in colibris.values():
        colibri.release()
    if model is not None:
        dispose(model)
    folder.experts.close()
    return list(records.values())


def finish_decode(record: dict, config, batch: int, bandwidth: float, llama_error: str | None) -> None:
    """Medians, the ratio and the roofline of one decode record."""
    ours, theirs = record["colibri_tok_s_runs"], record["llama_tok_s_runs"]
    record["colibri_tok_s"] = statistics.median(ours) if ours else None
    record["llama_tok_s"] = statistics.median(theirs) if theirs else None
    record["llama_error"] = None if theirs else llama_error
    record["ratio"] = ratio(record["colibri_tok_s"], record["llama_tok_s"])
    distinct = record.get("distinct_experts_per_layer")
    if distinct is not None:
        context = PROMPT + DECODE // 2
        step = step_bytes(config, batch, distinct, context, record["kv_bytes"], record["expert_bytes"])
        roofline = batch * bandwidth * 1e9 / step
        record.update(bytes_per_step=step, mean_context=context, roofline_tok_s=roofline,
                      roofline_fraction=ratio(record["colibri_tok_s"], roofline),
                      llama_roofline_fraction=ratio(record["llama_tok_s"], roofline))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# ----------------------------------------------------------------------------------------------------------------
# Offload
# ----------------------------------------------------------------------------------------------------------------


def colibri_offload(args, folder, pinned, fraction: float) -> dict:
    """{1: batch-1 decode figures, "prefill": prefill figures} with `fraction` of each layer's experts in GPU
    slots (offload.py's decode and prefill, each on a fresh store), or the error of each."""
    from offload import decode, make_model, prefill

    from colibri_stream.experts.slots import layer_slot_counts

    config = folder.config
    slots = round(fraction * config.num_experts)
    counts = None if slots >= config.num_experts else layer_slot_counts(slots, len(config.moe_layers),
                                                                        config.num_experts, args.slot_layout)
    results = {}
    for batch in (1, "prefill"):
        def measure(batch=batch):
            check_gpu_runs(config)
            model = make_model(folder, counts, pinned, "colibri")
            try:
                return prefill(model, args.prefill) if batch == "prefill" else decode(model, 1, args.steps)
            finally:
                dispose(model)

        figures, error = attempt(f"Colibri offload {fraction:.0%} {batch}", measure)
        results[batch] = figures or {"error": error}
    return results | {"gpu_slots": counts}


def llama_offload(args, gguf, n_cpu_moe: int) -> tuple[dict | None, str | None]:
    """llama-bench's batch-1 decode and prefill of `gguf` with the experts of `n_cpu_moe` layers on the CPU, and the
    error (a `gguf` that is text is the reason it was not made)."""
    from llama_cpp import llama_bench
    from offload import PROMPT as OFFLOAD_PROMPT

    if isinstance(gguf, str):
        return None, gguf
    return attempt(f"llama-bench --n-cpu-moe {n_cpu_moe}", llama_bench, Path(args.llama_bin) / "llama-bench", gguf,
                   n_cpu_moe, args.threads, depth=OFFLOAD_PROMPT, prompt_tokens=args.prefill,
                   timeout=args.llama_timeout)


def offload_cases(args, folder_path: Path, gguf, base: dict, shape: str, layers: int, fractions: list[float],
                  deadline: Deadline) -> list[dict]:
    """Offload records of one folder at each GPU fraction: Colibri, then llama-bench on `gguf` (a path; text: why
    there is none)."""
    from offload import PROMPT as OFFLOAD_PROMPT
    from offload import open_folder

    from colibri_stream.checkpoint import ModelFolder

    opened, pin_error = attempt("pinned experts", open_folder, folder_path, shape, layers)
    folder, pinned = opened or (ModelFolder(folder_path), None)
    common = dict(base, bench="offload", **expert_figures(folder.config), slot_layout=args.slot_layout,
                  mode="colibri (cost model placement, no prefetch)", prompt_cached_tokens=OFFLOAD_PROMPT,
                  decode_steps=args.steps, prefill_tokens=args.prefill)
    records = []
    for fraction in fractions:
        pair = {batch: dict(common, batch=batch, gpu_fraction=fraction) for batch in (1, "prefill")}
        if deadline.passed():
            for record in pair.values():
                record["colibri_error"] = record["llama_error"] = deadline.skipped()
            records += pair.values()
            continue
        ours = ({1: {"error": pin_error}, "prefill": {"error": pin_error}, "gpu_slots": None} if pinned is None
                else colibri_offload(args, folder, pinned, fraction))
        n_cpu_moe = round(layers * (1 - fraction))
        theirs, llama_error = llama_offload(args, gguf, n_cpu_moe)
        for batch, record in pair.items():
            figures = ours[batch]
            which = "prefill_tok_s" if batch == "prefill" else "decode_tok_s"
            record.update(gpu_slots=ours["gpu_slots"], colibri_tok_s=figures.get("tok_s"),
                          colibri_error=figures.get("error"), colibri_figures=figures, llama_n_cpu_moe=n_cpu_moe,
                          llama_tok_s=(theirs or {}).get(which), llama_error=llama_error, llama=theirs)
            record["ratio"] = ratio(record["colibri_tok_s"], record["llama_tok_s"])
            log(f"offload {record['expert_dtype']} {fraction:.0%} {batch}: Colibri {record['colibri_tok_s']} "
                f"llama.cpp {record['llama_tok_s']}")
        records += pair.values()
    folder.experts.close()
    del pinned, opened
    cupy = sys.modules.get("cupy")  # loaded wherever pinned host memory was taken
    if cupy is not None:
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return records


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


def bf16_reference(args, files: ShapeFiles, base: dict, shape: str, layers: int, deadline: Deadline) -> list[dict]:
    """Colibri's offload records of the bf16 folder at 0 % (no llama.cpp run), or one record of why not."""
    from colibri_stream.checkpoint import CONFIG_FILE

    if not (files.bf16_folder / CONFIG_FILE).is_file():
        return [dict(base, bench="offload", expert_dtype="bfloat16", expert_format="bfloat16", gpu_fraction=0.0,
                     colibri_error="no bf16 folder (its writing failed)")]
    return offload_cases(args, files.bf16_folder, "not run for the bf16 reference", base, shape, layers, [0.0],
                         deadline)


def format_cases(args, files: ShapeFiles, name: str, gguf, keyed: dict, shape: str, layers: int, bandwidth: float,
                 deadline: Deadline, bf16: dict) -> list[dict]:
    """The decode and offload records of one format: its Colibri folder written if missing, its cases (offload: at
    each of --gpu-fractions, none without them), the folder deleted after them unless --keep."""
    options = write_options(name, args)
    path = files.folder(options)
    begin = time.perf_counter()
    _, error = attempt(f"{name} folder", ensure_shape_folder, path, shape, layers, **options)
    keyed["preparation"].setdefault("colibri_folder_s", {})[name] = time.perf_counter() - begin
    log_disk(files.root, f"{path.name} {nbytes(path) / 1e9:.1f} GB")
    if error is not None:
        return [dict(keyed, expert_dtype=options["expert_dtype"], colibri_error=error)]
    if written_directly(name, args) and isinstance(gguf, Path) and not gguf.is_file():
        _, error = attempt(f"{name} GGUF", write_direct_gguf, args, files, path, gguf, keyed["preparation"])
        gguf = gguf if error is None else f"the GGUF of the {name} folder: {error}"
        keyed["llama_gguf_bytes"] = nbytes(gguf) if error is None else None
    records, error = attempt(f"{name} decode", decode_cases, args, path, gguf, keyed, bandwidth, deadline)
    records = records or [dict(keyed, bench="decode", expert_dtype=options["expert_dtype"], error=error)]
    if not args.gpu_fractions:
        offloaded = []
    else:
        offloaded, error = attempt(f"{name} offload", offload_cases, args, path, gguf, keyed, shape, layers,
                                   args.gpu_fractions, deadline)
        offloaded = offloaded or [dict(keyed, bench="offload", expert_dtype=options["expert_dtype"], error=error)]
    for record in offloaded:
        if record.get("gpu_fraction") == 0 and bf16.get(record.get("batch")):
            record["colibri_bf16_tok_s"] = bf16[record["batch"]]
            record["vs_colibri_bf16"] = ratio(record.get("colibri_tok_s"), bf16[record["batch"]])
        records.append(record)
    if not args.keep:
        remove(path, files.root)
    return records


def run_shape(args, spec: str, common: dict, bandwidth: float, deadline: Deadline, records: list[dict]) -> None:
    """Every case of one SHAPE:LAYERS, its files made first (module docstring) and deleted after unless --keep.
    Colibri's bf16 offload runs only where offload cases do (--gpu-fractions given);
    llama.cpp's files are not made when the bf16 folder and GGUF would not fit the disk together."""
    shape, layers = spec.split(":")[0], int(spec.split(":")[1])
    root = Path(args.folder_root)
    root.mkdir(parents=True, exist_ok=True)
    files = ShapeFiles(root, shape, layers, args.llama_dense)
    config = benchmark_config(shape, layers)
    prep: dict = {}  # seconds each file took to make
    base = dict(common, shape=shape, layers=layers, llama_dense=args.llama_dense, preparation=prep,
                yarn_truncate=config.rope.truncate if config.rope.type == "yarn" else None)
    llama_formats = sorted({llama_format(name, args) for name in args.formats})
    quantized_formats = sorted({llama_format(name, args) for name in args.formats if not written_directly(name, args)})
    log_disk(root, f"{shape} ({layers} layers)")
    llama_needs_bf16 = bool(args.llama_bin) and not files.bf16_gguf.is_file() and not all(
        files.gguf(fmt).is_file() for fmt in quantized_formats)
    too_big = bf16_pair_refusal(files, config) if llama_needs_bf16 else None
    bf16_offload = args.bf16_offload and bool(args.gpu_fractions)
    if bf16_offload or (llama_needs_bf16 and too_big is None):
        begin = time.perf_counter()
        attempt("bf16 folder", ensure_shape_folder, files.bf16_folder, shape, layers)
        prep["bf16_folder_s"] = time.perf_counter() - begin
        log_disk(root, f"bf16 folder {nbytes(files.bf16_folder) / 1e9:.1f} GB")
    if bf16_offload:
        reference, error = attempt("bf16 offload", bf16_reference, args, files, base, shape, layers, deadline)
        records += reference or [dict(base, bench="offload", expert_dtype="bfloat16", error=error)]
        write(args.out, records)
    bf16 = {r["batch"]: r.get("colibri_tok_s") for r in records if r.get("shape") == shape
            and r.get("expert_dtype") == "bfloat16" and r.get("gpu_fraction") == 0 and "batch" in r}
    if not args.llama_bin:
        ggufs = {fmt: f"not run: {args.llama_missing}" for fmt in llama_formats}
    else:  # the formats written from Colibri's folders are written with them (format_cases)
        ggufs = {fmt: files.gguf(fmt) for fmt in llama_formats}
        if too_big is not None:
            ggufs |= {fmt: f"not run: {too_big}" for fmt in quantized_formats}
        else:
            ggufs |= llama_ggufs(args, files, shape, layers, quantized_formats, prep)
    remove(files.bf16_folder, root)
    for name in args.formats:
        fmt = llama_format(name, args)
        keyed = dict(base, llama_format=fmt, llama_gguf=str(files.gguf(fmt)),
                     llama_gguf_bytes=nbytes(files.gguf(fmt)) or None)
        if deadline.passed():
            records.append(dict(keyed, expert_dtype=name, error=deadline.skipped()))
        else:
            records += format_cases(args, files, name, ggufs[fmt], keyed, shape, layers, bandwidth, deadline, bf16)
        write(args.out, records)
    if not args.keep:
        for fmt in llama_formats:
            remove(files.gguf(fmt), root)


def write(out: str, records: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(records, indent=1, default=str) + "\n")


def table(records: list[dict]) -> str:
    def cell(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| shape | bench | experts | llama.cpp | batch | GPU experts | Colibri tok/s | llama.cpp tok/s "
             "| Colibri / llama.cpp | roofline tok/s | Colibri / roofline | Colibri / bf16 | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        errors = "; ".join(f"{k}: {str(r[k])[:60]}" for k in ("error", "colibri_error", "llama_error", "skipped")
                           if r.get(k))
        fraction = r.get("gpu_fraction")
        experts = r.get("expert_format") or r.get("expert_dtype")
        lines.append(
            f"| {r.get('shape')} ({r.get('layers')}) | {r.get('bench', '-')} | {experts} "
            f"| {r.get('llama_format') or '-'} | {r.get('batch', '-')} "
            f"| {'-' if fraction is None else f'{fraction:.0%}'} | {cell(r.get('colibri_tok_s'))} "
            f"| {cell(r.get('llama_tok_s'))} | {cell(r.get('ratio'), 2)} | {cell(r.get('roofline_tok_s'), 0)} "
            f"| {cell(r.get('roofline_fraction'), 2)} | {cell(r.get('vs_colibri_bf16'), 2)} | {errors} |")
    return "\n".join(lines)


def hbm_bandwidth() -> float:
    """The GPU's device-to-device copy bandwidth in GB/s, bytes read plus written (decode.py's measure)."""
    import cupy

    return measure_bandwidth(cupy)


def llama_missing(args) -> str | None:
    """Why llama.cpp cannot run (no --llama-bin, a tool missing from it, no gguf-py), or None."""
    if not args.llama_bin:
        return "no --llama-bin"
    missing = [tool for tool in LLAMA_TOOLS if not (Path(args.llama_bin) / tool).is_file()]
    if missing:
        return f"--llama-bin {args.llama_bin} lacks {', '.join(missing)} (benchmarks/build_llama_cpp.sh)"
    if not (args.gguf_py and (Path(args.gguf_py) / "gguf").is_dir()):
        return "no --gguf-py (the gguf-py folder of the llama.cpp source tree) to write the GGUF with"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help="SHAPE:LAYERS entries (mixtral-8x7b:8, qwen3-30b-a3b:16, gpt-oss-20b:14), run one "
                             "after the other")
    parser.add_argument("--formats", nargs="+", default=["int4", "fp8"], choices=FORMATS)
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help="int4's group size")
    parser.add_argument("--zero-point", action="store_true", help="int4 with zero points (asymmetric)")
    parser.add_argument("--llama-int4", default="Q4_0", choices=LLAMA_INT4, help="llama.cpp's format for int4")
    parser.add_argument("--llama-dense", default="bf16", choices=("bf16", "quantized"),
                        help="llama.cpp's tensors other than the routed experts: bf16 as Colibri's, or quantized "
                             "as llama-quantize chooses for the format")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3, help="decode rounds, the two engines alternating")
    parser.add_argument("--gpu-fractions", nargs="*", type=float, default=[0.0, 0.5],
                        help="fractions of each layer's experts in GPU slots, an offload case each; none (the "
                             "option without values): decode only")
    parser.add_argument("--slot-layout", default="spread", choices=GPU_SLOT_LAYOUTS)
    parser.add_argument("--steps", type=int, default=8, help="timed offloaded decode steps")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the offloaded prefill")
    parser.add_argument("--no-bf16-offload", dest="bf16_offload", action="store_false",
                        help="skip Colibri's bf16 offload at 0 %% (the reference of the quantized offload; never "
                             "run without --gpu-fractions)")
    parser.add_argument("--llama-bin", help="folder of llama-quantize, llama-batched-bench and llama-bench "
                        "(benchmarks/build_llama_cpp.sh); none: Colibri only")
    parser.add_argument("--gguf-py", help="gguf-py folder of the llama.cpp source tree (writes the bf16 GGUF)")
    parser.add_argument("--threads", type=int, default=16, help="llama.cpp's CPU threads")
    parser.add_argument("--llama-timeout", type=float, default=300.0, help="seconds for one llama.cpp command")
    parser.add_argument("--folder-root", default="/tmp/colibri-quantized")
    parser.add_argument("--keep", action="store_true", help="keep each shape's quantized files for a later run "
                        "(mind the disk: Mixtral's take about 40 GB)")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds after which no new case starts (recorded as skipped); 0: no limit")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write each shape's files (quantized_files.py's prepare_shape) and keep them; nothing "
                             "timed, no GPU or llama.cpp binaries needed: run while llama.cpp builds, then the same "
                             "options again")
    parser.add_argument("--out", default="benchmarks/results/quantized_h200.json")
    args = parser.parse_args(argv)
    if args.prepare_only:
        for spec in args.shapes:
            attempt(f"preparing {spec}", prepare_shape, args, spec)
        return 0
    args.llama_missing = llama_missing(args)
    if args.llama_missing:
        log(f"llama.cpp not run: {args.llama_missing}")
        args.llama_bin = None
    require_gpu()
    deadline = Deadline(args.time_budget)
    bandwidth = hbm_bandwidth()
    log(f"device-to-device copy: {bandwidth:.0f} GB/s")
    common = dict(host_machine(), **machine(), command=" ".join(sys.argv), routing="random router (close to uniform)",
                  llama_cpp=args.llama_missing or f"{args.llama_bin}, {args.threads} threads")
    records: list[dict] = []
    for spec in args.shapes:
        _, error = attempt(spec, run_shape, args, spec, common, bandwidth, deadline, records)
        if error is not None:
            records.append(dict(common, shape=spec, error=error))
        write(args.out, records)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
