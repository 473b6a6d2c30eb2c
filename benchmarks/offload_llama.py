"""llama.cpp beside benchmarks/offload.py: llama-bench with the routed experts of some layers on the CPU
(`--n-cpu-moe`), on the same weights as GGUF, at the GPU budgets it can place, and its figures written into
offload.py's records.

llama.cpp moves routed experts a layer at a time: `--n-cpu-moe N` sends the ffn_*_exps tensors of blocks 0..N-1 to
the CPU, dense blocks counted, and a layer's experts are one tensor per matrix (`-ot` cannot split them either), so
it runs only at the budgets whose host share is a whole number of MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable

from decode import log

# llama.cpp on the H200 machine and Mixtral-8x7B's shape, measured before this script could run it (8 layers, bf16,
# 16 threads, -ngl 99): batch-1 decode with every routed expert on the CPU (--n-cpu-moe 8) and with half the layers'
# experts there (--n-cpu-moe 4); prompt processing. By (shape, layers), then GPU expert fraction; --llama-bench
# replaces them with figures of the same run.
EARLIER_LLAMA_CPP = {("mixtral-8x7b", 8): {0.0: {"decode_tok_s": 15.6, "prefill_tok_s": 148.0},
                                           0.5: {"decode_tok_s": 31.1, "prefill_tok_s": 317.0}}}


def llama_cpu_moe(config, fraction: float) -> int | None:
    """llama.cpp's --n-cpu-moe that leaves `fraction` of `config`'s routed experts on the GPU, None where none does.
    --n-cpu-moe N sends the ffn_*_exps tensors of blocks 0..N-1 to the CPU, dense blocks counted, and a layer's
    experts are one tensor per matrix: the host holds the first MoE layers' experts (as the "layers" slot layout
    leaves them to it), N is the block after the last of them, and a host share that is not a whole number of MoE
    layers has no N."""
    host_layers = len(config.moe_layers) * (1 - fraction)
    if abs(host_layers - round(host_layers)) > 1e-9:
        return None
    count = round(host_layers)
    return config.moe_layers[count - 1] + 1 if count else 0


def llama_cpp_figures(args, config, fraction: float, depth: int) -> dict:
    """llama-bench's batch-1 decode (after `depth` cached tokens) and prefill with `fraction` of the routed experts on
    the GPU (`llama_cpu_moe`; host_moe_layers: the MoE layers whose experts it keeps on the CPU), or why there are
    none (skipped, error)."""
    from llama_cpp import llama_bench

    n_cpu_moe = llama_cpu_moe(config, fraction)
    if n_cpu_moe is None:
        return {"skipped": f"{fraction:.0%} of the experts on the GPU is not a whole number of the "
                           f"{len(config.moe_layers)} MoE layers, and llama.cpp places a layer's experts whole"}
    try:
        result = llama_bench(args.llama_bench, args.gguf, n_cpu_moe, args.llama_threads, depth=depth,
                             prompt_tokens=args.prefill)
    except Exception as error:  # reported; the other budgets still run
        result = {"error": repr(error)}
    return dict(result, host_moe_layers=[layer for layer in config.moe_layers if layer < n_cpu_moe])


def llama_cpp_baseline(args, config, records: list[dict], depth: int, save: Callable[[], None]) -> None:
    """llama.cpp on this machine and these weights (benchmarks/llama_cpp.py) at each GPU budget
    (`llama_cpp_figures`), written into the batch-1 and prefill records of that budget; `save()` after each."""
    for fraction in args.fractions:
        result = llama_cpp_figures(args, config, fraction, depth)
        log(f"llama.cpp at {fraction:.0%}: decode {result.get('decode_tok_s')} prefill {result.get('prefill_tok_s')}"
            + (f" ({result['skipped']})" if "skipped" in result else ""))
        for record in records:
            if (record["gpu_expert_fraction"] == fraction and record["source"] == "l2"
                    and record["batch"] in (1, "prefill")):
                record["llama_cpp"] = result
                if "skipped" in result:
                    continue
                earlier = record.get("llama_cpp_tok_s")
                if earlier is not None:
                    record["llama_cpp_earlier_tok_s"] = earlier
                which = "prefill_tok_s" if record["batch"] == "prefill" else "decode_tok_s"
                record["llama_cpp_tok_s"] = result.get(which)
                record["llama_cpp_measured"] = True
        save()
