"""llama.cpp on the same machine and the same weights: the baseline of the decode and offload benchmarks.

The weights are a native model folder as a bf16 GGUF file, written by benchmarks/gguf_writer.py's `write_gguf` (the
command line below writes one where --gguf is missing). Three jobs on such a file:
- `quantize_gguf(binary, src, dst, llama_format, threads)`: llama-quantize of such a file to one of llama.cpp's
  formats (Q4_0, Q4_K_M, Q8_0, ...); with `DENSE_BF16` among its options only the routed experts are quantized,
  as in a Colibri folder with quantized experts.
- `llama_bench(binary, gguf, n_cpu_moe, ...)`: llama-bench with the routed experts of `n_cpu_moe` layers on the CPU
  (`--n-cpu-moe`, the rest on the GPU): batch-1 decode after `depth` cached tokens, and prompt processing.
- `batched_bench(binary, gguf, batches, ...)`: llama-batched-bench with the whole model on the GPU: decode of
  1, 16, 64 sequences at once after `context` prompt tokens each.
The binaries come from benchmarks/build_llama_cpp.sh. Flash attention on, CUDA graphs as llama.cpp builds them.
A GGUF file is written under a temporary name and renamed when whole, so a file found at its path is complete.

    python benchmarks/llama_cpp.py --folder /tmp/colibri-offload-model --gguf /tmp/colibri-offload-model.gguf \
        --gguf-py llama.cpp/gguf-py --llama-bench build/bin/llama-bench --batched-bench build/bin/llama-batched-bench \
        --out benchmarks/results/llama_cpp_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from gguf_writer import partial_path, require_gguf_py, write_gguf

# llama-quantize options that keep every tensor but the routed experts in bf16: attention (its 2-D weights; norms and
# the router are never quantized), shared experts (ffn_*_shexp), dense MLPs (ffn_gate.weight, ...: not the routed
# ffn_gate_exps), the token embedding and the output matrix. Each --tensor-type is a regular expression searched in
# the tensor names; one that matches nothing (no shared expert) changes nothing.
DENSE_BF16 = ("--tensor-type", "attn=bf16", "--tensor-type", "shexp=bf16", "--tensor-type",
              r"ffn_(gate|up|down)\.weight=bf16", "--token-embedding-type", "bf16", "--output-tensor-type", "bf16")


def quantize_gguf(binary: str | Path, src_gguf: str | Path, dst_gguf: str | Path, llama_format: str, threads: int,
                  options: tuple[str, ...] = (), timeout: float = 900) -> dict:
    """llama-quantize `src_gguf` (bf16) to `dst_gguf` in `llama_format` (Q4_0, Q4_K_M, Q8_0, ...) on `threads`
    threads, with llama-quantize's `options` before the files (e.g. DENSE_BF16). Returns the command, its seconds
    and the file's bytes; raises RuntimeError with the tail of its output when it fails."""
    dst_gguf = Path(dst_gguf)
    partial = partial_path(dst_gguf)
    command = [str(binary), *options, str(src_gguf), str(partial), llama_format, str(threads)]
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize ran past {timeout:.0f} s: {' '.join(command)}") from error
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed ({done.returncode}): {(done.stdout + done.stderr)[-800:]}")
    partial.rename(dst_gguf)
    return {"command": " ".join(command).replace(str(partial), str(dst_gguf)), "llama_format": llama_format,
            "wall_s": time.perf_counter() - begin, "bytes": dst_gguf.stat().st_size}


def llama_bench(binary: str | Path, gguf_path: str | Path, n_cpu_moe: int, threads: int, gen_tokens: int = 32,
                prompt_tokens: int = 512, depth: int = 32, repetitions: int = 3, timeout: float = 600) -> dict:
    """llama-bench's decode (`gen_tokens` after `depth` cached tokens, batch 1) and prompt processing
    (`prompt_tokens`) of `gguf_path` with every layer on the GPU (-ngl 99) but the routed experts of `n_cpu_moe`
    layers, on `threads` CPU threads, flash attention on. Returns tok/s and llama-bench's own records."""
    command = [str(binary), "-m", str(gguf_path), "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe), "-t", str(threads),
               "-fa", "1", "-p", str(prompt_tokens), "-n", str(gen_tokens), "-d", str(depth),
               "-r", str(repetitions), "-o", "json"]
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    runs = json.loads(done.stdout)
    decode = [r for r in runs if r["n_gen"] > 0]
    prefill = [r for r in runs if r["n_prompt"] > 0]
    return {"command": " ".join(command), "n_cpu_moe": n_cpu_moe, "threads": threads,
            "decode_tok_s": decode[0]["avg_ts"] if decode else None,
            "decode_samples_tok_s": decode[0].get("samples_ts") if decode else None,
            "prefill_tok_s": prefill[0]["avg_ts"] if prefill else None,
            "prefill_samples_tok_s": prefill[0].get("samples_ts") if prefill else None,
            "build_commit": runs[0].get("build_commit"), "wall_s": time.perf_counter() - begin,
            "cpu_info": runs[0].get("cpu_info"), "gpu_info": runs[0].get("gpu_info")}


