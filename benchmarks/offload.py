"""Decode and prefill with routed experts that do not all fit in GPU memory: GPU slots, pinned host memory (L2),
experts.bin (L3), experts computed on the CPU; next to the bounds of the bandwidths measured in the same run and
to transformers + accelerate offloading at the same GPU budget.

Model: a Mixtral-8x7B-shaped native model folder with random bf16 weights (`--layers`, default 8: 22.5 GB of
experts), written once by `write_synthetic_folder`. For each GPU expert budget (`--fractions` of all experts,
as whole slots per layer; 1.0 is the resident model), slot layout (`--slot-layout`: the same slots in every layer,
whole layers, or both, each budget run once per distinct layout) and source:
  l2  every expert in pinned host memory (PinnedExperts)
  l3  no host tier: experts.bin read for every GPU miss, page cache dropped before every timed step (cold)
modes (each a fresh store over the same pinned L2):
  colibri    the defaults: misses placed per expert and step by the cost model (cpu_experts auto), no prefetch
  ondemand   every miss loaded to the GPU when needed, no prefetch (the pure PCIe streaming strategy)
  cpu_only   every miss computed on the CPU (the pure CPU strategy)
  prefetch   next-layer prediction loading ahead on the copy stream, every miss to the GPU
Decode at `--batches` (greedy, after WARMUP steps, `--steps` timed steps, host synchronised every step, the step's
phases recorded by the model's StepTimer: phase_ms_per_step), prefill of one `--prefill`-token prompt.

llama.cpp (`--llama-bench`, a binary of benchmarks/build_llama_cpp.sh): llama-bench on the same weights as GGUF
(benchmarks/gguf_writer.py writes it next to the folder) with the routed experts of the layers not on the GPU on the
CPU (`--n-cpu-moe`), batch-1 decode and prefill, after Colibri's runs; without it, the earlier figures below.

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

from colibri_stream.config import GPU_SLOT_LAYOUTS
from colibri_stream.experts.placement import MIN_CUT_GAIN
from colibri_stream.experts.slots import layer_slot_counts
from colibri_stream.experts.tiers import kvikio_available

BLOCK_SIZE = 16
PROMPT = 32  # cached tokens per sequence before the timed decode steps
WARMUP = 2
# llama.cpp on the H200 machine and this shape, measured before this script could run it (8 layers, bf16, 16 threads,
# -ngl 99): batch-1 decode with every routed expert on the CPU (--n-cpu-moe 8) and with half the layers' experts
# there (--n-cpu-moe 4); prompt processing. --llama-bench replaces them with figures of the same run.
LLAMA_CPP = {0.0: {"decode_tok_s": 15.6, "prefill_tok_s": 148.0}, 0.5: {"decode_tok_s": 31.1, "prefill_tok_s": 317.0}}
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
    import cupy as cp

    del model
    cp.get_default_memory_pool().free_all_blocks()


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


def llama_cpp_baseline(args, records: list[dict]) -> None:
    """llama.cpp on this machine and these weights (benchmarks/llama_cpp.py): for each GPU budget that is a whole
    number of layers, llama-bench with the routed experts of the other layers on the CPU (--n-cpu-moe), batch-1
    decode and prefill, written into the batch-1 and prefill records of that budget."""
    from llama_cpp import llama_bench

    for fraction in args.fractions:
        cpu_layers = args.layers * (1 - fraction)
        if not float(cpu_layers).is_integer():
            continue
        try:
            result = llama_bench(args.llama_bench, args.gguf, round(cpu_layers), args.llama_threads,
                                 depth=PROMPT, prompt_tokens=args.prefill)
        except Exception as error:  # reported; the other budgets still run
            result = {"error": repr(error)}
        log(f"llama.cpp at {fraction:.0%}: decode {result.get('decode_tok_s')} prefill {result.get('prefill_tok_s')}")
        for record in records:
            if (record["gpu_expert_fraction"] == fraction and record["source"] == "l2"
                    and record["batch"] in (1, "prefill")):
                earlier = record.get("llama_cpp_tok_s")
                if earlier is not None:
                    record["llama_cpp_earlier_tok_s"] = earlier
                which = "prefill_tok_s" if record["batch"] == "prefill" else "decode_tok_s"
                record["llama_cpp_tok_s"] = result.get(which)
                record["llama_cpp_measured"] = True
                record["llama_cpp"] = result
        write(args.out, records)


def ensure_folder(path: str | Path, shape: str, layers: int, **options) -> Path:
    """`path`, where the random `shape` model (`layers` layers; `options`: write_synthetic_folder's expert format)
    is written first unless a whole folder is there (its config.json, written last)."""
    from colibri_stream.checkpoint import CONFIG_FILE
    from colibri_stream.synthetic import write_synthetic_folder

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        log(f"writing a random {shape} model with {layers} layers to {path}" + (f" {options}" if options else ""))
        begin = time.perf_counter()
        write_synthetic_folder(path, shape, num_layers=layers, **options)
        written = time.perf_counter()
        os.sync()  # the kernel's write-back of tens of GB must not run beside the timed steps
        log(f"written in {written - begin:.0f} s, on the drive {time.perf_counter() - written:.0f} s later")
    return path


def open_folder(path: str | Path, shape: str, layers: int, **options):
    """(ModelFolder, PinnedExperts holding all its experts) of the random `shape` model at `path`, written there
    first (`ensure_folder`) if it is not there yet."""
    from colibri_stream.checkpoint import ModelFolder
    from colibri_stream.experts.pinned import PinnedExperts
    from colibri_stream.experts.tiers import BlockReader

    folder = ModelFolder(ensure_folder(path, shape, layers, **options))
    reader = BlockReader(folder.experts, use_kvikio=kvikio_available())
    try:
        return folder, PinnedExperts(folder.experts, reader)
    finally:
        reader.close()  # it only fills the pinned blocks; an open file would keep a deleted folder's disk space


def run(args) -> list[dict]:
    from colibri_stream.experts.cpu_executor import CpuExpertExecutor, threads_beside_gpu

    folder, pinned = open_folder(args.folder, args.shape, args.layers)
    config = folder.config
    if args.llama_bench and not Path(args.gguf).is_file():
        from gguf_writer import write_gguf

        log(f"writing {args.gguf} for llama.cpp")
        write_gguf(args.folder, args.gguf, args.gguf_py)
    bw = measure(folder, pinned, args.cpu_threads)
    common = dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                  bench="offload", mode="hybrid", shape=args.shape, layers=args.layers,
                  cpu_threads=CpuExpertExecutor(args.cpu_threads or threads_beside_gpu()).num_threads,
                  bound_cpu_threads=CpuExpertExecutor(args.cpu_threads).num_threads,
                  expert_bytes=folder.experts.block_size, pcie_gbps_measured=bw.pcie_gbps,
                  host_read_gbps_measured=bw.host_read_gbps, disk_gbps_measured=bw.disk_gbps,
                  shared_host_read_gbps_measured=bw.shared_host_read_gbps,
                  shared_pcie_gbps_measured=bw.shared_pcie_gbps,
                  prompt_cached_tokens=PROMPT, decode_steps=args.steps, routing="random router (close to uniform)",
                  eviction="lfu", kvikio=kvikio_available(),
                  min_cut_gain=MIN_CUT_GAIN)
    records = []
    resident: dict = {}
    model = make_model(folder, None, None, "colibri")
    for batch in args.batches:
        resident[batch] = decode(model, batch, args.steps)
    resident["prefill"] = prefill(model, args.prefill)
    release(model)
    log("resident: " + ", ".join(f"b{k} {v['tok_s']:.1f} tok/s" for k, v in resident.items()))
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
                        model = make_model(folder, counts, host, mode, args.cpu_threads)
                        try:
                            steps = args.steps if source == "l2" else args.cold_steps
                            result = (prefill(model, args.prefill, cold) if batch == "prefill"
                                      else decode(model, batch, steps, cold))
                        except Exception as error:  # a failed configuration is reported, the others still run
                            result = {"error": repr(error)}
                            log(f"{fraction} {source} b{batch} {mode}: {error!r}")
                        release(model)
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
                reference = LLAMA_CPP.get(fraction)
                if reference and source == "l2" and batch in (1, "prefill"):
                    record["llama_cpp_tok_s"] = reference["prefill_tok_s" if batch == "prefill" else "decode_tok_s"]
                    record["llama_cpp_measured"] = False
                records.append(record)
                log(summary(record))
                write(args.out, records)
    if args.llama_bench:
        llama_cpp_baseline(args, records)
    host = pinned = None
    import cupy

    cupy.get_default_pinned_memory_pool().free_all_blocks()  # the baseline's process needs the host memory
    for fraction in args.accelerate_fractions:  # last: the slowest runs, and they need the memory back
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=8)
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
    parser.add_argument("--gguf", help="the model as GGUF for llama.cpp (default: the folder's path + .gguf); "
                        "written from the folder if missing, with --gguf-py")
    parser.add_argument("--gguf-py", help="gguf-py folder of the llama.cpp source tree")
    parser.add_argument("--llama-threads", type=int, default=16, help="llama.cpp's CPU threads")
    parser.add_argument("--out", default="benchmarks/results/offload_h200.json")
    args = parser.parse_args(argv)
    require_gpu()
    args.gguf = args.gguf or str(args.folder).rstrip("/") + ".gguf"
    if args.llama_bench and not Path(args.gguf).is_file() and not args.gguf_py:
        parser.error(f"--llama-bench needs {args.gguf}, or --gguf-py to write it")
    records = run(args)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
