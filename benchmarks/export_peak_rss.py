"""Peak resident memory of `export_model` against the size of the checkpoint it converts.

Writes a random Mixtral-shaped bf16 checkpoint (several GB by default: hidden 4096, intermediate 14336, 8 experts,
2 layers, vocab 32000), sharded so that generating it is itself streaming (one expert per shard), exports it in a
subprocess for each requested mode, and reports the child's peak RSS (getrusage RUSAGE_CHILDREN ru_maxrss) next to
the checkpoint size and the size of one expert. Results go to benchmarks/results/export_peak_rss.json.

    python benchmarks/export_peak_rss.py [--layers 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

RESULTS = Path(__file__).resolve().parent / "results" / "export_peak_rss.json"
EXPORT = ("import sys; from colibri_stream.export import export_model; "
          "export_model(sys.argv[1], sys.argv[2], dtype=sys.argv[3], quantize=sys.argv[4] or None, progress=False)")
IMPORT_ONLY = "import colibri_stream.export"
# Runs its arguments as a child and prints that child's peak RSS (KiB): every measurement has its own parent.
MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
    """Normal random weights in bfloat16, drawn row block by row block.  # shape"""
    out = np.empty(shape, ml_dtypes.bfloat16)
    step = max(1, (64 << 20) // (4 * int(np.prod(shape[1:]))))
    for start in range(0, shape[0], step):
        block = rng.standard_normal((min(step, shape[0] - start), *shape[1:]), dtype=np.float32)
        out[start : start + len(block)] = block * np.float32(std)
    return out


def write_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int, experts: int, vocab: int) -> int:
    """A sharded Mixtral checkpoint (one shard per expert, per layer's attention, and for the embeddings)."""
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = 32, 8, hidden // 32
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, tuple[int, ...]]) -> None:
        save_file({k: random_bf16(rng, shape) for k, shape in tensors.items()}, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))

    shard("embeddings.safetensors", {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                                     "model.norm.weight": (hidden,)})
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shard(f"layer{layer}-attention.safetensors", {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "block_sparse_moe.gate.weight": (experts, hidden),
        })
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shard(f"layer{layer}-expert{e}.safetensors", {q + "w1.weight": (intermediate, hidden),
                                                          q + "w3.weight": (intermediate, hidden),
                                                          q + "w2.weight": (hidden, intermediate)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_local_experts": experts, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def child_peak_rss(code: str, *args: str) -> tuple[int, float]:
    """Run `code` in a fresh Python; returns (its peak RSS in bytes, wall seconds)."""
    start = time.perf_counter()
    measured = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-c", code, *args], check=True,
                              capture_output=True, text=True)
    return int(measured.stdout.split()[-1]) * 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", default="bf16,bf16+int8", help="comma-separated dtype[+int8] exports to measure")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a /tmp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint and exports")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="colibri-export-rss-", dir=args.workdir))
    try:
        hf = work / "hf"
        hf.mkdir()
        start = time.perf_counter()
        checkpoint_bytes = write_checkpoint(hf, args.layers, args.hidden, args.intermediate, args.experts, args.vocab)
        generate_s = time.perf_counter() - start
        baseline, _ = child_peak_rss(IMPORT_ONLY)
        expert_bytes = 3 * args.hidden * args.intermediate * 2
        runs = []
        for mode in args.modes.split(","):
            dtype, _, quantize = mode.partition("+")
            out = work / f"out-{mode}"
            peak, wall = child_peak_rss(EXPORT, str(hf), str(out), dtype, quantize)
            runs.append({"mode": mode, "peak_rss_bytes": peak, "peak_rss_over_checkpoint": peak / checkpoint_bytes,
                         "peak_rss_over_one_expert": peak / expert_bytes, "wall_s": round(wall, 2),
                         "throughput_gib_s": round(checkpoint_bytes / wall / 2**30, 3)})
            shutil.rmtree(out)
            print(f"export {mode}: peak RSS {peak / 2**20:.0f} MiB for a {checkpoint_bytes / 2**30:.2f} GiB checkpoint "
                  f"({100 * peak / checkpoint_bytes:.1f}%; one expert is {expert_bytes / 2**20:.0f} MiB, "
                  f"python + imports {baseline / 2**20:.0f} MiB), {wall:.1f} s")
        result = {
            "checkpoint": {"layers": args.layers, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
                           "experts": args.experts, "vocab_size": args.vocab, "dtype": "bfloat16",
                           "bytes": checkpoint_bytes, "one_expert_bytes": expert_bytes,
                           "generate_s": round(generate_s, 1)},
            "import_baseline_rss_bytes": baseline,
            "runs": runs,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
