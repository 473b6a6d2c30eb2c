"""Held-out evaluation of the shipped model on the CPU: unigram baseline, transformers bf16, the int8 export.

All numbers use the windows train.py evaluates: the `test` token stream cut into non-overlapping windows of
`--seq` + 1 tokens, each window's last `--seq` tokens predicted from the context inside the window.

    unigram        add-one smoothed token frequencies of the training split (no context at all)
    hf_bf16        transformers' Qwen3MoeForCausalLM on the Hugging Face folder (bf16 weights, float32 compute)
    export_int8    the same model with every routed expert replaced by the dequantised int8 expert read from the
                   exported folder's experts.bin (q * scale per output row) and every dense tensor read from its
                   dense.safetensors, so it measures exactly what the export stores

Bits per byte = total NLL / ln 2 / UTF-8 bytes of the predicted tokens (special tokens count 0 bytes).

Usage: python export/default_model_provenance/evaluate.py [--hf .data/default_model/hf]
           [--export colibri_stream/default_model] [--out benchmarks/data/default_model/eval_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def windows(tokens: np.ndarray, seq: int, max_windows: int = 0) -> np.ndarray:
    n = (tokens.size - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    return tokens[idx].astype(np.int64)  # [n, seq + 1]


def summary(nll_sum: float, count: int, nbytes: int) -> dict:
    mean = nll_sum / count
    return {"tokens": count, "bytes": nbytes, "nll": mean, "perplexity": math.exp(mean),
            "bits_per_byte": nll_sum / math.log(2) / nbytes}


def unigram(train: np.ndarray, targets: np.ndarray, token_bytes: np.ndarray, vocab: int) -> dict:
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return summary(float(-logp[targets].sum()), targets.size, int(token_bytes[targets].sum()))


@torch.no_grad()
def model_nll(model, w: np.ndarray, token_bytes: np.ndarray, batch: int) -> dict:
    nll_sum, count = 0.0, 0
    for start in range(0, len(w), batch):
        chunk = torch.from_numpy(w[start : start + batch])
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        nll_sum += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                         reduction="sum"))
        count += chunk[:, 1:].numel()
    return summary(nll_sum, count, int(token_bytes[w[:, 1:]].sum()))


def load_export_into(model, folder: Path) -> None:
    """Replace the HF model's weights by the exported folder's (dense bf16, experts dequantised from int8)."""
    from colibri_stream.checkpoint import ModelFolder
    from colibri_stream.expert_codecs import dequantize_expert

    mf = ModelFolder(folder, verify=True)
    cfg = mf.config
    body = model.model
    with torch.no_grad():
        def put(param, array):
            param.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))

        put(body.embed_tokens.weight, mf.dense.get("embed_tokens"))
        put(body.norm.weight, mf.dense.get("norm"))
        for i, layer in enumerate(body.layers):
            p = f"layers.{i}."
            put(layer.input_layernorm.weight, mf.dense.get(p + "input_norm"))
            put(layer.post_attention_layernorm.weight, mf.dense.get(p + "post_attention_norm"))
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                put(getattr(layer.self_attn, name).weight, mf.dense.get(p + name))
            put(layer.mlp.gate.weight, mf.dense.get(p + "router"))
            for e in range(cfg.num_experts):
                t = dequantize_expert(mf.experts.tensors(i, e))  # the format's dequantize (expert_codecs.py)
                gate, up, down = t["gate"], t["up"], t["down"]
                put(layer.mlp.experts.gate_up_proj[e], np.concatenate([gate, up], axis=0))
                put(layer.mlp.experts.down_proj[e], down)
        if not cfg.tie_word_embeddings:
            put(model.lm_head.weight, mf.dense.get("lm_head"))
    mf.experts.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=".data/default_model", type=Path)
    parser.add_argument("--hf", default=".data/default_model/hf", type=Path)
    parser.add_argument("--export", default="colibri_stream/default_model", type=Path)
    parser.add_argument("--out", default="benchmarks/data/default_model/eval_cpu.json", type=Path)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-windows", type=int, default=0, help="0: the whole test split")
    args = parser.parse_args()

    import transformers

    torch.manual_seed(0)
    tokens = args.data / "tokens"
    token_bytes = np.load(tokens / "token_bytes.npy").astype(np.int64)
    w = windows(np.load(tokens / "test.npy"), args.seq, args.max_windows)
    result: dict = {"split": "test", "seq": args.seq, "windows": len(w)}
    result["unigram"] = unigram(np.load(tokens / "train.npy"), w[:, 1:].reshape(-1), token_bytes, len(token_bytes))
    print("unigram", result["unigram"], flush=True)

    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    t0 = time.time()
    result["hf_bf16"] = model_nll(model, w, token_bytes, args.batch)
    print("hf bf16", result["hf_bf16"], f"{time.time() - t0:.0f}s", flush=True)
    load_export_into(model, args.export)
    result["export_int8"] = model_nll(model, w, token_bytes, args.batch)
    print("export int8", result["export_int8"], flush=True)
    result["int8_minus_bf16"] = {
        "nll": result["export_int8"]["nll"] - result["hf_bf16"]["nll"],
        "perplexity": result["export_int8"]["perplexity"] - result["hf_bf16"]["perplexity"],
        "perplexity_relative": result["export_int8"]["perplexity"] / result["hf_bf16"]["perplexity"] - 1,
        "bits_per_byte": result["export_int8"]["bits_per_byte"] - result["hf_bf16"]["bits_per_byte"],
    }
    print("delta", result["int8_minus_bf16"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
