"""Decode throughput on one GPU: Colibri (CuPy kernels, one CUDA graph per batch size) against transformers eager,
next to the memory-bandwidth roofline measured in the same run.

For each shape (random weights of the published dimensions, fewer layers so both engines fit side by side) and
batch size: every sequence has PROMPT tokens of random keys and values in its KV cache, then DECODE greedy steps
are timed (wall clock, every step's ids read on the host: what a caller sees), Colibri and transformers
alternating run by run; the median of REPEATS runs is reported. Colibri's figure runs its steps as the engine does
(async scheduling: step t+1 is launched before the host reads step t's ids, which it takes on the device);
`colibri_sync_tok_s` reads each step's ids before launching the next. Before timing, the captured step's greedy
tokens, both ways, are checked against Colibri's eager step on the same inputs.

Roofline: the bytes one decode step must read (every dense weight, the whole lm_head, the distinct experts that
the step's routing touched, measured, and the bf16 KV cache) over the device-to-device copy bandwidth measured
here (bytes read plus written). Each graph is timed with and without programmatic dependent launch
(backends/launch.py), interleaved, and replayed back to back (the device's time per step, without the host's work
between steps); a synchronous step is also split into building the batch, enqueueing it and waiting for the
ids. A per-operation profile (each operation replayed from a CUDA graph, cycling
through the layers so weights do not stay in L2) shows where a step's time goes.

    python benchmarks/decode.py --out benchmarks/results/decode_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from conditions import constants_set, require_gpu
from offload_accelerate import hf_config

PROMPT = 128  # cached tokens per sequence before the timed steps
DECODE = 32  # timed decode steps per run
REPEATS = 3  # runs of each engine, interleaved
CHECK_STEPS = 4  # eager-versus-graph greedy check before timing
BLOCK_SIZE = 16
DEFAULT_LAYERS = {"mixtral-8x7b": 8, "qwen3-30b-a3b": 16}
WEIGHT_BYTES = 2  # bf16


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def tuning_set(name: str, value: int):
    """A constant of backends/tuning.py set to `value` meanwhile, in every GPU backend module that uses it."""
    from colibri_stream.backends import cupy_backend, cupy_launch, cupy_moe, cupy_quant_moe, tuning

    return constants_set((tuning, cupy_backend, cupy_moe, cupy_quant_moe, cupy_launch), **{name: value})


def random_kv_cache(model, num_blocks: int, block_size: int, seed: int):
    """`model`'s (CuPy) KV cache in its default dtype, every key and value a normal draw rounded to that dtype:
    attention is never timed on zeros."""
    kv = model.allocate_kv_cache(num_blocks, block_size)
    state = model.backend.cp.random.RandomState(seed)
    for array in kv.keys + kv.values:
        array[...] = model.backend.from_float32(state.standard_normal(array.shape, dtype=np.float32), kv.dtype)
    return kv


def measure_bandwidth(cp) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus written), median of 20 copies of 2 GiB."""
    src = cp.random.random(1 << 29, dtype=np.float32)  # [2 GiB / 4]
    dst = cp.empty_like(src)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for n in range(23):
        start.record()
        dst.data.copy_from_device(src.data, src.nbytes)
        end.record()
        end.synchronize()
        if n >= 3:
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * (1 << 31) / statistics.median(times) / 1e9


def graph_replay_seconds(graph, replays: int) -> float:
    """Seconds per replay of a captured DecodeGraph back to back, with the inputs it holds (one warm replay first)."""
    graph.graph.launch(stream=graph.stream)
    graph.stream.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.graph.launch(stream=graph.stream)
    graph.stream.synchronize()
    return (time.perf_counter() - start) / replays


def time_in_graph(cp, fn, calls: int = 32, replays: int = 5) -> float:
    """GPU seconds per call of fn(i), from a CUDA graph of `calls` calls replayed `replays` times."""
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with stream:
        fn(0)
        stream.synchronize()
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            for i in range(calls):
                fn(i)
            graph = stream.end_capture()
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / (calls * replays)