def batched_bench(binary: str | Path, gguf_path: str | Path, batches: list[int], context: int = 128,
                  gen_tokens: int = 32, threads: int = 16, timeout: float = 600,
                  cache_type: str | None = None) -> dict[int, dict]:
    """llama-batched-bench's decode of `gguf_path` wholly on the GPU: for each batch size, that many sequences of
    `context` prompt tokens each (not shared), then `gen_tokens` steps of one token per sequence; tok/s of those
    steps (speed_tg, as decode_tok_s) and of the prompts (speed_pp) by batch size. `cache_type`: the KV cache's
    element type for keys and values (-ctk/-ctv: f16 by default, q8_0, f32, ...)."""
    longest = max(batches) * (context + gen_tokens)
    # Its rows go through llama.cpp's asynchronous log, which is not flushed at exit, so the last lines can be lost:
    # a repeat of the smallest batch runs last, and only the first row of each batch size is kept.
    sizes = [*batches, min(batches)]
    command = [str(binary), "-m", str(gguf_path), "-ngl", "99", "-fa", "on", "-t", str(threads),
               "-c", str(longest), "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(gen_tokens),
               "-npl", ",".join(map(str, sizes)), "--output-format", "jsonl"]
    if cache_type is not None:
        command += ["-ctk", cache_type, "-ctv", cache_type]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    figures: dict[int, dict] = {}
    for row in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")):
        figures.setdefault(row["pl"], dict(row, decode_tok_s=row["speed_tg"], command=" ".join(command)))
    return figures


def main(argv: list[str] | None = None) -> int:
    from decode import machine

    from colibri_stream.synthetic import write_synthetic_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="native model folder (Mixtral, Qwen3-MoE, GLM-4.5, "
                        "MiniMax-M2, DeepSeek-V3 or gpt-oss, bf16); "
                        "a random one of --shape and --layers is written there if it is missing")
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gguf", required=True, help="GGUF file: written from --folder if missing")
    parser.add_argument("--gguf-py", required=True, help="gguf-py folder of the llama.cpp source tree")
    parser.add_argument("--llama-bench", help="llama-bench binary: offloaded decode and prefill (--n-cpu-moe)")
    parser.add_argument("--batched-bench", help="llama-batched-bench binary: decode on the GPU at --batches")
    parser.add_argument("--n-cpu-moe", nargs="+", type=int, default=[8, 4, 0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=128, help="cached tokens per sequence (batched-bench)")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--out", help="JSON records of the runs")
    args = parser.parse_args(argv)
    require_gguf_py(args.gguf_py, "llama_cpp.py")
    if not (Path(args.folder) / "experts.bin").is_file():
        write_synthetic_folder(args.folder, args.shape, num_layers=args.layers)
    if not Path(args.gguf).is_file():
        begin = time.perf_counter()
        write_gguf(args.folder, args.gguf, args.gguf_py)
        print(f"wrote {args.gguf} in {time.perf_counter() - begin:.0f} s", flush=True)
    common = dict(machine(), shape=args.shape, layers=args.layers, engine="llama.cpp", gguf=str(args.gguf))
    records = []
    for n in args.n_cpu_moe if args.llama_bench else []:
        result = llama_bench(args.llama_bench, args.gguf, n, args.threads)
        records.append(dict(common, bench="llama_bench", **result))
        print(json.dumps({k: result[k] for k in ("n_cpu_moe", "decode_tok_s", "prefill_tok_s")}), flush=True)
    if args.batched_bench:
        for batch, row in batched_bench(args.batched_bench, args.gguf, args.batches, args.context).items():
            records.append(dict(common, bench="llama_batched_bench", batch=batch, **row))
            print(json.dumps({"batch": batch, "decode_tok_s": row["decode_tok_s"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
