"""Turn train.py's weights into a Hugging Face Qwen3-MoE checkpoint folder, the input of `colibri export`.

Builds `transformers.Qwen3MoeForCausalLM` from the run's `results_moe.json` (its model arguments), loads the
bf16 shards (transformers' parameter names), checks that transformers and model.py compute the same logits on a
few random sequences (float32, relative error < 1e-4), then writes the folder with `save_pretrained` (bf16
safetensors), the tokenizer files and a generation_config.json whose eos ids are <|im_end|> and <|endoftext|>.

Usage: python export/default_model_provenance/to_hf.py RUN_DIR [--tokenizer .data/default_model/tokenizer]
                                                [--out .data/default_model/hf]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import CausalLM, ModelArgs

EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_run(run_dir: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    result = json.loads((run_dir / "results_moe.json").read_text())
    margs = ModelArgs(**result["model_args"])
    state: dict[str, torch.Tensor] = {}
    for shard in result["shards"]:
        state.update(load_file(str(run_dir / shard)))
    return margs, state, result


def build_hf(margs: ModelArgs, state: dict[str, torch.Tensor], dtype=torch.float32):
    import transformers

    config = margs.hf_config(bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=EOT_ID,
                             router_aux_loss_coef=0.01, output_router_logits=False)
    model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (margs.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"state does not match transformers' model: missing {missing}, unexpected {unexpected}")
    if margs.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def check_against_reference(margs: ModelArgs, state: dict[str, torch.Tensor], hf_model, seed: int = 0) -> float:
    """Max relative error between transformers' and model.py's float32 logits on random sequences."""
    ours = CausalLM(margs)
    ours.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if margs.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ours.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, margs.vocab_size, (2, 96), generator=g)
    with torch.no_grad():
        ref, _ = ours(ids)
        got = hf_model(input_ids=ids).logits
    err = float((got - ref).norm() / ref.norm())
    if not err < 1e-4:
        raise SystemExit(f"transformers and model.py disagree: relative error {err:.2e}")
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tokenizer", default=".data/default_model/tokenizer", type=Path)
    parser.add_argument("--out", default=".data/default_model/hf", type=Path)
    args = parser.parse_args()

    import transformers

    margs, state, _ = load_run(args.run_dir)
    model = build_hf(margs, state)
    err = check_against_reference(margs, state, model)
    print(f"transformers vs model.py logits: relative error {err:.2e}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    generation = transformers.GenerationConfig(eos_token_id=[IM_END_ID, EOT_ID], pad_token_id=EOT_ID,
                                               bos_token_id=None, do_sample=False)
    generation.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.tokenizer / name, args.out / name)
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
