"""Train the default model (or its dense baseline) on the tokenized corpus; evaluate and save it.

Seeded and fixed-length: the data order (random windows drawn by a seeded numpy generator), the initial weights
and the schedule depend only on the arguments, so a run is reproducible up to the GPU's floating-point
nondeterminism. Needs torch and numpy only.

Recipe (the defaults are the shipped model's): AdamW (betas 0.9/0.95, weight decay on matrices only), linear
warm-up then cosine decay to 10 % of the peak, gradient clipping at 1.0, bf16 autocast, windows of `--seq` tokens
drawn uniformly from the training stream.
The MoE model adds `--aux-coef` times the load-balancing loss (E * sum_e f_e P_e, averaged over layers) and
`--z-coef` times the router z-loss. The validation split is evaluated `--evals` times during training; the weights
with the lowest validation loss are kept (early stopping on `valid`; `test` is never looked at until the end).

At the end, on the `test` split (non-overlapping windows of `--seq` tokens, every token predicted once with the
context inside its window): mean NLL per token, perplexity and bits per byte, with the weights rounded to bf16
(what the export stores) and, for the MoE, also with every routed expert quantised to int8 per output row and
dequantised (the export's int8 rule); and per-layer routing statistics over the same tokens.

Writes to OUT: weights as bf16 safetensors shards (transformers' names, <= 12 MiB each; skipped with
--no-save), `results_moe.json` or `results_dense.json` (arguments, parameter counts, timings, the evaluation above, the validation curve).

Usage (GPU): python export/default_model_provenance/train.py --data .data/default_model --out OUT [--dense] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import CausalLM, ModelArgs, hf_state_dict, quantize_dequantize_int8, router_losses


def log(msg: str) -> None:
    print(msg, flush=True)


def param_counts(model: CausalLM) -> dict:
    a = model.a
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    expert = sum(p.numel() for p in model.expert_parameters())
    active = total - expert + (expert * a.top_k // a.num_experts if a.num_experts else 0)
    embed = a.vocab_size * a.hidden_size
    return {"total": total, "routed_expert": expert, "active_per_token": active,
            "active_non_embedding": active - embed, "embedding": embed}


@torch.no_grad()
def evaluate(model: CausalLM, tokens: torch.Tensor, token_bytes: torch.Tensor, seq: int, batch: int,
             routing: bool = False, max_windows: int | None = None) -> dict:
    """NLL over non-overlapping windows of `seq` + 1 tokens of a split; optionally routing counts per layer."""
    model.eval()
    n_windows = (tokens.numel() - 1) // seq
    if max_windows:
        n_windows = min(n_windows, max_windows)
    nll_sum, count, nbytes = 0.0, 0, 0
    a = model.a
    counts = torch.zeros(a.num_layers, max(a.num_experts, 1), dtype=torch.float64, device=tokens.device)
    for start in range(0, n_windows, batch):
        idx = torch.arange(start, min(start + batch, n_windows), device=tokens.device)[:, None] * seq
        window = tokens[idx + torch.arange(seq + 1, device=tokens.device)].long()
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits, routes = model(window[:, :-1])
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1),
                              reduction="sum")
        nll_sum += float(nll)
        count += window[:, 1:].numel()
        nbytes += int(token_bytes[window[:, 1:]].sum())
        if routing and a.num_experts:
            for layer, r in enumerate(routes):
                counts[layer] += torch.bincount(r["top_i"].reshape(-1), minlength=a.num_experts).double()
    model.train()
    mean = nll_sum / count
    out = {"tokens": count, "bytes": nbytes, "nll": mean, "perplexity": math.exp(mean),
           "bits_per_byte": nll_sum / math.log(2) / nbytes}
    if routing and a.num_experts:
        out["routing"] = routing_stats(counts.cpu().numpy(), a.top_k)
    return out


def routing_stats(counts: np.ndarray, top_k: int) -> dict:
    """Per layer: load share of each expert, normalised entropy, coefficient of variation, top-25 % share."""
    layers = []
    e = counts.shape[1]
    quarter = max(1, e // 4)
    for row in counts:
        share = row / row.sum()
        nz = share[share > 0]
        layers.append({
            "load_share": [round(float(s), 5) for s in share],
            "entropy_normalised": float(-(nz * np.log(nz)).sum() / np.log(e)),
            "cv": float(row.std() / row.mean()),
            "top25_share": float(np.sort(share)[::-1][:quarter].sum()),
            "max_share": float(share.max()),
            "min_share": float(share.min()),
        })
    return {"layers": layers, "routes_per_layer": int(counts[0].sum()), "top_k": top_k,
            "mean_entropy_normalised": float(np.mean([x["entropy_normalised"] for x in layers])),
            "mean_cv": float(np.mean([x["cv"] for x in layers])),
            "mean_top25_share": float(np.mean([x["top25_share"] for x in layers]))}


def save_shards(state: dict[str, torch.Tensor], out: Path, limit: int = 12 << 20) -> list[str]:
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        t = tensor.detach().to(torch.bfloat16).contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        shards.append(current)
    names = []
    for n, shard in enumerate(shards):
        name = f"weights-{n + 1:02d}-of-{len(shards):02d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
    return names


def lr_at(step: int, steps: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=".data/default_model", type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dense", action="store_true", help="dense baseline: intermediate = top_k * expert width")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=1536)
    p.add_argument("--batch", type=int, default=32, help="windows per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.5)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--z-coef", type=float, default=1e-3)
    p.add_argument("--evals", type=int, default=8, help="validation evaluations during training")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--max-eval-windows", type=int, default=0, help="cap on evaluated windows (0: whole split)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop early past this (0: no limit); recorded")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokens_dir = args.data / "tokens"
    train_np = np.load(tokens_dir / "train.npy")
    valid = torch.from_numpy(np.load(tokens_dir / "valid.npy").astype(np.int32)).to(device)
    test = torch.from_numpy(np.load(tokens_dir / "test.npy").astype(np.int32)).to(device)
    train = torch.from_numpy(train_np.astype(np.int32)).to(device)
    token_bytes = torch.from_numpy(np.load(tokens_dir / "token_bytes.npy").astype(np.int64)).to(device)

    margs = ModelArgs(hidden_size=args.hidden, num_layers=args.layers, top_k=args.top_k,
                      moe_intermediate_size=args.expert_width, max_position_embeddings=args.seq,
                      num_experts=0 if args.dense else args.experts,
                      intermediate_size=args.top_k * args.expert_width)
    model = CausalLM(margs)
    model.init_weights(args.seed)
    model.to(device)
    counts = param_counts(model)
    log(f"{'dense' if args.dense else 'moe'} params {counts}")

    decay = [p_ for p_ in model.parameters() if p_.dim() >= 2]
    no_decay = [p_ for p_ in model.parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    rng = np.random.default_rng(args.seed)
    n_train = train.numel()
    offsets_range = torch.arange(args.seq + 1, device=device)
    eval_every = max(1, args.steps // max(1, args.evals))
    curve, best = [], {"loss": float("inf"), "step": -1, "state": None}
    t0 = time.time()
    tokens_seen, step, stopped_early = 0, 0, False
    if device.type == "cuda":
        torch.cuda.synchronize()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.lr * 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.from_numpy(rng.integers(0, n_train - args.seq - 1, size=args.batch)).to(device)
        window = train[starts[:, None] + offsets_range].long()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits, routes = model(window[:, :-1])
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            aux, z = router_losses(routes, margs.num_experts, margs.top_k)
            loss = ce + args.aux_coef * aux.to(ce.device) + args.z_coef * z.to(ce.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += window[:, 1:].numel()
        last = step == args.steps - 1
        if step % 50 == 0 or last:
            elapsed = time.time() - t0
            log(f"step {step:5d} lr {lr:.2e} ce {ce.item():.4f} aux {aux.item():.4f} z {z.item():.2f} "
                f"gnorm {grad_norm.item():.2f} tok/s {tokens_seen / max(elapsed, 1e-9):,.0f} t {elapsed:.0f}s")
        over_time = args.max_minutes and time.time() - t0 > args.max_minutes * 60
        if (step + 1) % eval_every == 0 or last or over_time:
            v = evaluate(model, valid, token_bytes, args.seq, args.eval_batch, max_windows=args.max_eval_windows)
            curve.append({"step": step + 1, "tokens": tokens_seen, "valid_nll": v["nll"],
                          "train_ce": float(ce.item()), "time_s": time.time() - t0})
            log(f"  valid step {step + 1} nll {v['nll']:.4f} ppl {v['perplexity']:.2f} bpb {v['bits_per_byte']:.4f}")
            if v["nll"] < best["loss"]:
                best = {"loss": v["nll"], "step": step + 1, "state": copy.deepcopy(model.state_dict())}
        if over_time:
            stopped_early = True
            log(f"stopping at step {step + 1}: past --max-minutes")
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t0

    model.load_state_dict(best["state"])
    with torch.no_grad():  # the stored precision
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    result = {
        "kind": "dense" if args.dense else "moe",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_args": margs.to_dict(),
        "params": counts,
        "train_tokens_available": int(n_train),
        "steps_run": step + 1,
        "stopped_early": stopped_early,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / n_train,
        "train_time_s": train_time,
        "tokens_per_s": tokens_seen / train_time,
        "best_valid_step": best["step"],
        "valid_curve": curve,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    t1 = time.time()
    result["valid_bf16"] = evaluate(model, valid, token_bytes, args.seq, args.eval_batch, max_windows=args.max_eval_windows)
    result["test_bf16"] = evaluate(model, test, token_bytes, args.seq, args.eval_batch, routing=True,
                                  max_windows=args.max_eval_windows)
    log(f"test bf16: {json.dumps({k: v for k, v in result['test_bf16'].items() if k != 'routing'})}")
    if not args.dense:
        r = result["test_bf16"]["routing"]
        log(f"routing: entropy {r['mean_entropy_normalised']:.4f} cv {r['mean_cv']:.3f} "
            f"top25 {r['mean_top25_share']:.3f}")
        bf16_state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for param in model.expert_parameters():
                param.copy_(quantize_dequantize_int8(param.to(torch.bfloat16)).float())
        result["test_int8_experts"] = evaluate(model, test, token_bytes, args.seq, args.eval_batch, max_windows=args.max_eval_windows)
        result["valid_int8_experts"] = evaluate(model, valid, token_bytes, args.seq, args.eval_batch, max_windows=args.max_eval_windows)
        log(f"test int8 experts: {json.dumps(result['test_int8_experts'])}")
        model.load_state_dict(bf16_state)
    result["eval_time_s"] = time.time() - t1
    if not args.no_save:
        result["shards"] = save_shards(hf_state_dict(model), args.out)
    name = "results_dense.json" if args.dense else "results_moe.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out / name}; train {train_time:.0f}s, eval {result['eval_time_s']:.0f}s")


if __name__ == "__main__":
    main()
