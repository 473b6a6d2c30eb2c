"""Decode speed of transformers + accelerate offloading under a GPU memory budget: the baseline that Colibri's expert
offload is compared with.

A random-weight model of a published MoE shape (colibri_stream.synthetic.SHAPES, cut to --layers decoder layers) is
built in transformers (MixtralConfig, Qwen3MoeConfig or OlmoeConfig; bf16; the same eager attention and eager
experts as the transformers baseline of benchmarks/decode.py) on the CPU without its slow initialisation (created
on the meta device, materialised with `to_empty`, filled on every core with N(0, 1/fan_in) matrices, N(0, 1)
embeddings and 1 + N(0, 0.1) norm weights, drawn as write_synthetic_folder draws them on a CPU). Then
`accelerate.infer_auto_device_map(model, max_memory={0: weights budget, "cpu": ...}, no_split_module_classes=
model._no_split_modules)` places whole decoder layers, and `accelerate.dispatch_model` runs it: modules mapped to
"cpu" stay in host memory and accelerate's hooks copy their weights to the GPU at every forward (all of a layer's
experts, whatever the routing). That is accelerate's offloading as a transformers user gets it with
`device_map="auto"` and a `max_memory` cap.

Budget. --gpu-budget-gb B is the GPU memory given to the model in all: accelerate's `max_memory[0]` (weights) is
B - allowance, where allowance = --allowance-gb (default 1 GB: activations, logits, CUDA workspaces) plus the KV
cache of the run (2 x layers x batch x tokens x kv_heads x head_dim x 2 bytes). --gpu-expert-fraction F instead
sets B = dense weight bytes + F x all routed expert bytes + allowance (bytes from the config: bf16, dense =
every tensor of `dense_tensor_specs`, embedding and lm_head included). accelerate takes the room for staging one
offloaded layer (the largest) out of the weights budget, so fewer than F of the experts end up resident; the
record gives the layers placed on each side and the resident fraction.

Timing (greedy, KV cache, torch.cuda.synchronize around each timed part): one untimed 1-token forward (CUDA and
cuBLAS initialisation), a prefill of --prompt-tokens random ids at --batch (timed: prefill tok/s), --warmup-tokens
untimed decode steps, then --new-tokens timed decode steps, each bringing its token ids to the host as a server
would: decode tok/s = batch x new tokens / seconds. Without CUDA (or with --device cpu) the model runs plainly on
the CPU (no dispatch) and the record carries the device map accelerate would have planned for the budget.

    python benchmarks/offload_accelerate.py --shape mixtral-8x7b --layers 8 --gpu-budget-gb 8 --batch 1 \\
        --prompt-tokens 16 --new-tokens 4 --warmup-tokens 1 --json OUT.json
    python benchmarks/offload_accelerate.py --tiny --device cpu --gpu-expert-fraction 0.25     # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from colibri_stream.checkpoint import dense_tensor_specs
from colibri_stream.config import ModelConfig
from colibri_stream.synthetic import WeightDraw, pooled_normal, shape_config

DEFAULT_ALLOWANCE_GB = 1.0  # GB (1e9 bytes) kept off the weights: activations, logits, workspaces (+ the KV cache)
CPU_MEMORY = 1 << 50  # accelerate's "cpu" budget: unbounded
FILL_CHUNK = 1 << 24  # values per parallel fill job
WEIGHT_BYTES = 2  # bf16


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON record)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tiny(config: ModelConfig) -> ModelConfig:
    """The shape shrunk to run in seconds on a CPU (same layers, experts and top-k)."""
    return dataclasses.replace(config, vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                               moe_intermediate_size=256, max_position_embeddings=512)


def hf_config(config: ModelConfig, experts_implementation: str = "eager"):
    """The transformers config of a Colibri ModelConfig (every layer MoE, no shared expert)."""
    import transformers

    if config.shared_expert_intermediate_size or len(config.moe_layers) != config.num_layers:
        raise ValueError("the baseline builds models whose every layer is a plain MoE block")
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                  head_dim=config.head_dim, num_experts_per_tok=config.top_k, rms_norm_eps=config.rms_norm_eps,
                  max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": config.rope.theta},
                  experts_implementation=experts_implementation)
    i = config.moe_intermediate_size
    if config.architecture == "mixtral":
        hf = transformers.MixtralConfig(**common, intermediate_size=i, num_local_experts=config.num_experts)
    elif config.architecture == "qwen3_moe":
        hf = transformers.Qwen3MoeConfig(**common, intermediate_size=i, moe_intermediate_size=i,
                                         num_experts=config.num_experts, norm_topk_prob=config.norm_topk_prob,
                                         decoder_sparse_step=1, mlp_only_layers=[])
    elif config.architecture == "olmoe":
        hf = transformers.OlmoeConfig(**common, intermediate_size=i, num_experts=config.num_experts,
                                      norm_topk_prob=config.norm_topk_prob, clip_qkv=config.clip_qkv)
    else:
        raise ValueError(f"no transformers baseline for {config.architecture}")
    return hf


def fill_random_(model, seed: int = 0, threads: int | None = None) -> None:
    """Fill every (bf16) parameter in place, chunk by chunk on `threads` threads, with the CPU draw of
    write_synthetic_folder (`pooled_normal`: windows of a random pool, memory-bound; torch's normal_ on bf16 ran
    at 0.06 GB/s per core on the H200 host, 0.8 GB/s on its 16 threads, against 4 GB/s for this): norm weights
    1 + N(0, 0.1), other vectors N(0, 0.02), the embedding N(0, 1), matrices (2-D, and the 3-D fused experts)
    N(0, 1/fan_in) with fan_in the last dimension."""
    import torch

    jobs = []
    for index, (name, param) in enumerate(model.named_parameters()):
        if param.dtype != torch.bfloat16:
            raise TypeError(f"{name} is {param.dtype}, not bfloat16")
        if param.ndim == 1:
            mean, std = (1.0, 0.1) if "norm" in name else (0.0, 0.02)
        else:
            mean, std = 0.0, 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
        flat = param.data.view(-1)
        for start in range(0, flat.numel(), FILL_CHUNK):
            jobs.append((flat[start:start + FILL_CHUNK], mean, std, (seed * 1_000_003 + index) * 65_537 + start))

    def fill(job) -> None:
        chunk, mean, std, chunk_seed = job
        values = pooled_normal(WeightDraw((chunk.numel(),), std, chunk_seed, "bfloat16", mean))
        chunk.copy_(torch.from_numpy(values.view(np.uint16)).view(torch.bfloat16))

    with torch.no_grad(), ThreadPoolExecutor(threads or os.cpu_count()) as pool:
        list(pool.map(fill, jobs))


def build_model(config: ModelConfig, seed: int = 0, attn_implementation: str = "eager",
                experts_implementation: str = "eager"):
    """A bf16 transformers model of `config` on the CPU with random weights, built without transformers' init."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(config, experts_implementation),
                                                              dtype=torch.bfloat16,
                                                              attn_implementation=attn_implementation)
    model.to_empty(device="cpu")
    fill_random_(model, seed)
    # to_empty left the buffers uninitialised: the rotary tables are the only ones, rebuilt here on the CPU.
    rebuilt = set()
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(model.config)
            for buffer_name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, buffer_name).copy_(buffer)
                rebuilt.add(f"{name}.{buffer_name}")
    others = sorted({n for n, _ in model.named_buffers()} - rebuilt)
    if others:
        raise RuntimeError(f"buffers left uninitialised by to_empty: {others}")
    return model.eval()


