"""Tiny pre-quantized Hugging Face checkpoints in the published formats, built from a random Qwen3-MoE model (FP8
also from a DeepSeek-V3 one, as DeepSeek ships it; MXFP4 from a gpt-oss one, as OpenAI ships it).

The FP8 and compressed-tensors ones write per-expert tensors (`model.layers.L.mlp.experts.E.gate_proj.weight`, as
the published checkpoints name them) and return the float32 state dict that the stored values dequantize to, in the
layout of the transformers model (fused experts), so a float model loaded with it is the reference. The MXFP4 one
writes gpt-oss's fused `*_blocks` / `*_scales` stacks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_hf_model

FP8_TILE = 128
# Linear weights quantized in both formats: attention (DeepSeek-V3's latent projections too) and the experts (and
# shared and dense MLPs); the router, its bias, norms, embeddings and lm_head stay bfloat16, as in the published
# checkpoints
QUANTIZED = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
             ".self_attn.o_proj.weight", ".self_attn.q_a_proj.weight", ".self_attn.q_b_proj.weight",
             ".self_attn.kv_a_proj_with_mqa.weight", ".self_attn.kv_b_proj.weight", ".gate_proj.weight",
             ".up_proj.weight", ".down_proj.weight")
# The routers and Qwen2-MoE's shared expert gate: Linear modules too, which the formats' skip lists usually leave
# unquantized (the builders' defaults do)
ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")


def per_expert(state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """The fused [E, 2I, H] / [E, H, I] experts of a transformers state dict as per-expert [out, in] weights."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = fused[:inter], fused[inter:]
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": w for e, w in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


