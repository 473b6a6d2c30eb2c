"""llama.cpp computes the same model as Colibri from the GGUF file `gguf_writer.write_gguf` writes: a check on the CPU.

For each family (Mixtral, Qwen3-MoE, GLM-4.5, MiniMax-M2, GLM-4.5 with per-head qk-norm, expert groups and a
routed scaling factor, DeepSeek-V3's latent attention, and gpt-oss's sinks, windows and biased clamped-SwiGLU
experts) a tiny model of its published shape's options (`TINY`: small widths, a few layers, one leading dense layer
for GLM and DeepSeek) is written with random weights (`write_tiny_folder`: `write_synthetic_folder`, bf16, non-zero
score correction biases; gpt-oss's expert biases added), then as a GGUF file, twice: matrices in bf16
(what the benchmarks run: llama.cpp's CPU matrix products then round each activation to bf16 too) and widened to
float32 (the same values: llama.cpp's products in float32, so what is left of a difference is the model, not
llama.cpp's bf16 arithmetic). Both engines then run the same random prompt with a float32 KV cache, and the
record holds:
- greedy tokens: Colibri's NumPy backend and llama.cpp each generate `--tokens` tokens from the prompt; the tokens
  that agree before the first difference;
- logits: llama.cpp's logits at every position of the prompt and Colibri's tokens (so both see the same sequence),
  against Colibri's: the largest difference relative to Colibri's largest logit, and the share of positions where
  the two argmaxes agree.

llama.cpp runs through llama-cpp-python's bindings (`Llama`, `--llama-cpp-python`: an installed package, or the
folder of an unpacked llama-cpp-python sdist, which also holds the llama.cpp tree) over a CPU build of that tree's
libllama (`--llama-lib`: its folder of libllama.so and the ggml libraries, as
`cmake -B build -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=ON && cmake --build build --target llama-simple` leaves in
build/bin). The bindings must be of the same llama.cpp version as the library; their package imports diskcache
(`pip install diskcache` where llama-cpp-python itself is not installed).

    python benchmarks/llama_cpp_parity.py --gguf-py SDIST/vendor/llama.cpp/gguf-py --llama-cpp-python SDIST \
        --llama-lib build/bin --out benchmarks/results/llama_cpp_parity_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from conditions import machine
from gguf_writer import require_gguf_py, write_gguf

from colibri_stream.batch import single_sequence_batch
from colibri_stream.checkpoint import ExpertFile, ExpertFileWriter, write_config
from colibri_stream.config import RopeConfig
from colibri_stream.loader import load_model
from colibri_stream.synthetic import SHAPES, shape_config, write_synthetic_folder

# A tiny model of each family: the named shape's options, these sizes (a leading dense layer and two MoE layers
# for GLM-4.5 and DeepSeek-V3), and for "glm4_moe-grouped" the GLM options GLM-4.5-Air leaves off. DeepSeek-V3
# keeps its q LoRA, expert groups (4 of which 2 chosen), shared expert, scaling, interleaved rotary and YaRN
# (factor 40 over 4096 positions, mscale_all_dim 1), its softmax scale recomputed for the tiny head. gpt-oss keeps
# its sinks, q/k/v/o and router biases, biased experts and clamped SwiGLU, its alternating sliding / full layers
# with a window of 8 (shorter than the prompt), and YaRN (factor 32 over 4096 positions) with truncate on: llama.cpp
# always rounds YaRN's correction range, which the published configs' truncate false does not (unwritable).
_SMALL = dict(vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
_DEEPSEEK_V3 = dict(_SMALL, num_kv_heads=4, head_dim=48, rotary_dim=16, v_head_dim=32, q_lora_rank=96,
                    kv_lora_rank=64, num_experts=16, top_k=4, n_group=4, topk_group=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64, intermediate_size=192, moe_layers=(1, 2),
                    softmax_scale=48**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2)
TINY = {
    "mixtral": ("mixtral-8x7b", 2, dict(_SMALL, num_experts=8, top_k=2, moe_intermediate_size=96)),
    "qwen3_moe": ("qwen3-30b-a3b", 2, dict(_SMALL, num_experts=16, top_k=4, moe_intermediate_size=64)),
    "glm4_moe": ("glm-4.5-air", 3, dict(_SMALL, num_experts=16, top_k=4, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, intermediate_size=192, rotary_dim=16)),
    "glm4_moe-grouped": ("glm-4.5-air", 3, dict(_SMALL, num_experts=16, top_k=4, moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=128, intermediate_size=192,
                                                 rotary_dim=16, qk_norm="per_head", n_group=4, topk_group=2,
                                                 routed_scaling_factor=2.5)),
    "minimax_m2": ("minimax-m2", 3, dict(_SMALL, num_experts=16, top_k=4, moe_intermediate_size=64, rotary_dim=16)),
    "deepseek_v3": ("deepseek-v3", 3, _DEEPSEEK_V3),
    # DeepSeek-V2-Lite's options on DeepSeek-V3's widths: softmax routing, scaled, not renormalised, no q LoRA
    "deepseek_v2": ("deepseek-v3", 3, dict(_DEEPSEEK_V3, architecture="deepseek_v2", q_lora_rank=0, n_group=1,
                                           topk_group=1, router_scoring="softmax", score_correction_bias=False,
                                           norm_topk_prob=False, routed_scaling_factor=1.5,
                                           shared_expert_intermediate_size=128)),
    # GLM-4.7-Flash: DeepSeek-V3's computation without a q LoRA or groups, plain rope (its published config's)
    "glm4_moe_lite": ("deepseek-v3", 3, dict(_DEEPSEEK_V3, architecture="glm4_moe_lite", q_lora_rank=0, n_group=1,
                                             topk_group=1, routed_scaling_factor=1.8, rope=RopeConfig(theta=1e6),
                                             softmax_scale=48**-0.5)),
    "gpt_oss": ("gpt-oss-20b", 4, dict(_SMALL, num_experts=16, top_k=4, moe_intermediate_size=64,
                                       sliding_windows=(8, None, 8, None),
                                       rope=dataclasses.replace(SHAPES["gpt-oss-20b"]["rope"], truncate=True))),
}
EXPERT_BIAS_STD = 0.1  # spread of the tiny gpt-oss experts' biases (write_tiny_folder)
BLOCK_SIZE = 16  # Colibri's KV blocks
HERE = Path(__file__).resolve().parent


def llama_bindings(folder: str | None):
    """llama-cpp-python's package, from `folder` (or the installed one), with this folder (whose llama_cpp.py
    would shadow the package) off the import path."""
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
    if folder:
        sys.path.insert(0, str(Path(folder).resolve()))
    try:
        import llama_cpp
    except ImportError as error:
        sys.exit(f"llama_cpp_parity.py needs llama-cpp-python's bindings (--llama-cpp-python): {error}")
    return llama_cpp


def tiny_config(family: str):
    """The ModelConfig of `family`'s tiny model (TINY)."""
    shape, layers, sizes = TINY[family]
    return dataclasses.replace(shape_config(shape, layers), **sizes)