def model_bytes(config: ModelConfig) -> tuple[int, int]:
    """(dense weight bytes, all routed expert bytes) of `config` in bf16."""
    dense = sum(int(np.prod(shape)) for shape in dense_tensor_specs(config).values()) * WEIGHT_BYTES
    experts = len(config.moe_layers) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    return dense, experts * WEIGHT_BYTES


def kv_bytes(config: ModelConfig, batch: int, tokens: int) -> int:
    return 2 * config.num_layers * batch * tokens * config.num_kv_heads * config.head_dim * WEIGHT_BYTES


def placement(device_map: dict, num_layers: int) -> dict:
    """Where each decoder layer went (the device of the longest device-map key that contains it)."""
    def device_of(module: str):
        parts = module.split(".")
        for end in range(len(parts), -1, -1):
            key = ".".join(parts[:end])
            if key in device_map:
                return device_map[key]
        inner = {device_map[k] for k in device_map if k.startswith(module + ".")}
        return "split" if len(inner) > 1 else next(iter(inner), "none")

    layers = [device_of(f"model.layers.{layer}") for layer in range(num_layers)]
    others = {k: str(v) for k, v in device_map.items() if not re.fullmatch(r"model\.layers\.\d+", k)}
    return {"layers_on_gpu": sum(d not in ("cpu", "disk", "split", "none") for d in layers),
            "layers_on_cpu": sum(d == "cpu" for d in layers), "layer_devices": [str(d) for d in layers],
            "other_modules": others}


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "python": platform.python_version(), "cpu_cores": os.cpu_count()}


