"""The `colibri` command: builds configurations from arguments and hands them on; nothing else lives here."""

from __future__ import annotations

import argparse
import os
import sys

from .config import KV_CACHE_DTYPES, MATMUL_PRECISIONS
from .errors import ColibriError


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="convert a Hugging Face MoE checkpoint into a Colibri model folder")
    p.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    p.add_argument("out_dir", help="model folder to write")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="storage dtype (default bf16)")
    p.add_argument("--quantize", choices=("int8", "int4", "fp8", "mxfp4"), default=None,
                   help="quantize the routed experts, rounded to nearest: int8 (a scale per output channel), int4 "
                        "(a scale per group of input channels), fp8 (e4m3), mxfp4 (e2m1, a power-of-two scale per "
                        "32 input channels); a pre-quantized checkpoint keeps its experts' format and refuses it "
                        "unless --dequantize")
    p.add_argument("--dequantize", action="store_true",
                   help="a pre-quantized checkpoint (fp8, int4, gpt-oss MXFP4): its routed experts dequantized and "
                        "stored in --dtype (or re-quantized by --quantize) instead of kept in its format")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=None,
                   help="int4: input channels per scale (default 128)")
    p.add_argument("--int4-zero-point", action="store_true", help="int4: asymmetric, a zero point per group")
    p.add_argument("--fp8-scales", choices=("block", "channel"), default=None,
                   help="fp8: a scale per 128x128 tile (block, default; as DeepSeek-V3) or per output channel")
    p.add_argument("--force", action="store_true", help="write into a non-empty out_dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> None:
    from .export import export_model

    from .expert_codecs import expert_codec

    config = export_model(args.hf_dir, args.out_dir, dtype=args.dtype, quantize=args.quantize, force=args.force,
                          progress=not args.quiet, group_size=args.group_size, zero_point=args.int4_zero_point,
                          fp8_scales=args.fp8_scales, dequantize=args.dequantize)
    print(f"wrote {args.out_dir}: {config.architecture}, {config.num_layers} layers, "
          f"{config.num_experts} experts (top-{config.top_k}), experts in {expert_codec(config).describe()}")


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a model folder's config, sizes and expert table")
    p.add_argument("model", help="model folder")
    p.add_argument("--verify", action="store_true", help="check every checksum")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> None:
    from .inspect import describe_model

    print(describe_model(args.model, verify=args.verify))


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the model shipped with Colibri)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--verify", action="store_true", help="check every checksum before loading")
    p.add_argument("--max-seq-len", type=int, default=None, help="longest prompt + completion (default: the model's)")
    p.add_argument("--max-batch-size", type=int, default=None, help="sequences per step (default 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 8192 on a GPU, 2048 on the CPU)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default 16)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--kv-cache-memory", type=_size, default=None, metavar="SIZE",
                       help="KV-cache budget, e.g. 8GiB (default: sized from free memory, see "
                            "--gpu-memory-utilization)")
    cache.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache size in blocks")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="element type of the KV cache: auto (default: fp16 for an fp16 model, else bf16), bf16, "
                        "fp16, fp8 (e4m3, half of bf16's bytes), fp32 (the reference)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="share of the GPU's memory the engine may use; the KV cache gets what the weights, expert "
                        "slots and activations leave of it (default 0.9)")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default=None,
                   help="GPU tensor-core products (prefill, large batches): medium (default: float32 activations "
                        "as one bf16/fp16 part, as engines with bf16 activations compute: about 1e-3) or high (two "
                        "parts, within about 1e-5 of float32, twice the tensor cores' work)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="launch every GPU step eagerly instead of replaying captured decode graphs (slower; for "
                        "debugging and comparisons)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help="read each decode step's tokens before launching the next one, instead of launching it "
                        "ahead (for debugging and comparisons)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="recompute every prompt instead of reusing the KV blocks of a prefix computed before")
    p.add_argument("--no-sliding-window-pool", dest="sliding_window_pool", action="store_false", default=None,
                   help="keep the whole context in sliding-window layers too, instead of only their window in a pool "
                        "of their own (for comparisons)")
    _add_budget_arguments(p)
    p.add_argument("--eviction-policy", choices=("lru", "lfu", "pinned"), default=None,
                   help="who leaves a full expert tier: lfu (decayed frequency; default), lru, pinned (the most "
                        "used experts of --usage-file hold the slots)")
    p.add_argument("--prefetch", action="store_true", default=None,
                   help="load the next layers' predicted experts ahead (off by default: see BENCHMARKS.md)")
    p.add_argument("--prefetch-lookahead", type=int, default=None, metavar="LAYERS",
                   help="MoE layers predicted ahead (default 1)")
    p.add_argument("--cpu-experts", choices=("auto", "off", "all"), default=None,
                   help="with GPU expert slots, where a missing expert is computed: auto (default: on the CPU, "
                        "on the GPU after a copy, or cut by rows between the two, whichever the cost model finds "
                        "sooner per expert and step), off (always load it to the GPU), all (always on the CPU)")
    p.add_argument("--gpu-slot-layout", choices=("spread", "layers"), default=None,
                   help="how --gpu-memory-limit's expert slots are shared among MoE layers: spread (default: the "
                        "same number in every layer, each keeping its most used experts) or layers (whole layers "
                        "on the GPU, run without a host round trip; the others' experts from the host: fewer CPU "
                        "hand-offs a token, as llama.cpp's --n-cpu-moe; pays when routing has little locality)")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="threads computing routed experts on the CPU (default: every core; beside GPU slots every "
                        "core but one, which the thread driving the GPU keeps)")
    p.add_argument("--usage-file", default=None, metavar="PATH",
                   help="routing statistics: ranks experts for --eviction-policy pinned (default: expert_usage.json "
                        "in the model folder); this run's routes are added to it")
    p.add_argument("--routing-trace", default=None, metavar="PATH",
                   help="write every step's routing (layer, step, expert ids per token) as JSON lines")


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-limit", type=_size, default=None, metavar="SIZE",
                   help="GPU memory for the dense weights and expert slots, e.g. 20GiB (default: every expert)")
    p.add_argument("--l2-cache-size", type=_size, default=None, metavar="SIZE",
                   help="host memory for expert slots in front of experts.bin, e.g. 64GiB (default: every expert, "
                        "memory-mapped)")