class Colibri:
    """A model on the CuPy backend (every expert resident) with its KV cache, block tables and decode graph for one
    batch; several may share one model, each set up for its own batch."""

    def __init__(self, model):
        self.model = model
        self.config = self.model.config
        self.backend = self.model.backend
        self.cp = self.backend.cp

    @classmethod
    def synthetic(cls, shape: str, layers: int) -> Colibri:
        """The random-weight model of `shape` with `layers` layers, drawn on the GPU."""
        from colibri_stream.synthetic import synthetic_model

        return cls(synthetic_model(shape, num_layers=layers, device="cuda"))

    def setup(self, batch: int) -> None:
        from colibri_stream.cuda_graph import DecodeGraph

        per_seq = -(-(PROMPT + DECODE + 1) // BLOCK_SIZE)
        self.kv = random_kv_cache(self.model, batch * per_seq, BLOCK_SIZE, seed=batch)
        self.tables = np.random.default_rng(batch).permutation(batch * per_seq).reshape(batch, per_seq)
        self.graph = DecodeGraph(self.model, self.kv, batch, per_seq)  # programmatic launches where the GPU has them
        self.graph_without_pdl = DecodeGraph(self.model, self.kv, batch, per_seq, programmatic=False)
        self.first_tokens = np.random.default_rng(batch + 1).integers(0, self.config.vocab_size, batch)

    def step_batch(self, tokens: np.ndarray, step: int):
        from colibri_stream.batch import ForwardBatch

        b = len(tokens)
        positions = np.full(b, PROMPT + step, np.int64)
        rows = np.arange(b)
        return ForwardBatch(
            token_ids=tokens.astype(np.int64), positions=positions, query_start=np.arange(b + 1, dtype=np.int64),
            context_lens=positions + 1, block_tables=self.tables,
            slot_mapping=self.tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
            logits_indices=np.arange(b, dtype=np.int64))

    def greedy_checks(self) -> tuple[list[np.ndarray], dict[str, bool]]:
        """The eager step's greedy tokens over CHECK_STEPS steps, and whether the decode graph's (with and without
        programmatic launch) and the steps launched ahead give the same tokens."""
        _, eager = self.decode(CHECK_STEPS, graph=False)
        runs = {"greedy_graph_matches_eager": self.decode(CHECK_STEPS)[1],
                "greedy_graph_without_pdl_matches_eager": self.decode(CHECK_STEPS, self.graph_without_pdl)[1],
                "greedy_ahead_matches_eager": self.decode_ahead(CHECK_STEPS)[1]}
        return eager, {key: all(np.array_equal(a, b) for a, b in zip(eager, tokens)) for key, tokens in runs.items()}

    def decode(self, steps: int, graph=True) -> tuple[float, list[np.ndarray]]:
        """Seconds for `steps` greedy steps from position PROMPT on, and the tokens. `graph`: True for the decode
        graph, False for the eager step, or a DecodeGraph."""
        graph = self.graph if graph is True else graph
        tokens, out = self.first_tokens, []
        self.cp.cuda.Device().synchronize()
        start = time.perf_counter()
        for step in range(steps):
            batch = self.step_batch(tokens, step)
            tokens = graph.greedy(batch) if graph else self.model.forward(batch, self.kv).argmax(axis=1)
            out.append(tokens)
        return time.perf_counter() - start, out

    def decode_ahead(self, steps: int) -> tuple[float, list[np.ndarray]]:
        """`decode` as the engine runs greedy steps (async scheduling): each step is launched before the host reads
        the previous step's ids, and takes them as its tokens on the device."""
        graph, b = self.graph, len(self.first_tokens)
        fed, none = np.arange(b, dtype=np.int64), np.full(b, -1, np.int64)  # feed rows: every row, no row
        out = []
        self.cp.cuda.Device().synchronize()
        start = time.perf_counter()
        pending = graph.launch(self.step_batch(self.first_tokens, 0), none)
        for step in range(1, steps):
            following = graph.launch(self.step_batch(none, step), fed)  # token ids unknown on the host: -1
            out.append(pending.wait())
            pending = following
        out.append(pending.wait())
        return time.perf_counter() - start, out

    def host_phases(self, steps: int = DECODE) -> dict:
        """Where a synchronous graph step's wall time goes, in microseconds per step (means): building the batch
        (step_batch), enqueueing it (inputs copied, graph launched: DecodeGraph.run), and waiting for the ids."""
        tokens, build, enqueue, wait = self.first_tokens, 0.0, 0.0, 0.0
        self.cp.cuda.Device().synchronize()
        for step in range(steps):
            t0 = time.perf_counter()
            batch = self.step_batch(tokens, step)
            t1 = time.perf_counter()
            self.graph.run(batch)
            t2 = time.perf_counter()
            tokens = self.graph.token_ids.get(stream=self.graph.stream)
            t3 = time.perf_counter()
            build, enqueue, wait = build + t1 - t0, enqueue + t2 - t1, wait + t3 - t2
        return {"build_us": build / steps * 1e6, "enqueue_us": enqueue / steps * 1e6, "wait_us": wait / steps * 1e6}

    def replay_seconds(self, graph, replays: int = DECODE) -> float:
        """Seconds per step of `graph` replayed back to back with one step's inputs: the device's time alone,
        without the host's work between steps."""
        graph.run(self.step_batch(self.first_tokens, 0))
        return graph_replay_seconds(graph, replays)

    def variant_replays(self, variants: list[tuple[str, int]], eager_tokens: list[np.ndarray]) -> dict:
        """For each (constant of backends/tuning.py, value): the decode graph captured with it set, replayed back to
        back against the shipped graph (interleaved), and whether its greedy tokens equal the eager step's."""
        from colibri_stream.cuda_graph import DecodeGraph

        results = {}
        for name, value in variants:
            with tuning_set(name, value):
                graph = DecodeGraph(self.model, self.kv, self.graph.batch_size, self.graph.max_blocks)
            _, tokens = self.decode(CHECK_STEPS, graph)
            shipped, variant = [], []
            for _ in range(REPEATS):
                shipped.append(self.replay_seconds(self.graph) * 1e6)
                variant.append(self.replay_seconds(graph) * 1e6)
            results[f"{name}={value}"] = {
                "graph_replay_us": statistics.median(variant), "shipped_graph_replay_us": statistics.median(shipped),
                "greedy_matches_eager": all(np.array_equal(a, b) for a, b in zip(eager_tokens, tokens))}
            del graph
        return results

    def distinct_experts(self) -> float:
        """Mean distinct experts per layer over CHECK_STEPS eager steps (their routing, measured)."""
        counts = []
        route = self.backend.route

        def counting_route(*args, **kwargs):
            weights, ids = route(*args, **kwargs)
            counts.append(int(self.cp.unique(ids).size))
            return weights, ids

        self.backend.route = counting_route
        try:
            self.decode(CHECK_STEPS, graph=False)
        finally:
            del self.backend.route
        return float(np.mean(counts))

    def footprint(self) -> int:
        return self.cp.get_default_memory_pool().total_bytes() + self.graph.pool_bytes

    def release(self) -> None:
        del self.kv, self.graph, self.graph_without_pdl
        self.cp.get_default_memory_pool().free_all_blocks()

    def profile(self, batch: int, context: int, variants: list[tuple[str, int]],
                expert_bytes: int | None = None) -> list[dict]:
        """Time of each operation of a decode step at `batch` tokens, cycling through the layers; then again with each
        (constant of backends/tuning.py, value) of `variants` set. `expert_bytes`: what one routed expert reads
        (default: bf16 gate, up and down)."""
        cp, b, cfg, layers = self.cp, self.backend, self.config, self.model.layers
        h = cfg.hidden_size
        x = cp.random.standard_normal((batch, h), dtype=np.float32)  # [B, H]
        routing = [b.route(x, layer.router, cfg.top_k, cfg.norm_topk_prob) for layer in layers]
        ids = [cp.asnumpy(r[1]) for r in routing]
        n = len(layers)
        q = cp.random.standard_normal((batch, cfg.num_heads, cfg.head_dim), dtype=np.float32)
        kv = cp.random.standard_normal((batch, cfg.num_kv_heads * cfg.head_dim), dtype=np.float32)  # [B, K*D]
        device_batch = {"block_tables": cp.asarray(self.tables), "query_start": cp.arange(batch + 1),
                        "positions": cp.full(batch, context - 1, dtype=np.int64)}
        attn_bytes = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * h * WEIGHT_BYTES
        expert_bytes = expert_bytes or 3 * h * cfg.moe_intermediate_size * WEIGHT_BYTES
        kv_bytes = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * self.kv.keys[0].itemsize
        ops = [
            ("q,k,v,o projections", attn_bytes, lambda i: [b.linear(x if w.shape[1] == h else q.reshape(batch, -1), w)
                                                         for w in (layers[i % n].q_proj, layers[i % n].k_proj,
                                                                   layers[i % n].v_proj, layers[i % n].o_proj)]),
            ("router + top-k", cfg.num_experts * h * WEIGHT_BYTES,
             lambda i: b.route(x, layers[i % n].router, cfg.top_k, cfg.norm_topk_prob)),
            ("routed experts", float(np.mean([len(np.unique(a)) for a in ids])) * expert_bytes,
             lambda i: b.routed_experts(x, routing[i % n][0], routing[i % n][1], i % n, self.model.store)),
            ("paged attention", kv_bytes,
             lambda i: b.paged_attention(q, self.kv.keys[i % n], self.kv.values[i % n], None, device_batch,
                                         0.1, None)),
            ("norms, rotary, KV write", 0, lambda i: [
                b.add_rms_norm(x, x, layers[i % n].input_norm, 1e-6),
                b.qk_norm_rope_write(q.reshape(batch, -1), kv, kv, layers[i % n].q_norm, layers[i % n].k_norm,
                                     cfg.qk_norm, 1e-6, cfg.clip_qkv, self.model.rope_cos, self.model.rope_sin,
                                     device_batch["positions"], self.kv.keys[i % n], self.kv.values[i % n],
                                     cp.full(batch, -1, dtype=np.int64))]),
            ("lm_head", cfg.vocab_size * h * WEIGHT_BYTES / n, lambda i: b.linear(x, self.model.lm_head)
             if i % n == 0 else None),
        ]
        records = []
        for variant in [None, *variants]:
            with contextlib.nullcontext() if variant is None else tuning_set(*variant):
                for name, nbytes, fn in ops:
                    seconds = time_in_graph(cp, fn)
                    records.append({"op": name if variant is None else f"{name} ({variant[0]} = {variant[1]})",
                                    "us_per_layer": seconds * 1e6, "bytes_per_layer": nbytes,
                                    "gbps": nbytes / seconds / 1e9 if nbytes else None})
        return records


class Transformers:
    """The same shape in transformers (bf16, eager attention and experts, random weights) on the GPU."""

    def __init__(self, config):
        import torch
        import transformers

        self.torch = torch
        hf = hf_config(config)  # eager experts
        torch.cuda.reset_peak_memory_stats()
        with torch.device("cuda"):
            self.model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16,
                                                                       attn_implementation="eager").eval()
        self.experts_implementation = str(getattr(self.model.config, "_experts_implementation", "unknown"))
        self.vocab = config.vocab_size

    def setup(self, batch: int) -> None:
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(batch)
        prompt = torch.randint(0, self.vocab, (batch, PROMPT), device="cuda", generator=generator)
        with torch.no_grad():
            self.prefix = self.model(input_ids=prompt, use_cache=True).past_key_values
        self.first_tokens = torch.randint(0, self.vocab, (batch, 1), device="cuda", generator=generator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def decode(self, steps: int) -> float:
        torch = self.torch
        cache = copy.deepcopy(self.prefix)  # every run starts from the same PROMPT tokens
        tokens = self.first_tokens
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
                tokens = logits[:, -1].argmax(dim=-1, keepdim=True)
                tokens.cpu()  # the sampled ids reach the host every step, as in a server
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def release(self) -> None:
        del self.prefix
        self.torch.cuda.empty_cache()


def step_bytes(config, batch: int, distinct: float, context: int, kv_bytes: int,
               expert_bytes: float | None = None) -> float:
    """Bytes one decode step reads at least: dense weights (attention; the dense MLPs of the layers that are not
    MoE; each MoE layer's router and shared expert), lm_head, the `distinct` routed experts a MoE layer touches at
    `expert_bytes` each (default: three bf16 matrices; a quantized format's codes, scales and zero points), the KV
    cache of `batch` sequences of `context` tokens at `kv_bytes` an element."""
    h, d = config.hidden_size, config.head_dim
    attention = (2 * config.num_heads + 2 * config.num_kv_heads) * d * h * WEIGHT_BYTES
    router = config.num_experts * h * WEIGHT_BYTES
    shared_expert = 3 * h * config.shared_expert_intermediate_size * WEIGHT_BYTES
    dense_mlp = 3 * h * config.intermediate_size * WEIGHT_BYTES
    if expert_bytes is None:
        expert_bytes = 3 * h * config.moe_intermediate_size * WEIGHT_BYTES
    kv = 2 * batch * context * config.num_kv_heads * d * kv_bytes
    moe_layers = len(config.moe_layers)
    return (config.num_layers * (attention + kv) + moe_layers * (router + shared_expert + distinct * expert_bytes)
            + (config.num_layers - moe_layers) * dense_mlp + config.vocab_size * h * WEIGHT_BYTES)


def machine() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    info = {"gpu": props["name"].decode(), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "driver": cupy.cuda.runtime.driverGetVersion(), "cupy": cupy.__version__, "cpu_cores": os.cpu_count(),
            "python": platform.python_version()}
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return info


def run_batch(colibri: Colibri, hf: Transformers | None, build_error: str | None, batch: int, bandwidth: float,
              common: dict, variants: list[tuple[str, int]]) -> dict:
    """One batch size: the greedy check, interleaved timed runs, the roofline and (batch 1 and 16) the profile."""
    colibri.setup(batch)
    eager_tokens, matches = colibri.greedy_checks()
    distinct = colibri.distinct_experts()
    colibri.decode(2)  # warm-up
    baseline_error = build_error
    if hf is not None:
        try:
            hf.setup(batch)
            hf.decode(2)
        except Exception as exc:  # e.g. out of memory at a large batch: reported in the record
            baseline_error = repr(exc)
            log(f"transformers at batch {batch}: {baseline_error}")
    ours, sync, plain, theirs = [], [], [], []
    for _ in range(REPEATS):
        ours.append(batch * DECODE / colibri.decode_ahead(DECODE)[0])
        sync.append(batch * DECODE / colibri.decode(DECODE)[0])
        plain.append(batch * DECODE / colibri.decode(DECODE, colibri.graph_without_pdl)[0])
        if hf is not None and baseline_error is None:
            theirs.append(batch * DECODE / hf.decode(DECODE))
    replay = [colibri.replay_seconds(g) for g in (colibri.graph, colibri.graph_without_pdl)]
    variant_replays = colibri.variant_replays(variants, eager_tokens)
    host = colibri.host_phases()
    eager = batch * DECODE / colibri.decode(DECODE, graph=False)[0]
    context = PROMPT + DECODE // 2
    nbytes = step_bytes(colibri.config, batch, distinct, context, colibri.kv.keys[0].itemsize)
    roofline = batch * bandwidth * 1e9 / nbytes
    record = dict(common, bench="decode", batch=batch,
                  colibri_tok_s=statistics.median(ours), colibri_tok_s_runs=ours, colibri_eager_tok_s=eager,
                  colibri_sync_tok_s=statistics.median(sync), colibri_sync_tok_s_runs=sync,
                  programmatic_launch=colibri.graph.programmatic,
                  colibri_tok_s_without_pdl=statistics.median(plain), colibri_tok_s_without_pdl_runs=plain,
                  graph_replay_us=replay[0] * 1e6, graph_replay_us_without_pdl=replay[1] * 1e6,
                  variant_graph_replays=variant_replays,
                  synchronous_step_host_us=host,
                  transformers_tok_s=statistics.median(theirs) if theirs else None,
                  transformers_tok_s_runs=theirs,
                  transformers_impl=None if hf is None else f"eager attention, {hf.experts_implementation} experts",
                  roofline_tok_s=roofline, roofline_fraction=statistics.median(ours) / roofline,
                  hbm_gbps_measured=bandwidth, bytes_per_step=nbytes, distinct_experts_per_layer=distinct,
                  mean_context=context, colibri_peak_gpu_gb=colibri.footprint() / 1e9,
                  transformers_peak_gpu_gb=hf.peak_bytes() / 1e9 if theirs else None,
                  transformers_error=baseline_error, **matches)
    if batch in (1, 16):
        record["op_profile"] = colibri.profile(batch, context, variants)
    shown = ("shape", "batch", "colibri_tok_s", "colibri_sync_tok_s", "colibri_tok_s_without_pdl", "graph_replay_us",
             "graph_replay_us_without_pdl", "variant_graph_replays", "synchronous_step_host_us",
             "colibri_eager_tok_s", "transformers_tok_s", "roofline_tok_s", "roofline_fraction",
             "greedy_graph_matches_eager", "greedy_ahead_matches_eager", "greedy_graph_without_pdl_matches_eager")
    log(json.dumps({k: record[k] for k in shown}))
    colibri.release()
    if hf is not None and baseline_error is None:
        hf.release()
    return record


def run_shape(shape: str, layers: int, batches: list[int], bandwidth: float, common: dict, baseline: bool,
              variants: list[tuple[str, int]]) -> list[dict]:
    import cupy

    log(f"{shape}: building Colibri ({layers} layers)")
    colibri = Colibri.synthetic(shape, layers)
    hf, build_error = None, None if baseline else "not run (--no-baseline)"
    if baseline:
        log(f"{shape}: building transformers")
        try:
            hf = Transformers(colibri.config)
        except Exception as exc:  # a baseline that cannot be built is reported, not fatal
            build_error = repr(exc)
            log(f"transformers baseline unavailable: {build_error}")
    records = []
    for batch in batches:
        try:
            records.append(run_batch(colibri, hf, build_error, batch, bandwidth, dict(common, shape=shape,
                                                                                       layers=layers), variants))
        except Exception as exc:  # one failed batch size is reported; the others still run
            log(f"{shape} batch {batch} failed: {exc!r}")
            records.append(dict(common, bench="decode", shape=shape, layers=layers, batch=batch, error=repr(exc)))
    del colibri, hf
    cupy.get_default_memory_pool().free_all_blocks()
    return records


def table(records: list[dict]) -> str:
    lines = ["| shape | layers | batch | Colibri tok/s | without PDL | graph replay us (without PDL) "
             "| eager (no graph) | transformers tok/s | roofline tok/s | Colibri / roofline | Colibri / transformers "
             "| peak GB (Colibri / transformers) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['layers']} | {r['batch']} | failed: {r['error'][:80]} |")
            continue
        hf, hf_peak = r["transformers_tok_s"], r["transformers_peak_gpu_gb"]
        hf_text = "-" if hf is None else f"{hf:.0f}"
        ratio = "-" if hf is None else f"{r['colibri_tok_s'] / hf:.1f}x"
        hf_peak_text = "-" if hf_peak is None else f"{hf_peak:.1f}"
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['batch']} | {r['colibri_tok_s']:.0f} "
            f"| {r['colibri_tok_s_without_pdl']:.0f} "
            f"| {r['graph_replay_us']:.0f} ({r['graph_replay_us_without_pdl']:.0f}) "
            f"| {r['colibri_eager_tok_s']:.0f}"
            f" | {hf_text} | {r['roofline_tok_s']:.0f} | {r['roofline_fraction']:.0%} | {ratio}"
            f" | {r['colibri_peak_gpu_gb']:.1f} / {hf_peak_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--layers", type=int, default=None, help="layer count for every shape (default per shape)")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers")
    parser.add_argument("--out", default="benchmarks/results/decode_h200.json")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                        help="capture and replay the decode graph, and profile the operations again, with this "
                             "integer constant of backends/tuning.py set (MOE_DOWN_ROW_BYTES=8192, "
                             "GQA_BLOCKS_PER_SM=4, ...); repeatable")
    args = parser.parse_args(argv)
    require_gpu()
    variants = []
    for text in args.variant:
        name, _, value = text.partition("=")
        variants.append((name, int(value)))
    import cupy

    from colibri_stream.backends import tuning

    unknown = [name for name, _ in variants if not isinstance(getattr(tuning, name, None), int)]
    if unknown:
        parser.error(f"not integer constants of backends/tuning.py: {unknown}")
    bandwidth = measure_bandwidth(cupy)
    log(f"device-to-device copy: {bandwidth:.0f} GB/s")
    common = dict(machine(), commit=os.environ.get("COLIBRI_COMMIT", "unknown"), command=" ".join(sys.argv),
                  numerics="bf16 weights and KV cache, fp32 activations", prompt_tokens=PROMPT,
                  decode_steps=DECODE, repeats=REPEATS, routing="random router (close to uniform)",
                  kv_cache="random values, the default dtype (bf16)", timing="wall clock per run, host sync every step")
    records = []
    for shape in args.shapes:
        records += run_shape(shape, args.layers or DEFAULT_LAYERS.get(shape, 4), args.batches, bandwidth, common,
                             not args.no_baseline, variants)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    for r in records:
        for op in r.get("op_profile", []):
            gbps = "" if op["gbps"] is None else f"{op['gbps']:.0f} GB/s"
            print(f"{r['shape']} b{r['batch']}: {op['op']:<24} {op['us_per_layer']:8.1f} us/layer {gbps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
