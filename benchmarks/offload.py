"""Decode and prefill with routed experts that do not all fit in GPU memory: GPU slots, pinned host memory (L2),
experts.bin (L3), experts computed on the CPU; next to the bounds of the bandwidths measured in the same run and
to transformers + accelerate offloading at the same GPU budget.

Model: a native model folder of random bf16 weights of a published shape (`--shape`, default Mixtral-8x7B;
`--layers`, default 8: 22.5 GB of experts; `--dense-layers N`: N leading dense layers, the rest MoE, in place of
the shape's own split), long_context.py's `benchmark_config`, written once to `--folder` (quantized_files.py's
`ensure_shape_folder`; a folder there of another model is refused). For each GPU expert budget (`--fractions` of
all experts, as whole slots per layer; 1.0 is the resident model), slot layout (`--slot-layout`: the same slots
in every layer, whole layers, or both, each budget run once per distinct layout) and source:
  l2  every expert in pinned host memory (PinnedExperts)
  l3  no host tier: experts.bin read for every GPU miss, page cache dropped before every timed step (cold)
modes (each a fresh store over the same pinned L2):
  colibri    the defaults: misses placed per expert and step by the cost model (cpu_experts auto), no prefetch
  ondemand   every miss loaded to the GPU when needed, no prefetch (the pure PCIe streaming strategy)
  cpu_only   every miss computed on the CPU (the pure CPU strategy)
  prefetch   next-layer prediction loading ahead on the copy stream, every miss to the GPU
Decode at `--batches` (greedy, after WARMUP steps, `--steps` timed steps, host synchronised every step, the step's
phases recorded by the model's StepTimer: phase_ms_per_step), prefill of one `--prefill`-token prompt.

llama.cpp (`--llama-bench`, a binary of benchmarks/build_llama_cpp.sh; benchmarks/offload_llama.py): llama-bench
on the same weights as GGUF (benchmarks/gguf_writer.py writes it to `--gguf`, default next to the folder) with the
routed experts of the layers not on the GPU on the CPU (`--n-cpu-moe`), batch-1 decode and prefill, after
Colibri's runs, with the pinned experts given back first; without it, Mixtral's earlier figures (no other model
has any). llama.cpp places a layer's experts whole, so it runs only at the budgets whose host share is a whole
number of MoE layers (the others' records say so); the `layers` slot layout gives Colibri the same split (the last
MoE layers on the GPU, the first on the host).

DeepSeek-V3 (llama.cpp's deepseek2: latent attention, its cache of one 576-value row a layer, the shared expert and
the dense first layers on the GPU in both engines): 50 % of the experts as whole layers needs two MoE layers, so
1 dense + 2 MoE (51 GB a copy, 45 GB of it experts). The folder goes on the disk and the GGUF file on /dev/shm
(host RAM) where the disk cannot hold both; both files' bytes are predicted and the run is refused in one line
where they would not fit (long_context.py's `room_refusal`), and the pinning where the host's available memory
(the GGUF in /dev/shm taken) cannot hold the experts. The resident model is measured before the experts are
pinned (experts.bin still in the page cache), and the pinned experts are given back before llama.cpp runs
(host RAM then holds the GGUF, which llama.cpp maps):

    python benchmarks/offload.py --shape deepseek-v3 --layers 3 --dense-layers 1 \
        --folder /tmp/colibri-deepseek-v3-3-1 --gguf /dev/shm/colibri-deepseek-v3-3-1.gguf --fractions 0 0.5 \
        --batches 1 --sources l2 --modes colibri ondemand --slot-layout layers spread \
        --accelerate-fractions --llama-bench <build>/bin/llama-bench --gguf-py <llama.cpp>/gguf-py

`--write-only` writes the folder and, with `--gguf-py`, the GGUF file, and stops (no GPU needed: drawn on the GPU
where CuPy finds one), for a later run on the same machine to time.

Bounds: per step, the GPU misses the run measured (bytes) cannot arrive faster than the pinned copy bandwidth
(PCIe bound) or, when the CPU computes some, than the copy and the CPU expert read together (hybrid bound: their
rate measured running at once, as they share host RAM, or either alone where that is faster), and a
step cannot be faster than the resident model's step at the same batch; bound_tok_s = batch / max(resident step,
miss bytes / bandwidth), for colibri's own misses over PCIe and the CPU together; ondemand_bound_tok_s for the
on-demand run's misses over PCIe alone. For l3 the bandwidth is the cold disk read measured here (one read
stream, so the run's parallel kvikio reads can beat it).

    python benchmarks/offload.py --out benchmarks/results/offload_h200.json
"""

