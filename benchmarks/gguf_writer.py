"""A Colibri model folder as a GGUF file for llama.cpp: the weights of llama.cpp's runs in benchmarks/llama_cpp.py.

`write_gguf(folder, path, gguf_py)`: the native model folder `folder` (a Mixtral, Qwen3-MoE, GLM-4.5, MiniMax-M2,
DeepSeek-V3 / Kimi K2 or gpt-oss model, such as `write_synthetic_folder`'s) as a bf16 GGUF file of llama.cpp's
`llama`, `qwen3moe`, `glm4moe`, `minimax-m2`, `deepseek2` or `gpt-oss` architecture (ARCHITECTURES): the same tensors
(Mixtral's q and k rows permuted to llama.cpp's interleaved rotary layout, as its own converter does from Hugging
Face checkpoints; qwen3moe, glm4moe, minimax-m2 and gpt-oss use the rotate-half layout as it is; DeepSeek-V3's
latent attention with kv_b_proj split per head into the key and value up-projections, as llama.cpp's converter
splits it; gpt-oss's experts as separate gate, up and down stacks, which Colibri's expert blocks hold already, with
their biases stacked beside them), norms, biases, attention sinks, the router and its score correction bias in
float32, the routing options as llama.cpp's keys (gating function, weights scale and norm, expert groups, shared
experts, leading dense layers, no multi-token-prediction layers), YaRN's keys (latent attention, gpt-oss), gpt-oss's
sliding window and its per-layer pattern, and a placeholder SentencePiece vocabulary of the model's size (the
benchmarks read no text). A model option the architecture would not compute as Colibri does is refused
(`unwritable`): gpt-oss's published YaRN (`truncate: false`) among them, since llama.cpp always rounds YaRN's
correction range to whole dimensions. `matrices="f32"` widens the bf16 matrices to float32 (the same values).
Experts are read as the folder stores them: bf16 ones as the other matrices; mxfp4 ones (gpt-oss as it ships) as
GGML's MXFP4, the same e2m1 codes and e8m0 exponents (OCP Microscaling) regrouped into ggml's 17-byte blocks
(`_ggml_mxfp4`), so llama.cpp computes the very weights Colibri does with no bf16 copy and no llama-quantize; other
expert formats are refused.
`gguf_py` is the gguf-py folder of the llama.cpp source tree (the `gguf` package that writes the format;
`require_gguf_py` stops a script that has none).
benchmarks/llama_cpp_parity.py checks on the CPU that llama.cpp computes from these files what Colibri computes.
A GGUF file is written under a temporary name (`partial_path`) and renamed when whole, so a file found at its path
is complete.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path

import numpy as np

# SentencePiece token types (llama.cpp's llama_token_type): the placeholder vocabulary's unknown, control, byte and
# normal tokens.
_UNKNOWN, _CONTROL, _BYTE, _NORMAL = 2, 3, 6, 1


def _rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k projection rows from the rotate-half layout (Hugging Face, Colibri) to llama.cpp's interleaved one:
    per head, rows (i, i + d/2) become rows (2i, 2i + 1)."""
    rows, cols = weight.shape  # [heads * d, H], and so is the result
    d = rows // heads
    return weight.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _ggml_mxfp4(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """A Colibri mxfp4 matrix as GGML MXFP4 rows: codes [out, in / 32, 16] uint8 (two e2m1 codes a byte, the even
    column in the low nibble) and exponents [out, in / 32] uint8 e8m0 -> [out, in / 32 * 17] uint8, each block its
    exponent byte and then 16 bytes whose low nibbles hold columns 0..15 and high nibbles 16..31 (block_mxfp4)."""
    from colibri_stream.expert_codecs import pack_nibbles, unpack_nibbles

    columns = unpack_nibbles(codes)  # [out, in / 32, 32] codes in column order
    halves = np.stack([columns[..., :16], columns[..., 16:]], axis=-1)  # [out, in / 32, 16, 2]: (j, j + 16)
    blocks = np.concatenate([exponents[..., None], pack_nibbles(halves.reshape(*codes.shape[:2], 32))], axis=-1)
    return np.ascontiguousarray(blocks.reshape(codes.shape[0], -1))


def _placeholder_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` tokens: <unk>, <s>, </s>, the 256 byte tokens, then plain ones."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    if size < len(tokens):
        raise ValueError(f"a vocabulary of {size} tokens is too small for the placeholder's {len(tokens)} fixed ones")
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types += [_NORMAL] * (size - len(types))
    return tokens, [0.0] * size, types


def partial_path(path: Path) -> Path:
    """Where a GGUF file is written before it is renamed to `path`."""
    return path.with_name(path.name + ".partial")


@dataclasses.dataclass(frozen=True)
class GgufArchitecture:
    """How one of our families is written for llama.cpp."""

    name: str  # llama.cpp's architecture (general.architecture)
    interleaved_rotary: bool  # llama.cpp rotates pairs (2i, 2i + 1) (its rope type NORM): rotate-half q and k rows
    # are permuted to that layout (latent attention: the rope part, where Colibri's rotary is not interleaved already)
    scoring: str  # the router_scoring it computes (softmax, or sigmoid with a score correction bias)
    qk_norms: tuple[str, ...]  # the qk_norm values it reads (full: one weight over all heads' q, and k)
    mlp_norm: str  # its name for the norm before the MLP
    qkv_bias: bool = False  # reads q, k and v biases
    weights_norm_key: bool = False  # reads expert_weights_norm (else it renormalises the top-k weights always)
    weights_scale_key: bool = False  # reads expert_weights_scale and the gating function under softmax scores too
    shared_expert: bool = False  # reads an ungated shared expert (expert_shared_count routed widths)
    leading_dense_layers: bool = False  # reads dense MLPs in the first layers (leading_dense_block_count)
    nextn_layers: bool = False  # reads nextn_predict_layers (multi-token prediction layers: 0 written, none held)
    latent_attention: bool = False  # computes Multi-Head Latent Attention (attention "mla"), not q, k and v heads
    partial_rotary: bool = True  # rotates fewer dimensions than the head (rope_dimension_count)
    yarn: bool = False  # is written with default or YaRN rope, YaRN's keys included
    sinks: bool = False  # reads attention sinks, an o bias (required) and one sliding window over a layer pattern
    swiglu_oai: tuple[float, float] | None = None  # its experts' clamped SwiGLU (alpha, limit), fixed in llama.cpp,
    # with a router bias and gate, up and down biases (all required)


# Our architectures llama.cpp has. Partial rotary (rotary_dim) is llama.cpp's rope_dimension_count; the NEOX rope
# type of qwen3moe, glm4moe and minimax-m2 rotates pairs (i, i + R/2) of the first R dimensions, as Colibri does.
# deepseek2 (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) rotates the last rotary_dim dimensions of each latent-attention
# head (NORM).
# gpt-oss rotates whole heads (NEOX; its rope_dimension_count is the head width), routes by a softmax over the
# top-k biased router logits (Colibri's softmax renormalised over the chosen k) and computes its experts'
# (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), with alpha 1.702 and limit 7.
ARCHITECTURES = {
    "mixtral": GgufArchitecture("llama", True, "softmax", ("none",), "ffn_norm", partial_rotary=False),
    "qwen3_moe": GgufArchitecture("qwen3moe", False, "softmax", ("per_head",), "ffn_norm"),
    "glm4_moe": GgufArchitecture("glm4moe", False, "sigmoid", ("none", "per_head"), "post_attention_norm",
                                 qkv_bias=True, weights_norm_key=True, shared_expert=True, leading_dense_layers=True,
                                 nextn_layers=True),
    "minimax_m2": GgufArchitecture("minimax-m2", False, "sigmoid", ("full",), "ffn_norm"),
    "deepseek_v3": GgufArchitecture("deepseek2", True, "sigmoid", ("none",), "ffn_norm", weights_norm_key=True,
                                    shared_expert=True, leading_dense_layers=True, nextn_layers=True,
                                    latent_attention=True, yarn=True),
    # DeepSeek-V2 (-Lite): deepseek2 under softmax scores, its top-k weights scaled and not renormalised
    "deepseek_v2": GgufArchitecture("deepseek2", True, "softmax", ("none",), "ffn_norm", weights_norm_key=True,
                                    weights_scale_key=True, shared_expert=True, leading_dense_layers=True,
                                    latent_attention=True, yarn=True),
    # GLM-4.7-Flash: llama.cpp's converter writes it as deepseek2 too (its own tokenizer aside)
    "glm4_moe_lite": GgufArchitecture("deepseek2", True, "sigmoid", ("none",), "ffn_norm", weights_norm_key=True,
                                      shared_expert=True, leading_dense_layers=True, nextn_layers=True,
                                      latent_attention=True, yarn=True),
    "gpt_oss": GgufArchitecture("gpt-oss", False, "softmax", ("none",), "post_attention_norm", qkv_bias=True,
                                partial_rotary=False, yarn=True, sinks=True, swiglu_oai=(1.702, 7.0)),
}


def unwritable(config, arch: GgufArchitecture) -> list[str]:
    """What of `config` (a ModelConfig) llama.cpp's `arch` would not compute as Colibri does; empty if nothing."""
    first_moe = config.moe_layers[0] if config.moe_layers else config.num_layers
    shared = config.shared_expert_intermediate_size
    checks = {
        f"router_scoring {config.router_scoring} (llama.cpp's {arch.name} computes {arch.scoring})":
            config.router_scoring != arch.scoring,
        f"qk_norm {config.qk_norm}": config.qk_norm not in arch.qk_norms,
        "q/k/v biases": config.qkv_bias and not arch.qkv_bias,
        "a shared expert": bool(shared) and not arch.shared_expert,
        "a gated shared expert, or one not a whole number of routed widths": bool(shared) and (
            config.shared_expert_gate or shared % config.moe_intermediate_size != 0),
        "dense layers other than the leading ones": config.moe_layers != tuple(range(first_moe, config.num_layers)),
        "leading dense layers": first_moe > 0 and not arch.leading_dense_layers,
        "a score correction bias": arch.scoring == "softmax" and config.score_correction_bias,
        "routed_scaling_factor": (arch.scoring == "softmax" and not arch.weights_scale_key
                                  and config.routed_scaling_factor != 1.0),
        "unnormalised top-k weights": not config.norm_topk_prob and not arch.weights_norm_key,
        "partial rotary": not arch.partial_rotary and config.rotary_dim not in (None, config.head_dim),
        f"{config.attention} attention (llama.cpp's {arch.name} computes {'mla' if arch.latent_attention else 'gqa'})":
            (config.attention == "mla") != arch.latent_attention,
        "a softmax scale other than head_dim^-0.5": config.attention == "gqa" and not math.isclose(
            config.softmax_scale or config.head_dim**-0.5, config.head_dim**-0.5, rel_tol=1e-6),
        "clip_qkv": config.clip_qkv is not None,
        "groups of experts ranked by their best score (llama.cpp ranks them by their two best)":
            config.n_group > 1 and config.group_ranking != "top2_sum",
        "an o bias, attention sinks or sliding windows": not arch.sinks and (
            config.o_bias or config.attention_sinks or any(w is not None for w in config.sliding_windows)),
        "interleaved or scaled rope": not arch.yarn and (config.rope_interleave or config.rope.type != "default"),
        "a router bias, expert biases or a clamped SwiGLU": not arch.swiglu_oai and (
            config.router_bias or config.expert_bias or config.swiglu_limit is not None),
        "weights other than bf16, or experts other than bf16 or mxfp4": config.dtype != "bfloat16"
            or config.expert_dtype not in ("bfloat16", "mxfp4"),
    }
    if arch.yarn:
        checks.update(_rope_unwritable(config, arch))
    if arch.sinks:
        checks.update(_gpt_oss_unwritable(config, arch))
    if arch.latent_attention and config.attention == "mla":
        checks.update(_latent_unwritable(config))
    return [what for what, refused in checks.items() if refused]


def _rope_unwritable(config, arch: GgufArchitecture) -> dict[str, bool]:
    """unwritable's checks of the rope of an architecture written with default or YaRN rope (`arch.yarn`):
    description -> refused."""
    rope = config.rope
    return {
        f"rope type {rope.type} (llama.cpp's {arch.name} is written with default or yarn)":
            rope.type not in ("default", "yarn"),
        "YaRN without truncate (llama.cpp rounds the correction range to whole dimensions)":
            rope.type == "yarn" and not rope.truncate,
    }


def _gpt_oss_unwritable(config, arch: GgufArchitecture) -> dict[str, bool]:
    """unwritable's checks of a model for llama.cpp's gpt-oss (attention sinks, windows, biased clamped-SwiGLU
    experts): description -> refused. Biases the model lacks are written as zeros."""
    alpha, limit = arch.swiglu_oai
    widths = {w for w in config.sliding_windows if w is not None}
    return {
        f"no attention sinks (llama.cpp's {arch.name} reads them in every layer)": not config.attention_sinks,
        f"no sliding-window layer (llama.cpp's {arch.name} needs one)": not widths,
        "sliding windows of more than one width": len(widths) > 1,
        f"experts other than the clamped SwiGLU llama.cpp's {arch.name} computes (alpha {alpha}, limit {limit:g})":
            (config.swiglu_alpha, config.swiglu_limit) != (alpha, limit),
        f"expert groups (llama.cpp's {arch.name} would rank them by router logits)": config.n_group > 1,
    }


def _latent_unwritable(config) -> dict[str, bool]:
    """unwritable's checks of a latent-attention model for llama.cpp's deepseek2: description -> refused."""
    rope = config.rope
    rotary_factor, softmax_scale = _latent_scales(config)
    ours = (_colibri_rotary_factor(config), config.softmax_scale or config.head_dim**-0.5)
    return {
        "latent norms of another epsilon than rms_norm_eps (llama.cpp's deepseek2 has one for every norm)":
            config.latent_norm_eps != config.rms_norm_eps,
        "MoE layers without a shared expert (llama.cpp's deepseek2 needs one)":
            bool(config.moe_layers) and not config.shared_expert_intermediate_size,
        # deepseek2 takes 26 or 27 layers (48 of a 128256-token vocabulary) for a Lite model: no q_lora_rank read
        "a q LoRA in 26 or 27 layers (llama.cpp's deepseek2 reads those as DeepSeek-V2-Lite, without one)":
            bool(config.q_lora_rank) and (config.num_layers in (26, 27)
                                          or (config.num_layers, config.vocab_size) == (48, 128256)),
        "YaRN's rotary magnitude or a softmax scale other than llama.cpp's (mscale equal to mscale_all_dim, "
        "softmax scale head_dim^-0.5 times yarn_mscale(factor, mscale_all_dim)^2)":
            rope.type in ("default", "yarn") and not all(
                math.isclose(a, b, rel_tol=1e-6) for a, b in zip((rotary_factor, softmax_scale), ours)),
    }


def _colibri_rotary_factor(config) -> float:
    """The factor Colibri's rotary tables scale cos and sin by (YaRN's attention factor; 1 otherwise)."""
    from colibri_stream.model.rope import inverse_frequencies

    return inverse_frequencies(config.rope, config.rotary_dim or config.head_dim)[1]


def _latent_scales(config) -> tuple[float, float]:
    """(the factor on cos and sin, the softmax scale) llama.cpp's deepseek2 derives from the keys written for
    `config` (default or YaRN rope): with yarn_log_multiplier (mscale_all_dim, m) it takes YaRN's mscale to be m
    too, so cos and sin are unscaled and the softmax scale is yarn_mscale(factor, m)^2 / sqrt(head_dim); without it
    cos and sin carry yarn_mscale(factor, 1) and the softmax scale its square over sqrt(head_dim)."""
    from colibri_stream.model.rope import yarn_mscale

    if config.rope.type != "yarn":
        return 1.0, config.head_dim**-0.5
    factor, log_mul = config.rope.factor, config.rope.mscale_all_dim or 0.0
    magnitude = 1.0 + 0.1 * math.log(factor)  # what ggml's YaRN rotary multiplies cos and sin by
    attn_factor = (1.0 if log_mul else yarn_mscale(factor)) / magnitude  # llama_context's yarn_attn_factor
    rotary_factor = attn_factor * magnitude
    return rotary_factor, (rotary_factor * (1.0 + 0.1 * log_mul * math.log(factor)))**2 * config.head_dim**-0.5


def _rope_part_interleaved(weight: np.ndarray, blocks: int, rope: int) -> np.ndarray:
    """Rows of `blocks` equal blocks (heads), each ending in a rotate-half rope part of `rope` rows, with that part
    in llama.cpp's interleaved layout (`_rotary_rows`: rows (i, i + rope/2) become (2i, 2i + 1)); the other rows of
    each block as they are."""
    rows, cols = weight.shape
    width = rows // blocks
    grouped = weight.reshape(blocks, width, cols)
    part = _rotary_rows(grouped[:, width - rope:].reshape(blocks * rope, cols), blocks)
    return np.concatenate([grouped[:, :width - rope], part.reshape(blocks, rope, cols)], axis=1).reshape(rows, cols)


def _latent_attention_tensors(dense, config, arch: GgufArchitecture, p: str,
                              b: str) -> dict[str, tuple[tuple[int, ...], bool, object]]:
    """Multi-head Latent Attention's tensors of the layer of prefixes `p` (ours) and `b` (llama.cpp's), as
    llama.cpp's deepseek2 reads them: name -> (numpy shape, whether a matrix (else a float32 norm), function making
    the array from Colibri's). kv_b_proj is split per head into attn_k_b [Q, R, N] (the key rows, transposed: a
    head's query without rotary -> its query over the latent, Colibri's k_up) and attn_v_b [Q, Dv, R] (the value
    rows, Colibri's v_up). Where Colibri's rotary pairs (i, i + r/2), the rope rows of each query head and the rope
    key's rows of kv_a_proj are permuted to llama.cpp's interleaved pairs."""
    h, heads, d = config.hidden_size, config.num_heads, config.head_dim
    rank, rope, dv, q_rank = config.kv_lora_rank, config.rotary_dim, config.v_head_dim, config.q_lora_rank
    nope = d - rope
    permute = arch.interleaved_rotary and not config.rope_interleave

    def with_rope_rows(name: str, blocks: int):  # a projection whose blocks end in rope rows
        def make() -> np.ndarray:
            weight = dense.get(p + name)
            return _rope_part_interleaved(weight, blocks, rope) if permute else weight
        return make

    def kv_b(rows: slice, transpose: bool):  # one part of each head's kv_b_proj rows: [Q, rows, R] or [Q, R, rows]
        def make() -> np.ndarray:
            part = dense.get(p + "kv_b_proj").reshape(heads, nope + dv, rank)[:, rows]
            return part.transpose(0, 2, 1) if transpose else part
        return make

    tensors: dict[str, tuple[tuple[int, ...], bool, object]] = {}
    if q_rank:
        tensors[b + "attn_q_a.weight"] = ((q_rank, h), True, lambda: dense.get(p + "q_a_proj"))
        tensors[b + "attn_q_a_norm.weight"] = ((q_rank,), False, lambda: dense.get(p + "q_a_norm"))
        tensors[b + "attn_q_b.weight"] = ((heads * d, q_rank), True, with_rope_rows("q_b_proj", heads))
    else:
        tensors[b + "attn_q.weight"] = ((heads * d, h), True, with_rope_rows("q_proj", heads))
    tensors[b + "attn_kv_a_mqa.weight"] = ((rank + rope, h), True, with_rope_rows("kv_a_proj", 1))
    tensors[b + "attn_kv_a_norm.weight"] = ((rank,), False, lambda: dense.get(p + "kv_a_norm"))
    tensors[b + "attn_k_b.weight"] = ((heads, rank, nope), True, kv_b(slice(0, nope), True))
    tensors[b + "attn_v_b.weight"] = ((heads, dv, rank), True, kv_b(slice(nope, nope + dv), False))
    tensors[b + "attn_output.weight"] = ((h, heads * dv), True, lambda: dense.get(p + "o_proj"))
    return tensors


def _zeros_unless(source, name: str, shape: tuple[int, ...]):
    """A function making the float32 tensor `name` of `source` (a DenseFile), or zeros of `shape` where the model
    has none (a bias llama.cpp requires: zeros add nothing)."""
    def make() -> np.ndarray:
        if name in source.names:
            return np.ascontiguousarray(source.get(name).astype(np.float32))
        return np.zeros(shape, np.float32)
    return make


def _sink_tensors(dense, config, p: str, b: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """The float32 tensors llama.cpp's gpt-oss adds to the attention of the layer of prefixes `p` (ours) and `b`
    (llama.cpp's): name -> (numpy shape, function making it): the o bias (zeros without one) and each query
    head's sink logit."""
    h, heads = config.hidden_size, config.num_heads
    return {b + "attn_output.bias": ((h,), _zeros_unless(dense, p + "o_bias", (h,))),
            b + "attn_sinks.weight": ((heads,), _zeros_unless(dense, p + "sinks", (heads,)))}


def _expert_bias_tensors(folder, config, layer: int, p: str, b: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """The biases of a gpt-oss MoE layer as llama.cpp reads them, float32 (zeros where the model has none): the
    router's [E] and the routed experts' gate [E, I], up [E, I] and down [E, H], stacked in expert order from
    each expert's block; name -> (numpy shape, function making it)."""
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size

    def experts(part: str, width: int):
        def make() -> np.ndarray:
            if not config.expert_bias:
                return np.zeros((e, width), np.float32)
            return np.stack([folder.experts.tensors(layer, x)[part + "_bias"] for x in range(e)]).astype(np.float32)
        return make

    tensors = {b + "ffn_gate_inp.bias": ((e,), _zeros_unless(folder.dense, p + "router_bias", (e,)))}
    for part, width in (("gate", i), ("up", i), ("down", h)):
        tensors[b + f"ffn_{part}_exps.bias"] = ((e, width), experts(part, width))
    return tensors


def _tensor_plan(folder, config, arch: GgufArchitecture, gguf,
                 matrices: str) -> dict[str, tuple[tuple[int, ...], object, object]]:
    """name -> (numpy shape, GGML type, function making the array) of every tensor of the GGUF file, in file order:
    matrices bf16 (as their uint16 bits) or, with `matrices` "f32", widened to float32; mxfp4 experts as GGML
    MXFP4 (their bytes: shape [E, rows, blocks * 17]); norms, biases, sinks and the router float32."""
    f32 = gguf.GGMLQuantizationType.F32
    matrix_type = f32 if matrices == "f32" else gguf.GGMLQuantizationType.BF16
    mxfp4 = config.expert_dtype == "mxfp4"
    dense = folder.dense

    def float32(array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array.astype(np.float32))

    def matrix(array: np.ndarray) -> np.ndarray:  # a bf16 matrix as the file stores it
        return float32(array) if matrices == "f32" else np.ascontiguousarray(array).view(np.uint16)

    def rotary(array: np.ndarray, heads: int) -> np.ndarray:
        return matrix(_rotary_rows(array, heads) if arch.interleaved_rotary else array)

    def experts(layer: int, part: str) -> np.ndarray:  # [E, rows, cols] (mxfp4: [E, rows, blocks * 17] bytes)
        blocks = [folder.experts.tensors(layer, e) for e in range(config.num_experts)]
        if mxfp4:
            return np.stack([_ggml_mxfp4(block[part], block[part + "_scale"]) for block in blocks])
        return np.stack([matrix(block[part]) for block in blocks])

    def correction_bias(p: str) -> np.ndarray:  # llama.cpp needs one: zeros choose by score, as Colibri without one
        if config.score_correction_bias:
            return float32(dense.get(p + "score_correction_bias"))
        return np.zeros(config.num_experts, np.float32)

    plan: dict[str, tuple[tuple[int, ...], object, object]] = {}

    def add_matrix(name, shape, make):  # a bf16 matrix (or stack of experts' matrices)
        plan[name] = (tuple(shape), matrix_type, make)

    def add_float32(name, shape, make):  # a norm weight, a bias or the router
        plan[name] = (tuple(shape), f32, make)

    def dense_matrix(name: str):
        return lambda: matrix(dense.get(name))

    def dense_float32(name: str):
        return lambda: float32(dense.get(name))

    h, v, d = config.hidden_size, config.vocab_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    e, i, s = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    qk_norm_widths = {"per_head": (d, d), "full": (q_rows, kv_rows)}.get(config.qk_norm)
    add_matrix("token_embd.weight", (v, h), dense_matrix("embed_tokens"))
    for layer in range(config.num_layers):
        p, b = f"layers.{layer}.", f"blk.{layer}."
        add_float32(b + "attn_norm.weight", (h,), dense_float32(p + "input_norm"))
        if config.attention == "mla":
            for name, (shape, is_matrix, make) in _latent_attention_tensors(dense, config, arch, p, b).items():
                if is_matrix:
                    add_matrix(name, shape, lambda make=make: matrix(make()))
                else:
                    add_float32(name, shape, lambda make=make: float32(make()))
        else:
            add_matrix(b + "attn_q.weight", (q_rows, h),
                       lambda p=p: rotary(dense.get(p + "q_proj"), config.num_heads))
            add_matrix(b + "attn_k.weight", (kv_rows, h),
                       lambda p=p: rotary(dense.get(p + "k_proj"), config.num_kv_heads))
            add_matrix(b + "attn_v.weight", (kv_rows, h), dense_matrix(p + "v_proj"))
            if config.qkv_bias:
                for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                    add_float32(b + f"attn_{part}.bias", (rows,), dense_float32(f"{p}{part}_bias"))
            add_matrix(b + "attn_output.weight", (h, q_rows), dense_matrix(p + "o_proj"))
            for name, (shape, make) in (_sink_tensors(dense, config, p, b) if arch.sinks else {}).items():
                add_float32(name, shape, make)
            if qk_norm_widths:
                add_float32(b + "attn_q_norm.weight", (qk_norm_widths[0],), dense_float32(p + "q_norm"))
                add_float32(b + "attn_k_norm.weight", (qk_norm_widths[1],), dense_float32(p + "k_norm"))
        add_float32(b + arch.mlp_norm + ".weight", (h,), dense_float32(p + "post_attention_norm"))
        if not config.is_moe_layer(layer):
            w = config.intermediate_size
            for part, shape in (("gate", (w, h)), ("up", (w, h)), ("down", (h, w))):
                add_matrix(b + f"ffn_{part}.weight", shape, dense_matrix(f"{p}mlp.{part}_proj"))
            continue
        add_float32(b + "ffn_gate_inp.weight", (e, h), dense_float32(p + "router"))
        if arch.scoring == "sigmoid":
            add_float32(b + "exp_probs_b.bias", (e,), lambda p=p: correction_bias(p))
        for part, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            make = functools.partial(experts, layer, part)
            if mxfp4:
                plan[b + f"ffn_{part}_exps.weight"] = ((*shape[:2], shape[2] // 32 * 17),
                                                       gguf.GGMLQuantizationType.MXFP4, make)
            else:
                add_matrix(b + f"ffn_{part}_exps.weight", shape, make)
        for name, (shape, make) in (_expert_bias_tensors(folder, config, layer, p, b) if arch.swiglu_oai
                                    else {}).items():
            add_float32(name, shape, make)
        if s:
            for part, shape in (("gate", (s, h)), ("up", (s, h)), ("down", (h, s))):
                add_matrix(b + f"ffn_{part}_shexp.weight", shape, dense_matrix(f"{p}shared_expert.{part}_proj"))
    add_float32("output_norm.weight", (h,), dense_float32("norm"))
    add_matrix("output.weight", (v, h), dense_matrix("embed_tokens" if config.tie_word_embeddings else "lm_head"))
    return plan


def _write_latent_metadata(writer, config, gguf) -> None:
    """Latent attention's keys as llama.cpp's deepseek2 reads them: attention absorbed into one cached KV head of
    width R + r (keys) and R (values), the heads' own widths (key_length_mla, value_length_mla), the LoRA ranks
    (q_lora_rank 0: one attn_q), the rope part's width, and YaRN's keys (its mscale_all_dim as
    yarn_log_multiplier, times 0.1 as deepseek2 reads it)."""
    rank, rope = config.kv_lora_rank, config.rotary_dim
    writer.add_rope_dimension_count(rope)
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    scaling = config.rope
    _write_rope_scaling(writer, scaling, gguf)
    if scaling.type == "yarn" and scaling.mscale_all_dim:
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling.mscale_all_dim)


def _write_rope_scaling(writer, rope, gguf) -> None:
    """The rope scaling keys of default (type none) or YaRN rope: its factor, original context and betas."""
    if rope.type != "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope.factor)
    writer.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
    writer.add_rope_scaling_yarn_beta_fast(rope.beta_fast or 32.0)  # Colibri's defaults where unset
    writer.add_rope_scaling_yarn_beta_slow(rope.beta_slow or 1.0)


def _write_gpt_oss_metadata(writer, config, gguf) -> None:
    """gpt-oss's own keys: the sliding window and which layers use it (one flag per layer), and the rope scaling.
    llama.cpp scales YaRN's cos and sin by yarn_mscale(factor) times rope.scaling.attn_factor, so that key carries
    Colibri's factor over yarn_mscale(factor) where they differ (an attention_factor or mscale of the model's)."""
    from colibri_stream.model.rope import yarn_mscale

    writer.add_sliding_window(next(w for w in config.sliding_windows if w is not None))  # unwritable: one width
    writer.add_sliding_window_pattern([w is not None for w in config.sliding_windows])
    _write_rope_scaling(writer, config.rope, gguf)
    if config.rope.type == "yarn":
        attn_factor = _colibri_rotary_factor(config) / yarn_mscale(config.rope.factor)
        if not math.isclose(attn_factor, 1.0, rel_tol=1e-7):
            writer.add_rope_scaling_attn_factors(attn_factor)


def _write_metadata(writer, config, arch: GgufArchitecture, name: str, gguf, matrices: str) -> None:
    """The key-value metadata of the model: dimensions, attention, rotary, routing, the placeholder vocabulary."""
    dense_first = config.moe_layers[0] if config.moe_layers else config.num_layers
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    # The dense MLPs' width where there are some; minimax-m2 and the others size their experts by it
    writer.add_feed_forward_length(config.intermediate_size if dense_first else config.moe_intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_head_count(config.num_heads)
    if config.attention == "mla":
        _write_latent_metadata(writer, config, gguf)
    else:
        writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
        writer.add_head_count_kv(config.num_kv_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.top_k)
    if config.n_group > 1:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    if arch.scoring == "sigmoid" or arch.weights_scale_key:
        gating = gguf.ExpertGatingFuncType.SIGMOID if arch.scoring == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
        writer.add_expert_gating_func(gating)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
    if arch.weights_norm_key:
        writer.add_expert_weights_norm(config.norm_topk_prob)
    if arch.shared_expert:
        writer.add_expert_shared_count(config.shared_expert_intermediate_size // config.moe_intermediate_size)
    if arch.leading_dense_layers:
        writer.add_leading_dense_block_count(dense_first)
    if arch.sinks:
        _write_gpt_oss_metadata(writer, config, gguf)
    if arch.nextn_layers:
        writer.add_nextn_predict_layers(0)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if matrices == "f32" else gguf.LlamaFileType.MOSTLY_BF16)
    tokens, scores, types = _placeholder_vocab(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def write_gguf(folder_path: str | Path, gguf_path: str | Path, gguf_py: str | Path, matrices: str = "bf16") -> Path:
    """Write the native model folder at `folder_path` as a GGUF file for llama.cpp (module docstring); `matrices`
    "f32" widens the bf16 matrices to float32 (the same values, computed in float32 by llama.cpp's CPU backend)."""
    if matrices not in ("bf16", "f32"):
        raise ValueError(f"matrices are written bf16 or f32, not {matrices!r}")
    sys.path.insert(0, str(gguf_py))
    import gguf

    from colibri_stream.checkpoint import ModelFolder

    folder = ModelFolder(folder_path)
    config = folder.config
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"write_gguf writes {', '.join(ARCHITECTURES)} models, not {config.architecture!r}")
    arch = ARCHITECTURES[config.architecture]
    refused = unwritable(config, arch)
    if refused:
        raise ValueError(f"llama.cpp's {arch.name} does not compute this {config.architecture} model's "
                         f"{'; '.join(refused)}")
    plan = _tensor_plan(folder, config, arch, gguf, matrices)
    gguf_path = Path(gguf_path)
    writer = gguf.GGUFWriter(str(partial_path(gguf_path)), arch.name)
    _write_metadata(writer, config, arch, f"colibri {Path(folder_path).name}", gguf, matrices)
    stored = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.BF16: np.uint16,
              gguf.GGMLQuantizationType.MXFP4: np.uint8}  # each type's array dtype (MXFP4: its bytes)
    for name, (shape, kind, _) in plan.items():
        dtype = np.dtype(stored[kind])
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, (shape, _, make) in plan.items():
        array = make()
        if array.shape != shape:
            raise ValueError(f"{name}: made {array.shape}, planned {shape}")
        writer.write_tensor_data(array)
    writer.close()
    folder.experts.close()
    partial_path(gguf_path).rename(gguf_path)
    return gguf_path


def require_gguf_py(folder: str | Path, script: str) -> None:
    """Exit with one line unless `folder` is llama.cpp's gguf-py folder (it holds the gguf package)."""
    if not (Path(folder) / "gguf").is_dir():
        sys.exit(f"{script} needs llama.cpp's gguf-py folder: {folder} holds no gguf package")