def _size(text: str) -> int:
    """A byte count: 123, 512KiB, 1.5GiB, 2GB (K/M/G/T, binary with an i, decimal without)."""
    units = {"": 1, "B": 1}
    for power, letter in enumerate("KMGT", start=1):
        units.update({letter: 1024**power, letter + "IB": 1024**power, letter + "B": 1000**power})
    number = text.strip().upper().rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text.strip().upper()[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 512MiB, 20GiB, 1000000)") from None
    return int(value)


def _engine_options(args: argparse.Namespace) -> dict:
    """The engine keyword arguments that were given on the command line."""
    names = ("device", "verify", "cuda_graphs", "async_scheduling", "max_seq_len", "max_batch_size",
             "max_num_batched_tokens", "block_size", "kv_cache_memory", "num_kv_blocks", "enable_prefix_caching",
             "sliding_window_pool", "kv_cache_dtype", "gpu_memory_utilization", "matmul_precision",
             "max_queue", "gpu_memory_limit", "l2_cache_size", "eviction_policy", "prefetch", "prefetch_lookahead",
             "usage_file", "routing_trace", "cpu_experts", "gpu_slot_layout", "cpu_threads")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print where experts will live under memory budgets, what moves per token, and "
                                    "the bottleneck (reads no weights)")
    p.add_argument("--model", default=None, help="model folder (default: the model shipped with Colibri)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where experts are computed (default: cuda with --gpu-memory-limit, else cpu)")
    _add_budget_arguments(p)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="element type of the KV cache (default auto: fp16 for an fp16 model, else bf16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="share of the GPU's memory the engine may use (default 0.9)")
    p.add_argument("--gpu-total-memory", type=_size, default=None, metavar="SIZE",
                   help="the GPU's memory, for the KV cache's size (default: the H200's 139GiB)")
    p.add_argument("--gpu-hit-rate", type=float, default=None, help="L1 hit rate (default: slots / experts)")
    p.add_argument("--host-hit-rate", type=float, default=None, help="L2 hit rate (default: slots / experts)")
    for name, doc in (("hbm", "GPU memory"), ("pcie-pinned", "host to GPU from pinned memory"),
                      ("pcie-pageable", "host to GPU from pageable memory"), ("disk", "experts.bin reads"),
                      ("host-ram", "host memory reads")):
        p.add_argument(f"--bw-{name}", type=float, default=None, metavar="GB/S",
                       help=f"bandwidth of {doc} (default: the H200 machine's measurement)")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> None:
    from .checkpoint import default_model_path, read_config
    from .config import CacheConfig
    from .memory import host_memory
    from .model.paged_kv import resolve_kv_dtype
    from .plan import H200_MEMORY, Bandwidths, kv_report, plan_for_folder

    folder = args.model or default_model_path()
    device = args.device or ("cuda" if args.gpu_memory_limit is not None else "cpu")
    plan = plan_for_folder(folder, device, args.gpu_memory_limit, args.l2_cache_size)
    overrides = {name: getattr(args, "bw_" + name) for name in ("hbm", "pcie_pinned", "pcie_pageable", "disk",
                                                                 "host_ram")}
    bandwidths = Bandwidths(**{k: v * 1e9 for k, v in overrides.items() if v is not None})
    print(plan.report(bandwidths, args.gpu_hit_rate, args.host_hit_rate))
    config = read_config(folder)
    cache = CacheConfig(kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization)
    dtype = resolve_kv_dtype(cache.kv_cache_dtype, config)
    print(kv_report(config, plan, cache, dtype, host_memory(), args.gpu_total_memory or H200_MEMORY))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model through the OpenAI-compatible HTTP API")
    _add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder name)")
    p.add_argument("--cors-origin", action="append", default=[], help="allowed CORS origin (repeatable; * for any)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting sequences before 429 (default: unbounded)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 4 MiB)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds SIGTERM waits for running requests (default 300)")
    p.add_argument("--keepalive-interval", type=float, default=None,
                   help="seconds between SSE keep-alive comments while a stream waits (default 10)")
    p.add_argument("--send-timeout", type=float, default=None,
                   help="seconds a stream waits for a client that reads nothing before it is aborted (default 60; "
                        "0: wait for ever)")
    p.add_argument("--no-reasoning-parser", dest="reasoning_parser", action="store_false", default=None,
                   help="leave a thinking model's <think> text in the content (default: reasoning_content); a "
                        "harmony model's (gpt-oss) replies are read by channel all the same")
    p.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine's steps on a thread of the server's process instead of a process of their "
                        "own (where the server's Python and the steps' share one GIL)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engine replicas behind this server, each in its own process: on cuda one GPU each, on "
                        "the CPU a share of the cores each (default 1; docs/MULTI_GPU.md)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="shard the routed experts over N ranks, each a process of its own: on cuda one GPU each, on "
                        "the CPU a share of the cores each (default 1; not with --data-parallel; docs/MULTI_GPU.md)")
    _add_trace_argument(p)
    p.set_defaults(run=_run_serve)