from __future__ import annotations

import argparse
from collections import Counter
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from conditions import require_gpu
from decode import log, machine, random_kv_cache
from offload_llama import EARLIER_LLAMA_CPP, llama_cpp_baseline
from long_context import PlannedFile, benchmark_config, folder_bytes, gguf_bytes, model_fields, room_refusal
from quantized_files import ensure_shape_folder

from colibri_stream.config import GPU_SLOT_LAYOUTS
from colibri_stream.experts.placement import MIN_CUT_GAIN
from colibri_stream.experts.slots import layer_slot_counts
from colibri_stream.experts.tiers import kvikio_available

BLOCK_SIZE = 16
PROMPT = 32  # cached tokens per sequence before the timed decode steps
WARMUP = 2
PIN_MARGIN = 4 << 30  # host memory left beside the pinned experts (this process, CUDA's own, the page cache's use)
MODES = {  # name: (prefetch, cpu_experts)
    "colibri": (False, "auto"),  # the defaults: misses placed by the cost model, no prefetch
    "ondemand": (False, "off"),  # every miss loaded to the GPU when needed: the pure PCIe strategy
    "cpu_only": (False, "all"),  # every miss computed on the CPU: the pure CPU strategy
    "prefetch": (True, "off"),  # next-layer prediction with loads on the copy stream
}


@dataclass
class Measured:
    pcie_gbps: float  # pinned host -> GPU
    host_read_gbps: float  # the CPU expert executor reading one expert block (all threads)
    disk_gbps: float  # experts.bin after dropping its pages from the page cache
    shared_host_read_gbps: float  # the CPU expert read while pinned copies run (both read host RAM) ...
    shared_pcie_gbps: float  # ... and the copies meanwhile

    @property
    def shared_gbps(self) -> float:
        return self.shared_host_read_gbps + self.shared_pcie_gbps