def write_tiny_folder(folder: Path, config) -> None:
    """`config`'s model folder as `write_synthetic_folder` writes it (on the CPU), but for biased routed experts
    (gpt-oss), which it does not draw: the folder is written without them, then experts.bin again with the same
    matrices and N(0, EXPERT_BIAS_STD) float32 biases seeded by layer and expert, and config.json with them."""
    plain = dataclasses.replace(config, expert_bias=False)
    write_synthetic_folder(folder, plain, device="cpu")
    if not config.expert_bias:
        return
    source = ExpertFile(folder / config.experts_file, plain)
    partial = folder / (config.experts_file + ".partial")
    widths = {"gate_bias": config.moe_intermediate_size, "up_bias": config.moe_intermediate_size,
              "down_bias": config.hidden_size}
    with ExpertFileWriter(partial, config) as writer:
        for layer in config.moe_layers:
            for expert in range(config.num_experts):
                rng = np.random.default_rng([layer, expert])
                biases = {name: (rng.standard_normal(width) * EXPERT_BIAS_STD).astype(np.float32)
                          for name, width in widths.items()}
                writer.write_expert(layer, expert, {**source.tensors(layer, expert), **biases})
    source.close()
    partial.replace(folder / config.experts_file)
    write_config(folder, config)


def colibri_logits(model, ids: list[int]) -> np.ndarray:
    """Colibri's logits [S, V] at every position of `ids`, float32 KV cache."""
    blocks = -(-len(ids) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE, "fp32")
    batch = single_sequence_batch(np.array(ids), 0, np.arange(blocks), BLOCK_SIZE)
    batch.logits_indices = np.arange(len(ids))
    return np.asarray(model.forward(batch, kv))