def fused(weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights back in the fused layout of the state dict `like`."""
    out = {}
    for name, tensor in like.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            base, kind = name.rsplit(".", 1)
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            out[name] = torch.stack([torch.cat([weights[f"{base}.{e}.{p}.weight"] for p in parts])
                                     for e in range(tensor.shape[0])])
        else:
            out[name] = weights[name]
    return out


def _write(folder: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> None:
    (folder / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def fp8_tiles(weight: torch.Tensor, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)]): DeepSeek-V3's
    block quantization, amax / 448 per tile, the last tiles partial; scale_fmt "ue8m0" (DeepSeek-V3.1) rounds each
    scale up to a power of two, as transformers quantizes for it."""
    out, inp = weight.shape
    rows, cols = -(-out // FP8_TILE), -(-inp // FP8_TILE)
    padded = torch.nn.functional.pad(weight.abs(), (0, cols * FP8_TILE - inp, 0, rows * FP8_TILE - out))
    scale = padded.reshape(rows, FP8_TILE, cols, FP8_TILE).amax(dim=(1, 3)) / 448.0  # [rows, cols]
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    spread = scale.repeat_interleave(FP8_TILE, 0).repeat_interleave(FP8_TILE, 1)[:out, :inp]
    return (weight / spread).to(torch.float8_e4m3fn), scale


def fp8_dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    spread = scale.repeat_interleave(FP8_TILE, 0).repeat_interleave(FP8_TILE, 1)[: values.shape[0], : values.shape[1]]
    return values.float() * spread


def build_fp8_checkpoint(folder: Path, arch: str = "qwen3_moe", modules_to_not_convert=("lm_head", "mlp.gate"),
                         scale_fmt: str = "float", **overrides) -> dict[str, torch.Tensor]:
    """A checkpoint of `arch` as the `-FP8` releases (and DeepSeek-V3; DeepSeek-V3.1 with `scale_fmt` "ue8m0") ship
    it: its Linear weights fp8 but those `modules_to_not_convert` names (matched as transformers matches them);
    returns the dequantized float32 state dict."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = build_hf_model(arch, folder, **overrides)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stored, dequantized = {}, {}
    for name, weight in per_expert(state, model.config.moe_intermediate_size).items():
        module = name[: -len(".weight")]
        if name.endswith(QUANTIZED + ROUTERS) and should_convert_module(module, list(modules_to_not_convert)):
            stored[name], stored[name + "_scale_inv"] = fp8_tiles(weight, scale_fmt)
            dequantized[name] = fp8_dequantized(stored[name], stored[name + "_scale_inv"])
        else:
            stored[name] = weight.to(torch.bfloat16)
            dequantized[name] = stored[name].float()
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_TILE, FP8_TILE], "modules_to_not_convert": list(modules_to_not_convert)}
    _write(folder, stored, dict(quantization, scale_fmt=scale_fmt) if scale_fmt != "float" else quantization)
    return fused(dequantized, state)


def compressed_tensors_scheme(group_size: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size))


def build_pack_quantized_checkpoint(folder: Path, group_size: int = 32, symmetric: bool = True, seed: int = 0,
                                    arch: str = "qwen3_moe", ignore=("lm_head", "re:.*mlp.gate$"),
                                    **overrides) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint of `arch` (Qwen3-MoE by default) compressed by compressed-tensors' own pack-quantized compressor
    (min-max scales from its calculate_qparams, bfloat16 as llm-compressor stores them): its Linear weights but
    the modules `ignore` names (config.json's ignore list: names and `re:` patterns, matched by the library's
    match_name). Returns the float32 state dict the library decompresses to (with the scales widened to float32)
    and the stored tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils.match import match_name

    model = build_hf_model(arch, folder, seed, **overrides)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scheme = compressed_tensors_scheme(group_size, symmetric)
    stored, dequantized = {}, {}
    for name, weight in per_expert(state, model.config.moe_intermediate_size).items():
        module = name[: -len(".weight")]
        if not name.endswith(QUANTIZED + ROUTERS) or any(match_name(module, target) for target in ignore):
            stored[name] = weight.to(torch.bfloat16)
            dequantized[name] = stored[name].float()
            continue
        groups = weight.reshape(weight.shape[0], -1, group_size)
        scale, zero = calculate_qparams(groups.amin(2), groups.amax(2), scheme.weights)
        module = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}, scheme)
        base = name[: -len("weight")]
        stored.update({base + key: value for key, value in module.items()})
        wide = dict(module, weight_scale=module["weight_scale"].float())
        dequantized[name] = PackedQuantizationCompressor.decompress(wide, scheme)["weight"].float()
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=list(ignore))
    _write(folder, stored, config.model_dump(mode="json"))
    return fused(dequantized, state), stored


MXFP4_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def build_mxfp4_checkpoint(folder: Path, seed: int = 0, arch: str = "gpt_oss", **overrides) -> dict[str, torch.Tensor]:
    """A gpt-oss checkpoint as openai/gpt-oss-20b ships it: each layer's expert stacks as MXFP4 (random codes, and
    exponents 2**-7 .. 2**-4 that keep the weights near the model's spread), everything else bfloat16; another
    `arch` has its fused stacks (gate_up_proj [E, 2I, H]) stored so. Returns the stored tensors."""
    model = build_hf_model(arch, folder, seed, **overrides)
    rng = np.random.default_rng(seed)
    stored = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(MXFP4_STACKS):  # stored [E, out, in / 32, 16]
            # gpt-oss's plain stacks are [E, in, out] (gate_up_proj [E, H, 2I]), the others' [E, out, in]
            experts, inp, out = tensor.shape if arch == "gpt_oss" else (tensor.shape[0], *tensor.shape[:0:-1])
            stored[name + "_blocks"] = torch.from_numpy(rng.integers(0, 256, (experts, out, inp // 32, 16), np.uint8))
            stored[name + "_scales"] = torch.from_numpy(rng.integers(120, 124, (experts, out, inp // 32), np.uint8))
        else:
            stored[name] = tensor.to(torch.bfloat16)
    _write(folder, stored, {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"})
    return stored


def write_dequantized_mxfp4(stored: dict[str, torch.Tensor], like: Path, folder: Path) -> dict[str, torch.Tensor]:
    """The MXFP4 checkpoint `stored` (config.json from `like`) as transformers dequantizes it
    (convert_moe_packed_tensors), saved unquantized in bfloat16 (exact: e2m1 values times powers of two) to
    `folder`. Returns its float32 state dict."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = {}
    for name, tensor in stored.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            state[base] = convert_moe_packed_tensors(tensor, stored[base + "_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            state[name] = tensor.float()
    write_unquantized(state, like, folder, torch.bfloat16)
    return state


def write_unquantized(state: dict[str, torch.Tensor], like: Path, folder: Path, dtype=torch.float32) -> None:
    """`state` saved in `dtype` to `folder` as an unquantized checkpoint of the quantized one in `like` (its
    config.json without quantization_config)."""
    folder.mkdir(parents=True)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = json.loads((like / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if (like / "generation_config.json").is_file():
        shutil.copyfile(like / "generation_config.json", folder / "generation_config.json")


def shard(folder: Path, shards: int) -> dict[str, str]:
    """The checkpoint in `folder` split into `shards` files, tensors dealt in turn by sorted name (so a quantized
    weight and its scales land in different shards), with model.safetensors.index.json; returns its weight map."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(sorted(tensors))}
    for file in files:
        save_file({k: v for k, v in tensors.items() if weight_map[k] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map
