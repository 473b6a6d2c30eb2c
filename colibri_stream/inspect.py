"""`colibri inspect`: a text report on a native model folder, optionally verifying every checksum."""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import CONFIG_FILE, ModelFolder
from .config import ModelConfig
from .expert_codecs import expert_codec


def describe_model(folder: str | os.PathLike, verify: bool = False) -> str:
    """A report of the folder's config, file sizes and per-layer expert table.

    The folder is opened with its headers, sizes and shapes cross-checked; with `verify`, every dense tensor and
    expert block is checked against its checksum too. Problems raise CheckpointError naming the first one.
    """
    model = ModelFolder(folder)
    try:
        if verify:
            model.verify()
        sections = [_summary(model.path, model.config), _files(model), _block_layout(model), _expert_table(model)]
        if verify:
            sections.append(f"Checksums: all {len(model.dense.names)} dense tensors and "
                            f"{len(model.experts.index)} expert blocks are intact")
        return "\n\n".join(sections)
    finally:
        model.experts.close()


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value = nbytes / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _layers(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if layers else "none"


def _windows(config: ModelConfig) -> str:
    windows = set(config.sliding_windows)
    if windows == {None}:
        return "none (full attention in every layer)"
    if len(windows) == 1:
        return f"{config.sliding_windows[0]} tokens in every layer"
    return ", ".join(f"layer {layer}: {w}" for layer, w in enumerate(config.sliding_windows) if w is not None)


def _rope(config: ModelConfig) -> str:
    rope = config.rope
    text = f"{rope.type}, theta {rope.theta:.10g}"
    if rope.type != "default":
        text += f", factor {rope.factor:g}"
    if rope.type in ("llama3", "yarn"):
        text += f", original context {rope.original_max_position_embeddings}"
    if rope.type == "llama3":
        text += f", low/high frequency factors {rope.low_freq_factor:g}/{rope.high_freq_factor:g}"
    if rope.type == "yarn":
        extras = {k: getattr(rope, k) for k in ("attention_factor", "beta_fast", "beta_slow", "mscale",
                                                "mscale_all_dim")}
        text += "".join(f", {k} {v:g}" for k, v in extras.items() if v is not None)
        text += "" if rope.truncate else ", untruncated"
    if config.attention == "gqa" and config.rotary_dim not in (None, config.head_dim):
        text += f"; the first {config.rotary_dim} of {config.head_dim} dimensions of each head rotated"
    return text + ("; interleaved pairs" if config.rope_interleave else "")


def _attention(config: ModelConfig) -> list[str]:
    if config.attention == "mla":
        nope = config.head_dim - config.rotary_dim
        query = (f"q LoRA rank {config.q_lora_rank}" if config.q_lora_rank else "a full q projection")
        return [f"Multi-head Latent Attention: {config.num_heads} heads, query/key {nope} + {config.rotary_dim} "
                f"rope dims, value {config.v_head_dim}", f"{query}",
                f"cached per token: latent {config.kv_lora_rank} + rope key {config.rotary_dim}"]
    return [f"{config.num_heads} query heads, {config.num_kv_heads} key/value heads, head_dim {config.head_dim}"]


def _routing(config: ModelConfig) -> str:
    text = (f"{config.num_experts} per MoE layer, top-{config.top_k} by {config.router_scoring}"
            + (" plus a correction bias (for the choice only)" if config.score_correction_bias else ""))
    if config.n_group > 1:
        text += f", from the best {config.topk_group} of {config.n_group} groups"
        text += " (ranked by their best score)" if config.group_ranking == "max" else ""
    text += (f", intermediate {config.moe_intermediate_size}, "
             f"top-k weights {'renormalised' if config.norm_topk_prob else 'not renormalised'}")
    if config.routed_scaling_factor != 1.0:
        text += f", scaled by {config.routed_scaling_factor:g}"
    return text


def _summary(path: Path, config: ModelConfig) -> str:
    moe = list(config.moe_layers)
    dense = [layer for layer in range(config.num_layers) if not config.is_moe_layer(layer)]
    attention = _attention(config)
    if config.qkv_bias or config.o_bias:
        attention.append("bias on " + "/".join(p for p, on in (("q, k, v", config.qkv_bias), ("o", config.o_bias))
                                               if on))
    if config.qk_norm != "none":
        attention.append(f"qk-norm {config.qk_norm}")
    if config.clip_qkv is not None:
        attention.append(f"q/k/v clipped to ±{config.clip_qkv:g}")
    if config.softmax_scale is not None:
        attention.append(f"softmax scale {config.softmax_scale:.6g}")
    shared = "none"
    if config.shared_expert_intermediate_size:
        shared = f"intermediate {config.shared_expert_intermediate_size}"
        shared += ", sigmoid gate" if config.shared_expert_gate else ""
    tokens = f"bos {config.bos_token_id}, eos {list(config.eos_token_ids)}, pad {config.pad_token_id}"
    rows = [
        ("architecture", f"{config.architecture} (format version {config.format_version})"),
        ("vocabulary", f"{config.vocab_size} tokens; {tokens}"),
        ("hidden size", str(config.hidden_size)),
        ("layers", f"{config.num_layers}; MoE: {_layers(moe)}; dense MLP"
                   + (f" (intermediate {config.intermediate_size})" if dense else "") + f": {_layers(dense)}"),
        ("attention", "; ".join(attention)),
        ("sliding windows", _windows(config)),
        ("rope", _rope(config)),
        ("routed experts", _routing(config)),
        ("shared expert", shared),
        ("norms", f"RMSNorm eps {config.rms_norm_eps:g}"
                  + (f" (latents {config.latent_norm_eps:g})" if config.attention == "mla" else "") + "; embeddings "
                  + ("tied to lm_head" if config.tie_word_embeddings else "separate from lm_head")),
        ("max positions", str(config.max_position_embeddings)),
        ("dtypes", f"dense {config.dtype}, routed experts {expert_codec(config).describe()}"),
    ]
    return f"Model folder {path}\n" + "\n".join(f"  {name:<16} {value}" for name, value in rows)


def _files(model: ModelFolder) -> str:
    config = model.config
    details = {
        config.dense_file: f"{len(model.dense.names)} tensors",
        config.experts_file: f"{len(model.experts.index)} expert blocks of {_size(model.experts.block_size)}",
    }
    names = [CONFIG_FILE, config.dense_file, config.experts_file] + [p.name for p in model.tokenizer_files()]
    lines = [f"  {name:<24} {_size((model.path / name).stat().st_size):>10}  {details.get(name, '')}".rstrip()
             for name in names]
    return "Files\n" + "\n".join(lines)


def _block_layout(model: ModelFolder) -> str:
    lines = [f"  {'tensor':<12} {'dtype':<13} {'shape':<14} {'offset':>8} {'bytes':>10}"]
    for slot in model.experts.slots:
        shape = str(list(slot.shape))
        lines.append(f"  {slot.name:<12} {slot.dtype:<13} {shape:<14} {slot.offset:>8} {slot.nbytes:>10}")
    return f"Expert block layout ({model.experts.block_size} bytes, zero-padded)\n" + "\n".join(lines)


def _expert_table(model: ModelFolder) -> str:
    config, index = model.config, model.experts.index
    lines = [f"  {'layer':>5} {'experts':>7} {'block size':>10}  {'dtype':<9} offsets in {config.experts_file}"]
    for layer in config.moe_layers:
        entries = index[index["layer"] == layer]
        start = int(entries["offset"].min())
        end = int((entries["offset"] + entries["size"]).max())
        lines.append(f"  {layer:>5} {len(entries):>7} {_size(model.experts.block_size):>10}  "
                     f"{config.expert_dtype:<9} {start:#014x} - {end:#014x}")
    return "Routed experts per MoE layer\n" + "\n".join(lines)