def colibri_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Colibri's `steps` greedy tokens after `prompt`: a prefill, then one token at a time through the KV cache."""
    blocks = -(-(len(prompt) + steps) // BLOCK_SIZE)
    table = np.arange(blocks)
    kv = model.allocate_kv_cache(blocks, BLOCK_SIZE, "fp32")
    logits = model.forward(single_sequence_batch(np.array(prompt), 0, table, BLOCK_SIZE), kv)
    out: list[int] = []
    for step in range(steps):
        out.append(int(np.asarray(logits)[-1].argmax()))
        if step + 1 < steps:
            batch = single_sequence_batch(np.array(out[-1:]), len(prompt) + step, table, BLOCK_SIZE)
            logits = model.forward(batch, kv)
    return out


def open_llama(llama_type, gguf_path: Path, context: int, threads: int):
    """A `llama_type` (llama-cpp-python's Llama) over the GGUF file: logits of every position kept, KV cache float32,
    no flash attention, YaRN's betas and attention factor from the file (-1, llama.cpp's own defaults: the bindings
    would otherwise set 32, 1 and 1)."""
    f32 = 0  # GGML_TYPE_F32
    return llama_type(model_path=str(gguf_path), n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                 n_threads=threads, n_threads_batch=threads, type_k=f32, type_v=f32, flash_attn=False,
                 yarn_beta_fast=-1.0, yarn_beta_slow=-1.0, yarn_attn_factor=-1.0, verbose=False)


def llama_logits(llama, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [S, V] at every position of `ids`, from an empty cache."""
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[:len(ids)], dtype=np.float32)


def llama_greedy(llama, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's `steps` greedy tokens after `prompt`: a prefill, then one token at a time."""
    llama.reset()
    llama.eval(prompt)
    out: list[int] = []
    for step in range(steps):
        out.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        if step + 1 < steps:
            llama.eval(out[-1:])
    return out


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary(record: dict) -> dict:
    """A record's agreement figures, without the token lists."""
    return dict(family=record["family"], **{matrices: {key: value for key, value in record[matrices].items()
                                                       if key != "llama_tokens"} for matrices in ("bf16", "f32")})


def compare(family: str, folder: Path, llama_type, gguf_py: Path, prompt_len: int, steps: int, threads: int) -> dict:
    """One family's record: Colibri against llama.cpp (`llama_type`) on the bf16 GGUF file and on the float32 one,
    both written by `write_gguf` (benchmarks/gguf_writer.py)."""
    config = tiny_config(family)
    write_tiny_folder(folder, config)
    model = load_model(str(folder), device="cpu")
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, config.vocab_size, prompt_len)]
    ours = colibri_greedy(model, prompt, steps)
    sequence = prompt + ours
    reference = colibri_logits(model, sequence)
    record = dict(family=family, layers=config.num_layers, moe_layers=list(config.moe_layers),
                  prompt_tokens=prompt_len, generated_tokens=steps, colibri_tokens=ours)
    for matrices in ("bf16", "f32"):
        gguf_path = folder.with_name(f"{folder.name}-{matrices}.gguf")
        write_gguf(folder, gguf_path, gguf_py, matrices=matrices)
        llama = open_llama(llama_type, gguf_path, len(sequence) + 1, threads)
        theirs = llama_greedy(llama, prompt, steps)
        logits = llama_logits(llama, sequence)
        del llama
        gguf_path.unlink()
        record[matrices] = dict(
            llama_tokens=theirs, tokens_agreeing=agreeing_prefix(ours, theirs),
            logits_max_relative_difference=float(np.abs(logits - reference).max() / np.abs(reference).max()),
            argmax_agreement=float(np.mean(logits.argmax(-1) == reference.argmax(-1))))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-py", required=True, help="gguf-py folder of the llama.cpp source tree")
    parser.add_argument("--llama-lib", required=True, help="folder of a CPU build's libllama.so and libggml*.so")
    parser.add_argument("--llama-cpp-python", help="folder holding llama-cpp-python's llama_cpp package (an "
                        "unpacked sdist); default: the installed package")
    parser.add_argument("--families", nargs="+", default=list(TINY), choices=list(TINY))
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens generated by each engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="JSON records")
    args = parser.parse_args(argv)
    require_gguf_py(args.gguf_py, "llama_cpp_parity.py")
    if not list(Path(args.llama_lib).glob("libllama.*")):
        sys.exit(f"llama_cpp_parity.py needs a CPU build of libllama: {args.llama_lib} holds none")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(args.llama_lib).resolve())
    bindings = llama_bindings(args.llama_cpp_python)
    common = dict(machine(), bench="llama_cpp_parity", llama_cpp_python=bindings.__version__,
                  llama_lib=str(Path(args.llama_lib).resolve()))
    records = []
    with tempfile.TemporaryDirectory(prefix="colibri-llama-parity-") as scratch:
        for family in args.families:
            record = compare(family, Path(scratch) / family, bindings.Llama, Path(args.gguf_py),
                             args.prompt_tokens, args.tokens, args.threads)
            records.append(dict(common, **record))
            print(json.dumps(summary(record)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
