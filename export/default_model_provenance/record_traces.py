"""Record routing traces of the shipped default model on held-out text.

Runs the exported model (dense tensors and dequantised int8 experts read from the model folder, computed by
transformers' Qwen3MoeForCausalLM in float32) over `--windows` windows of `--seq` tokens of the `test` split, each
starting at a document start (after <|endoftext|>), spread evenly over the split. For every window, layer and
token it stores the router's top-k experts and their renormalised weights, in the router's order (descending
weight).

Output (`numpy.savez_compressed`):

    tokens          uint16  [S, T]        token ids of each window
    expert_ids      uint8   [S, L, T, K]  chosen experts
    expert_weights  float16 [S, L, T, K]  their combine weights (sum to 1 over K)
    window_starts   int64   [S]           offset of each window in test.npy
    meta            str                   JSON: model config summary, split, corpus and tokenizer hashes,
                                          top-k agreement with the bf16 (unquantised) model

Usage: python export/default_model_provenance/record_traces.py [--export colibri_stream/default_model]
           [--hf .data/default_model/hf] [--out benchmarks/data/default_model/traces_test.npz]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate import load_export_into

EOT_ID = 0


def window_starts(tokens: np.ndarray, seq: int, count: int) -> np.ndarray:
    starts = np.flatnonzero(tokens[:-1] == EOT_ID) + 1
    starts = starts[starts + seq <= tokens.size]
    picks = np.linspace(0, len(starts) - 1, count).round().astype(int)
    return starts[picks]


@torch.no_grad()
def route(model, ids: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
    out = model(input_ids=ids, output_router_logits=True)
    ids_all, w_all = [], []
    for logits in out.router_logits:  # per layer [B*T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        w, i = torch.topk(probs, top_k, dim=-1)
        if norm_topk:
            w = w / w.sum(-1, keepdim=True)
        ids_all.append(i.reshape(ids.shape[0], ids.shape[1], top_k))
        w_all.append(w.reshape(ids.shape[0], ids.shape[1], top_k))
    return torch.stack(ids_all, 1).numpy(), torch.stack(w_all, 1).numpy()  # [B, L, T, K]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=".data/default_model", type=Path)
    parser.add_argument("--hf", default=".data/default_model/hf", type=Path)
    parser.add_argument("--export", default="colibri_stream/default_model", type=Path)
    parser.add_argument("--out", default="benchmarks/data/default_model/traces_test.npz", type=Path)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()

    import transformers

    tokens = np.load(args.data / "tokens" / "test.npy")
    starts = window_starts(tokens, args.seq, args.windows)
    ids = torch.from_numpy(np.stack([tokens[s : s + args.seq] for s in starts]).astype(np.int64))

    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    cfg = model.config
    bf16_ids, _ = route(model, ids, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    load_export_into(model, args.export)
    expert_ids, expert_weights = route(model, ids, cfg.num_experts_per_tok, cfg.norm_topk_prob)

    same_set = np.mean([set(a) == set(b) for a, b in zip(expert_ids.reshape(-1, expert_ids.shape[-1]),
                                                          bf16_ids.reshape(-1, bf16_ids.shape[-1]))])
    same_first = float(np.mean(expert_ids[..., 0] == bf16_ids[..., 0]))
    manifest = json.loads((args.data / "corpus" / "manifest.json").read_text())
    meta = {
        "model": "colibri_stream/default_model (int8 experts)",
        "architecture": "qwen3_moe",
        "num_layers": cfg.num_hidden_layers, "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "split": "test", "seq": args.seq, "window_starts": [int(s) for s in starts],
        "python_corpus": manifest["python"], "corpus_test_sha256": manifest["sha256"]["test.jsonl"],
        "tokenizer_sha256": hashlib.sha256((args.export / "tokenizer.json").read_bytes()).hexdigest(),
        "agreement_with_bf16": {"same_topk_set": float(same_set), "same_first_choice": same_first},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, tokens=ids.numpy().astype(np.uint16), expert_ids=expert_ids.astype(np.uint8),
                        expert_weights=expert_weights.astype(np.float16), window_starts=starts.astype(np.int64),
                        meta=np.array(json.dumps(meta)))
    print(json.dumps(meta, indent=2))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