def _add_trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-file", default=None, metavar="PATH",
                   help="write every engine step's phases as Chrome-trace JSON (ui.perfetto.dev, chrome://tracing)")


def _run_serve(args: argparse.Namespace) -> None:
    from .server.serving import run_server

    given = {n: getattr(args, n) for n in ("max_body_bytes", "drain_timeout", "keepalive_interval", "send_timeout",
                                           "trace_file", "reasoning_parser") if getattr(args, n) is not None}
    if given.get("send_timeout", 1) <= 0:
        given["send_timeout"] = None
    engine = dict(path=args.model, engine_process=args.engine_process, data_parallel=args.data_parallel,
                  expert_parallel=args.expert_parallel, **_engine_options(args))
    run_server(engine, host=args.host, port=args.port, api_key=args.api_key, cors_origins=tuple(args.cors_origin),
               served_model_name=args.served_model_name, **given)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt offline and print the text as it comes")
    _add_engine_arguments(p)
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (prompt_token_ids, token_ids, text, finish_reason) at the end")
    _add_trace_argument(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    import contextlib

    import orjson

    from .llm import LLM
    from .request import SamplingParams
    from .timing import ChromeTraceWriter

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(LLM(args.model, **_engine_options(args)))
        if args.trace_file is not None:
            llm.engine.timer.add_sink(stack.enter_context(ChromeTraceWriter(args.trace_file)))
        if args.json:
            result = llm.generate(args.prompt, params)
            sys.stdout.buffer.write(orjson.dumps({
                "prompt_token_ids": result.prompt_token_ids,
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
            }) + b"\n")
            return
        for delta in llm.stream(args.prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load an OpenAI-compatible server with streamed requests and report latencies")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model id to request (default: the first the server lists)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight (default: 1, or no limit with --request-rate)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-file", default=None, help="prompts, one per line (used in turn)")
    prompts.add_argument("--input-len", type=int, default=32, help="words per synthetic prompt (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic prompts and arrival times (a server with prefix caching remembers "
                        "earlier runs' prompts: give each run against it its own seed)")
    p.add_argument("--output-format", choices=("table", "json"), default="table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the distributions (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> None:
    from .bench import BenchConfig, bench, read_prompts, synthetic_prompts

    prompts = (read_prompts(args.prompt_file) if args.prompt_file
               else synthetic_prompts(args.num_requests, args.input_len, args.seed))
    concurrency = args.concurrency if args.concurrency is not None or args.request_rate else 1
    config = BenchConfig(url=args.url, prompts=prompts, num_requests=args.num_requests, output_len=args.output_len,
                         model=args.model, endpoint=args.endpoint, concurrency=concurrency,
                         request_rate=args.request_rate, ignore_eos=args.ignore_eos, temperature=args.temperature,
                         api_key=args.api_key, seed=args.seed)
    _, text = bench(config, args.output_format, args.plot, progress=not args.quiet)
    print(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colibri", description="Serve mixture-of-experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_export, _add_inspect, _add_generate, _add_serve, _add_bench, _add_plan):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (colibri inspect | head): quiet, as other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