def drop_page_cache(path: Path) -> None:
    """Evict the file's (clean) pages from the page cache, so the next reads come from the drive."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(folder, pinned, threads: int | None) -> Measured:
    import cupy as cp

    from colibri_stream.experts.cpu_executor import CpuExpertExecutor
    from colibri_stream.experts.rates import cpu_expert_rates, pinned_copy_rate, shared_rates
    from colibri_stream.experts.tiers import BlockReader

    experts, layer, config = folder.experts, folder.config.moe_layers[0], folder.config
    block, copied = pinned.block(layer, 0), pinned.block(layer, 1)  # the copies read another block, as in a step
    device = cp.empty(block.nbytes, np.uint8)  # [block_size], the copies' destination
    pcie = pinned_copy_rate(block, device.data.ptr, cp.cuda.get_current_stream()) / 1e9
    executor = CpuExpertExecutor(threads)
    read, _ = cpu_expert_rates(executor, experts.unpack(block), 3 * config.hidden_size * config.moe_intermediate_size)
    host_read = read / 1e9
    shared_read, shared_pcie = (rate / 1e9 for rate in shared_rates(executor, experts.unpack(block), copied,
                                                                    device.data.ptr, cp.cuda.get_current_stream()))
    drop_page_cache(experts.path)
    reader = BlockReader(experts, use_kvikio=kvikio_available())
    buffer = np.empty_like(block)
    begin = time.perf_counter()
    count = min(4, folder.config.num_experts)
    for e in range(count):
        reader.read_into(folder.config.moe_layers[-1], e, buffer)
    disk = count * block.nbytes / (time.perf_counter() - begin) / 1e9
    log(f"measured: pinned host->GPU {pcie:.1f} GB/s, CPU expert read {host_read:.1f} GB/s "
        f"({executor.num_threads} threads, {executor.library}), both at once {shared_read:.1f} + {shared_pcie:.1f} "
        f"GB/s, cold experts.bin {disk:.2f} GB/s ({reader.library})")
    return Measured(pcie, host_read, disk, shared_read, shared_pcie)


def make_model(folder, slots: int | list[int] | None, host, mode: str, threads: int | None = None):
    """The model over `slots` GPU slots per layer (or each layer's count; None: every expert resident) fed from
    `host`, the CPU expert executor (modes that use it) on `threads` threads (None: the store's default, every core
    but one)."""
    from colibri_stream.backends.cupy_backend import CupyBackend
    from colibri_stream.experts.cpu_executor import CpuExpertExecutor, threads_beside_gpu
    from colibri_stream.experts.gpu_tier import GpuTieredStore
    from colibri_stream.experts.policies import make_policy
    from colibri_stream.experts.prefetcher import Prefetcher
    from colibri_stream.experts.store import MappedExpertStore
    from colibri_stream.experts.tiers import BlockReader
    from colibri_stream.model.transformer import MoETransformer

    config, experts = folder.config, folder.experts
    if slots is None:
        return MoETransformer(config, folder.dense, MappedExpertStore(experts), CupyBackend())
    prefetch, cpu_experts = MODES[mode]
    prefetcher = None
    if prefetch:
        prefetcher = Prefetcher([folder.dense.get(f"layers.{layer}.router") for layer in config.moe_layers],
                                config.top_k)
    policies = [make_policy("lfu", config.num_experts) for _ in config.moe_layers]
    executor = None if cpu_experts == "off" else CpuExpertExecutor(threads or threads_beside_gpu())
    store = GpuTieredStore(experts, slots, policies, host, BlockReader(experts, use_kvikio=kvikio_available()),
                           prefetcher, executor, cpu_experts)
    return MoETransformer(config, folder.dense, store, CupyBackend())


def release(model) -> None:
    """Drop `model` and give the GPU memory it held back (where the caller holds no other reference to it)."""
    del model
    free_device_memory()


def free_device_memory() -> None:
    """Give CuPy's cached GPU blocks and unused pinned host blocks back, a model's reference cycles collected first:
    for the next model, llama.cpp, or the accelerate baseline's process."""
    import gc

    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def decode(model, batch: int, steps: int, cold: Path | None = None) -> dict:
    """Timed greedy decode of `batch` sequences with PROMPT cached tokens (random keys and values)."""
    from colibri_stream.batch import flat_batch

    per_seq = -(-(PROMPT + WARMUP + steps + 1) // BLOCK_SIZE)
    kv = random_kv_cache(model, batch * per_seq, BLOCK_SIZE, seed=batch)
    tables = np.arange(batch * per_seq).reshape(batch, per_seq).tolist()
    tokens = np.random.default_rng(batch).integers(0, model.config.vocab_size, batch)
    before, seconds = None, 0.0
    phases: Counter = Counter()  # phase -> seconds over the timed steps (colibri_stream/timing.py)
    model.timer.add_sink(lambda record: phases.update(record.phase_seconds()) if before is not None else None)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            before = model.store.stats()
        if cold is not None:
            drop_page_cache(cold)
        forward = flat_batch([[int(t)] for t in tokens], [PROMPT + step] * batch, tables, [True] * batch,
                             BLOCK_SIZE)
        begin = time.perf_counter()
        with model.timer.phase("step"):
            tokens = model.forward(forward, kv).argmax(axis=1)
        if step >= WARMUP:
            seconds += time.perf_counter() - begin
    del kv
    return {"tok_s": batch * steps / seconds, "step_s": seconds / steps, **store_figures(model, before, steps),
            "phase_ms_per_step": {name: 1e3 * total / steps for name, total in sorted(phases.items())}}


def prefill(model, tokens: int, cold: Path | None = None) -> dict:
    """Seconds of one prompt of `tokens` tokens (the second of two runs)."""
    from colibri_stream.batch import flat_batch

    blocks = -(-tokens // BLOCK_SIZE)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, tokens).tolist()
    forward = flat_batch([ids], [0], [list(range(blocks))], [True], BLOCK_SIZE)
    model.forward(forward, kv)
    before = model.store.stats()
    if cold is not None:
        drop_page_cache(cold)
    begin = time.perf_counter()
    model.forward(forward, kv)
    seconds = time.perf_counter() - begin
    del kv
    return {"tok_s": tokens / seconds, "step_s": seconds, **store_figures(model, before, 1)}


def store_figures(model, before, steps: int) -> dict:
    """Per step: GPU misses, the bytes they moved, hit rate, prefetch recall, experts computed on the CPU (whole or
    cut by rows with the GPU: split) and the seconds inside the CPU expert executor."""
    if before is None:
        return {}
    after = model.store.stats()
    block = model.store.block_size
    gpu_after, gpu_before = after.tiers["gpu"], before.tiers["gpu"]
    hits, misses = gpu_after.hits - gpu_before.hits, gpu_after.misses - gpu_before.misses
    cpu = after.compute.cpu_experts - before.compute.cpu_experts
    split = after.compute.split_experts - before.compute.split_experts
    rates = getattr(model.store, "bandwidths", None)  # GPU slots: what the placement went on with at the end
    return {"gpu_hit_rate": hits / (hits + misses) if hits + misses else None,
            "gpu_misses_per_step": misses / steps, "miss_bytes_per_step": misses * block / steps,
            "cpu_experts_per_step": cpu / steps, "split_experts_per_step": split / steps,
            "cpu_seconds_per_step": (after.compute.cpu_seconds - before.compute.cpu_seconds) / steps,
            "prefetch_loads_per_step": (after.prefetch_loads - before.prefetch_loads) / steps,
            "prefetch_recall": after.prefetch_recall,
            "placement_host_read_gbps": rates.host_read / 1e9 if rates else None,
            "placement_h2d_gbps": rates.h2d / 1e9 if rates else None,
            "placement_cpu_gflops": rates.cpu_flops / 1e9 if rates else None}


def bound(batch: int, resident_step: float, miss_bytes: float, bandwidth_gbps: float) -> float:
    return batch / max(resident_step, miss_bytes / (bandwidth_gbps * 1e9))


def accelerate_baseline(args, fraction: float) -> dict:
    """transformers + accelerate offloading at the same GPU budget, in its own process (benchmarks/
    offload_accelerate.py), batch 1."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).with_name("offload_accelerate.py")), "--shape", args.shape,
                   "--layers", str(args.layers), "--gpu-expert-fraction", str(fraction), "--batch", "1",
                   "--new-tokens", str(args.accelerate_tokens), "--json", out.name]
        log("accelerate: " + " ".join(command[1:]))
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.accelerate_timeout)
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout)[-600:]}
        return json.loads(Path(out.name).read_text())


def shape_spec(args) -> str:
    """The model of the command line as long_context.py's --shapes entry: SHAPE:LAYERS or SHAPE:LAYERS:DENSE."""
    return f"{args.shape}:{args.layers}" + ("" if args.dense_layers is None else f":{args.dense_layers}")


def model_files(args, config) -> list[PlannedFile]:
    """The files of this run: the model folder and, where the run needs it (`--llama-bench`, or `--write-only`
    with `--gguf-py`), the GGUF file, each with its predicted bytes (long_context.py's folder_bytes, gguf_bytes)."""
    from colibri_stream.checkpoint import CONFIG_FILE

    folder, gguf = Path(args.folder), Path(args.gguf)
    files = [PlannedFile("folder", shape_spec(args), folder, folder_bytes(config), (folder / CONFIG_FILE).is_file())]
    if args.llama_bench or (args.write_only and args.gguf_py):
        files.append(PlannedFile("GGUF", shape_spec(args), gguf, gguf_bytes(config), gguf.is_file()))
    return files


def write_files(args, config) -> None:
    """This run's files (`model_files`) written where absent: the folder, then the GGUF from it. Refused in one
    line (SystemExit) where they would not fit (long_context.py's `room_refusal`), or where the folder at --folder
    holds another model than `config`."""
    from colibri_stream.checkpoint import read_config

    files = model_files(args, config)
    for f in files:
        log(f"{f.what}: {f.path}, {f.bytes / 1e9:.1f} GB" + (" (written already)" if f.present else ", to write"))
    refusal = room_refusal(files)
    if refusal:
        sys.exit(refusal)
    folder = ensure_shape_folder(args.folder, args.shape, args.layers, args.dense_layers)
    if read_config(folder) != config:
        sys.exit(f"{folder} holds another model than {shape_spec(args)}: another --folder, or remove it")
    gguf = next((f.path for f in files if f.what == "GGUF" and not f.present), None)
    if gguf is not None:
        from gguf_writer import write_gguf

        log(f"writing {gguf} for llama.cpp")
        gguf.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(folder, gguf, args.gguf_py)


def pin_experts(folder):
    """PinnedExperts holding every expert of `folder` (ModelFolder); MemoryError where the host's available memory
    (a GGUF file in /dev/shm takes some) less PIN_MARGIN cannot hold them."""
    from colibri_stream.experts.pinned import PinnedExperts
    from colibri_stream.experts.tiers import BlockReader
    from colibri_stream.memory import host_memory

    need = len(folder.config.moe_layers) * folder.config.num_experts * folder.experts.block_size
    available = host_memory().free
    if need + PIN_MARGIN > available:
        raise MemoryError(f"pinning {need / 1e9:.1f} GB of experts needs {PIN_MARGIN / 1e9:.0f} GB beside them; the "
                          f"host has {available / 1e9:.1f} GB available")
    reader = BlockReader(folder.experts, use_kvikio=kvikio_available())
    try:
        return PinnedExperts(folder.experts, reader)
    finally:
        reader.close()  # it only fills the pinned blocks; an open file would keep a deleted folder's disk space


def open_folder(path: str | Path, shape: str, layers: int, dense_layers: int | None = None, **options):
    """(ModelFolder, PinnedExperts holding all its experts) of the random `shape` model at `path` (`layers` layers,
    `dense_layers` of them leading dense ones where given), written there first (quantized_files.py's
    `ensure_shape_folder`, with write_synthetic_folder's expert format `options`) if it is not there yet."""
    from colibri_stream.checkpoint import ModelFolder

    folder = ModelFolder(ensure_shape_folder(path, shape, layers, dense_layers, **options))
    return folder, pin_experts(folder)


def resident_figures(args, folder) -> dict:
    """The resident model's (every expert on the GPU) decode at each of `--batches` and its prefill, by batch
    ("prefill"): the bounds' step times. Its model is gone when this returns."""
    model = make_model(folder, None, None, "colibri")
    figures = {batch: decode(model, batch, args.steps) for batch in args.batches}
    figures["prefill"] = prefill(model, args.prefill)
    return figures


def timed_case(args, folder, counts: list[int], host, mode: str, batch, cold: Path | None) -> dict:
    """One case on a model of its own (`make_model`: `counts` GPU slots per layer fed from `host`): decode of
    `batch` sequences, or the prefill (batch "prefill"); a failure is the case's error. The model is closed (its
    store's threads joined) and gone when this returns."""
    model = make_model(folder, counts, host, mode, args.cpu_threads)
    try:
        steps = args.steps if cold is None else args.cold_steps
        return prefill(model, args.prefill, cold) if batch == "prefill" else decode(model, batch, steps, cold)
    except Exception as error:  # a failed configuration is reported, the others still run
        log(f"{mode} {counts} b{batch}: {error!r}")
        return {"error": repr(error)}
    finally:
        try:
            model.close()
        except Exception as error:  # a failed step's CPU work can fail again here; the case has its error
            log(f"closing the {mode} store: {error!r}")


def run(args, config) -> list[dict]:
    from colibri_stream.checkpoint import ModelFolder
    from colibri_stream.experts.cpu_executor import CpuExpertExecutor, threads_beside_gpu

    folder = ModelFolder(args.folder)
    resident = resident_figures(args, folder)  # first: experts.bin is still in the page cache, pinning evicts it
    free_device_memory()
    log("resident: " + ", ".join(f"b{k} {v['tok_s']:.1f} tok/s" for k, v in resident.items()))
    pinned = pin_experts(folder)
    bw = measure(folder, pinned, args.cpu_threads)
    gguf = Path(args.gguf) if args.llama_bench else None
    common = dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                  bench="offload", mode="hybrid", shape=args.shape, layers=args.layers,
                  **model_fields(shape_spec(args), config, Path(args.folder), gguf),
                  cpu_threads=CpuExpertExecutor(args.cpu_threads or threads_beside_gpu()).num_threads,
                  bound_cpu_threads=CpuExpertExecutor(args.cpu_threads).num_threads,
                  expert_bytes=folder.experts.block_size, pcie_gbps_measured=bw.pcie_gbps,
                  host_read_gbps_measured=bw.host_read_gbps, disk_gbps_measured=bw.disk_gbps,
                  shared_host_read_gbps_measured=bw.shared_host_read_gbps,
                  shared_pcie_gbps_measured=bw.shared_pcie_gbps,
                  prompt_cached_tokens=PROMPT, decode_steps=args.steps, routing="random router (close to uniform)",
                  eviction="lfu", kvikio=kvikio_available(),
                  min_cut_gain=MIN_CUT_GAIN)
    earlier_llama_cpp = EARLIER_LLAMA_CPP.get((args.shape, args.layers), {}) if args.dense_layers is None else {}
    records = []
    plan = [(source, fraction) for source in args.sources
            for fraction in (args.fractions if source == "l2" else args.cold_fractions)]
    for source, fraction in plan:
        slots = round(fraction * config.num_experts)
        if slots >= config.num_experts and source != "l2":
            continue
        cold = folder.experts.path if source == "l3" else None
        host = pinned if source == "l2" else None
        batches = [*args.batches, "prefill"] if source == "l2" else [1]  # l3: decode at batch 1
        layouts: dict[tuple[int, ...], list[str]] = {}  # each layer's slots -> the layouts that give them
        for name in args.slot_layout:
            layouts.setdefault(tuple(layer_slot_counts(slots, len(config.moe_layers), config.num_experts, name)),
                               []).append(name)
        for counts, names in ((list(c), n) for c, n in layouts.items()):
            for batch in batches:
                record = dict(common, gpu_expert_fraction=fraction, gpu_slots_per_layer=slots,
                              gpu_slot_layout="/".join(names), gpu_slots=counts, source=source,
                              batch=batch, resident_tok_s=resident[batch]["tok_s"])
                modes = ["colibri"] if slots >= config.num_experts else (
                    list(args.modes) if batch == 1 else [m for m in ("colibri", "ondemand") if m in args.modes])
                if source == "l3":
                    modes = [m for m in modes if m in ("colibri", "ondemand")]
                for mode in modes:
                    if slots >= config.num_experts:
                        result = resident[batch]
                    else:
                        result = timed_case(args, folder, counts, host, mode, batch, cold)
                        free_device_memory()  # no case's model sits beside the next one's on the GPU
                    record[f"{mode}_tok_s"] = result.get("tok_s")
                    record[f"{mode}_figures"] = result
                figures = record["colibri_figures"]
                if "miss_bytes_per_step" in figures:
                    size = args.prefill if batch == "prefill" else batch
                    step = resident[batch]["step_s"]
                    link = bw.pcie_gbps if source == "l2" else bw.disk_gbps
                    record["gpu_hit_rate"] = figures["gpu_hit_rate"]
                    record["prefetch_recall"] = figures["prefetch_recall"]
                    record["pcie_bound_tok_s"] = bound(size, step, figures["miss_bytes_per_step"], link)
                    both = max(bw.shared_gbps, bw.pcie_gbps, bw.host_read_gbps) if source == "l2" else link
                    record["bound_tok_s"] = bound(size, step, figures["miss_bytes_per_step"], both)
                    ondemand = record.get("ondemand_figures", {})
                    if "miss_bytes_per_step" in ondemand:  # the pure PCIe (or disk) path against its own bound
                        record["ondemand_bound_tok_s"] = bound(size, step, ondemand["miss_bytes_per_step"], link)
                        record["ondemand_vs_bound"] = record["ondemand_tok_s"] / record["ondemand_bound_tok_s"]
                else:
                    record["bound_tok_s"] = resident[batch]["tok_s"]
                record["colibri_vs_bound"] = (record["colibri_tok_s"] or 0) / record["bound_tok_s"]
                reference = earlier_llama_cpp.get(fraction)
                if reference and source == "l2" and batch in (1, "prefill"):
                    record["llama_cpp_tok_s"] = reference["prefill_tok_s" if batch == "prefill" else "decode_tok_s"]
                    record["llama_cpp_measured"] = False
                records.append(record)
                log(summary(record))
                write(args.out, records)
    host = pinned = None
    free_device_memory()  # llama.cpp needs the GPU, the GGUF it maps and the baseline's process the host memory
    if args.llama_bench:
        llama_cpp_baseline(args, config, records, PROMPT, lambda: write(args.out, records))
    for fraction in args.accelerate_fractions:  # last: the slowest runs
        baseline = accelerate_baseline(args, fraction)
        for record in records:
            if record["batch"] == 1 and record["gpu_expert_fraction"] == fraction:
                record["accelerate_tok_s"] = baseline.get("decode_tok_s")
                record["accelerate"] = baseline
        log(f"accelerate at {fraction:.0%}: {baseline.get('decode_tok_s')} tok/s")
        write(args.out, records)
    return records


def summary(r: dict) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.1f}"

    return (f"{r['gpu_expert_fraction']:.0%} {r['gpu_slot_layout']} {r['source']} b{r['batch']}: "
            f"colibri {fmt(r.get('colibri_tok_s'))} "
            f"ondemand {fmt(r.get('ondemand_tok_s'))} prefetch {fmt(r.get('prefetch_tok_s'))} "
            f"cpu_only {fmt(r.get('cpu_only_tok_s'))} bound {fmt(r.get('bound_tok_s'))} "
            f"accelerate {fmt(r.get('accelerate_tok_s'))} llama.cpp {fmt(r.get('llama_cpp_tok_s'))} "
            f"hit {fmt(r.get('gpu_hit_rate'))}")


def table(records: list[dict]) -> str:
    lines = [("| GPU experts | layout | source | batch | Colibri tok/s | bound | Colibri / bound "
              "| on-demand (PCIe only) | prefetch | CPU only | accelerate | llama.cpp | GPU hit rate "
              "| CPU experts/step |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    for r in records:
        figures = r.get("colibri_figures", {})
        lines.append(f"| {r['gpu_expert_fraction']:.0%} | {r['gpu_slot_layout']} | {r['source']} | {r['batch']}"
                     f" | {fmt(r.get('colibri_tok_s'))}"
                     f" | {fmt(r.get('bound_tok_s'))} | {r['colibri_vs_bound']:.0%} | {fmt(r.get('ondemand_tok_s'))}"
                     f" | {fmt(r.get('prefetch_tok_s'))} | {fmt(r.get('cpu_only_tok_s'))}"
                     f" | {fmt(r.get('accelerate_tok_s'), 2)} | {fmt(r.get('llama_cpp_tok_s'))}"
                     f" | {fmt(r.get('gpu_hit_rate'), 2)} | {fmt(figures.get('cpu_experts_per_step'))} |")
    return "\n".join(lines)


def write(out: str, records: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(records, indent=1) + "\n")


def model_config(parser, args):
    """The ModelConfig of the command line (long_context.py's `benchmark_config`); parser.error's one line where
    there is none, it has no MoE layer, or accelerate's baseline is asked for a split it cannot build."""
    try:
        config = benchmark_config(args.shape, args.layers, args.dense_layers)
    except ValueError as error:
        parser.error(str(error))
    if not config.moe_layers:
        parser.error(f"{shape_spec(args)} has no MoE layer: --dense-layers sets the leading dense layers")
    if args.dense_layers is not None and args.accelerate_fractions:
        parser.error("offload_accelerate.py builds the shape's own split, not that of --dense-layers: give "
                     "--accelerate-fractions no value")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b", help="a colibri_stream.synthetic.SHAPES name")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dense-layers", type=int,
                        help="leading dense layers, the rest MoE (default: the shape's own; DeepSeek-V3's 3)")
    parser.add_argument("--folder", default="/tmp/colibri-offload-model")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--sources", nargs="+", default=["l2", "l3"], choices=["l2", "l3"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="modes measured at batch 1 (colibri and ondemand at larger batches and prefill)")
    parser.add_argument("--slot-layout", nargs="+", default=["spread"], choices=GPU_SLOT_LAYOUTS,
                        help="the GPU slots of each layer: the same number (spread) or whole layers; several: each "
                             "budget runs once per distinct slot count list (0 %% gives the same for both)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps (l2)")
    parser.add_argument("--cold-steps", type=int, default=3, help="timed decode steps with a cold page cache (l3)")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement")
    parser.add_argument("--cold-fractions", nargs="+", type=float, default=[0.25, 0.5],
                        help="GPU expert fractions measured with experts.bin as the only source (cold)")
    parser.add_argument("--accelerate-fractions", nargs="*", type=float, default=[0.25, 0.5])
    parser.add_argument("--accelerate-tokens", type=int, default=3)
    parser.add_argument("--accelerate-timeout", type=int, default=240)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="CPU expert executor threads (default: the store's, every core but one; the bound's "
                             "measurement: every core)")
    parser.add_argument("--llama-bench", help="llama-bench binary (benchmarks/build_llama_cpp.sh): llama.cpp on the "
                        "same weights and machine as the baseline of batch 1 and prefill, instead of earlier figures")
    parser.add_argument("--gguf", help="the model as GGUF for llama.cpp (default: the folder's path + .gguf; e.g. "
                        "/dev/shm/NAME.gguf where the disk cannot hold both); written from the folder if missing, "
                        "with --gguf-py")
    parser.add_argument("--gguf-py", help="gguf-py folder of the llama.cpp source tree")
    parser.add_argument("--llama-threads", type=int, default=16, help="llama.cpp's CPU threads")
    parser.add_argument("--write-only", action="store_true", help="write the folder and, with --gguf-py, the GGUF "
                        "file, and stop: a later run on this machine times them (no GPU needed)")
    parser.add_argument("--out", default="benchmarks/results/offload_h200.json")
    args = parser.parse_args(argv)
    config = model_config(parser, args)
    if not all(0 <= fraction <= 1 for fraction in args.fractions + args.cold_fractions):
        parser.error("GPU expert fractions are between 0 and 1")
    if not args.write_only:
        require_gpu()
    args.gguf = args.gguf or str(args.folder).rstrip("/") + ".gguf"
    if args.llama_bench and not Path(args.gguf).is_file() and not args.gguf_py:
        parser.error(f"--llama-bench needs {args.gguf}, or --gguf-py to write it")
    write_files(args, config)
    if args.write_only:
        return 0
    records = run(args, config)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