def run_offload_baseline(shape: str = "mixtral-8x7b", layers: int = 8, gpu_budget_gb: float | None = None,
                         gpu_expert_fraction: float | None = None, batch: int = 1, prompt_tokens: int = 16,
                         new_tokens: int = 4, warmup_tokens: int = 1, device: str = "auto", tiny_shape: bool = False,
                         allowance_gb: float = DEFAULT_ALLOWANCE_GB, seed: int = 0,
                         attn_implementation: str = "eager", experts_implementation: str = "eager") -> dict:
    """One measurement; returns the JSON record (see the module docstring)."""
    import accelerate
    import torch

    started = time.perf_counter()
    if (gpu_budget_gb is None) == (gpu_expert_fraction is None):
        raise ValueError("give exactly one of gpu_budget_gb and gpu_expert_fraction")
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device is auto, cuda or cpu, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    torch.set_num_threads(os.cpu_count())
    config = shape_config(shape, layers)
    if tiny_shape:
        config = tiny(config)
    dense, experts = model_bytes(config)
    allowance = round(allowance_gb * 1e9) + kv_bytes(config, batch, prompt_tokens + warmup_tokens + new_tokens + 1)
    budget = round(gpu_budget_gb * 1e9) if gpu_budget_gb is not None else round(
        dense + gpu_expert_fraction * experts + allowance)
    weights_budget = budget - allowance
    if weights_budget <= 0:
        raise ValueError(f"a GPU budget of {budget / 1e9:.2f} GB leaves nothing for weights after the allowance "
                         f"of {allowance / 1e9:.2f} GB")

    log(f"building {shape} ({layers} layers{', tiny' if tiny_shape else ''}) on the CPU, "
        f"{(dense + experts) / 1e9:.2f} GB bf16")
    start = time.perf_counter()
    model = build_model(config, seed, attn_implementation, experts_implementation)
    init_s = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    if held != dense + experts:
        raise RuntimeError(f"transformers' model holds {held} bytes, the config implies {dense + experts}")

    start = time.perf_counter()
    device_map = accelerate.infer_auto_device_map(model, max_memory={0: weights_budget, "cpu": CPU_MEMORY},
                                                  no_split_module_classes=list(model._no_split_modules))
    where = placement(device_map, config.num_layers)
    log(f"device map for {weights_budget / 1e9:.2f} GB of weights: {where['layers_on_gpu']} layers on the GPU, "
        f"{where['layers_on_cpu']} on the CPU; {where['other_modules']}")
    if on_gpu:
        # main_device 0: modules mapped to "cpu" run on the GPU (accelerate's offload), even when all of them are:
        # a one-device map gets no hooks unless forced, and {"": "cpu"} must name modules (dispatch_model finds
        # no weights under the empty name).
        all_cpu = set(device_map.values()) == {"cpu"}
        model = accelerate.dispatch_model(
            model, device_map={name: "cpu" for name, _ in model.named_children()} if all_cpu else device_map,
            main_device=0, force_hooks=all_cpu)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_device = torch.device("cuda", 0)
    else:
        resident, run_device = None, torch.device("cpu")
    dispatch_s = time.perf_counter() - start

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_tokens), generator=generator).to(run_device)
    with torch.inference_mode():
        model(input_ids=prompt[:1, :1], use_cache=True, logits_to_keep=1)  # untimed: CUDA/cuBLAS initialisation
        sync()
        start = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        tokens = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.cpu()
        sync()
        prefill_s = time.perf_counter() - start
        cache = out.past_key_values
        step_s = []
        for step in range(warmup_tokens + new_tokens):
            sync()
            start = time.perf_counter()
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.cpu()  # the sampled ids reach the host every step, as in a server
            sync()
            if step >= warmup_tokens:
                step_s.append(time.perf_counter() - start)
            if not torch.isfinite(logits).all():
                raise RuntimeError("non-finite logits")
    decode_s = sum(step_s)
    resident_layers = where["layers_on_gpu"] if on_gpu else None
    record = {
        "bench": "offload_baseline", "baseline": "transformers+accelerate", "shape": shape, "layers": layers,
        "tiny": tiny_shape, "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "warmup_tokens": warmup_tokens, "device": "cuda" if on_gpu else "cpu", "dispatched": on_gpu,
        "gpu_budget_bytes": budget, "gpu_weights_budget_bytes": weights_budget, "allowance_bytes": allowance,
        "gpu_expert_fraction": gpu_expert_fraction, "dense_bytes": dense, "expert_bytes": experts,
        "decode_tok_s": batch * new_tokens / decode_s if decode_s else None, "decode_step_s": step_s,
        "prefill_tok_s": batch * prompt_tokens / prefill_s, "prefill_s": prefill_s,
        "layers_on_gpu": where["layers_on_gpu"], "layers_on_cpu": where["layers_on_cpu"],
        "layer_devices": where["layer_devices"], "other_modules": where["other_modules"],
        "resident_expert_fraction": None if resident_layers is None else resident_layers / config.num_layers,
        "gpu_resident_gb": None if resident is None else resident / 1e9,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "attn_implementation": str(model.config._attn_implementation),
        "experts_implementation": str(getattr(model.config, "_experts_implementation", "unknown")),
        "init_s": init_s, "dispatch_s": dispatch_s, "wall_s": time.perf_counter() - started,
        "weights": "random: matrices N(0, 1/fan_in), embedding N(0, 1), norms 1 + N(0, 0.1); bf16",
        "timing": "wall clock per step, torch.cuda.synchronize around it, token ids to the host every step",
        **versions(),
    }
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b", help="a colibri_stream.synthetic.SHAPES name")
    parser.add_argument("--layers", type=int, default=8)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--gpu-budget-gb", type=float, help="GPU memory for the model in all (1e9 bytes)")
    budget.add_argument("--gpu-expert-fraction", type=float,
                        help="budget = dense bytes + F x expert bytes + allowance")
    parser.add_argument("--allowance-gb", type=float, default=DEFAULT_ALLOWANCE_GB,
                        help="GB of the budget kept off the weights (plus the KV cache)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--warmup-tokens", type=int, default=1)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="shrink hidden, intermediate and vocabulary sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn-implementation", default="eager")
    parser.add_argument("--experts-implementation", default="eager")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("accelerate") is None:
        sys.exit("offload_accelerate.py needs accelerate, the baseline it measures (pip install accelerate)")
    record = run_offload_baseline(
        args.shape, args.layers, args.gpu_budget_gb, args.gpu_expert_fraction, args.batch, args.prompt_tokens,
        args.new_tokens, args.warmup_tokens, args.device, args.tiny, args.allowance_gb, args.seed,
        args.attn_implementation, args.experts_implementation)
    record["command"] = " ".join(sys.argv if argv is None else ["offload_accelerate.py", *argv])
    text = json.dumps(record)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
