"""Where the checkpoints of the supported architectures keep each tensor: our dense tensors' names in Hugging Face
checkpoints, and the layouts of a MoE layer's routed experts (per-expert tensors, or transformers 5's fused pair)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from ..errors import CheckpointError


# Our per-layer dense tensor name -> the names it has in Hugging Face checkpoints (under model.layers.{l}.).
_LAYER_TENSORS = {
    "input_norm": ("input_layernorm.weight",),
    "q_proj": ("self_attn.q_proj.weight",),
    "k_proj": ("self_attn.k_proj.weight",),
    "v_proj": ("self_attn.v_proj.weight",),
    "o_proj": ("self_attn.o_proj.weight",),
    "q_bias": ("self_attn.q_proj.bias",),
    "k_bias": ("self_attn.k_proj.bias",),
    "v_bias": ("self_attn.v_proj.bias",),
    "o_bias": ("self_attn.o_proj.bias",),
    "q_norm": ("self_attn.q_norm.weight",),
    "q_a_proj": ("self_attn.q_a_proj.weight",),
    "q_a_norm": ("self_attn.q_a_layernorm.weight",),
    "q_b_proj": ("self_attn.q_b_proj.weight",),
    "kv_a_proj": ("self_attn.kv_a_proj_with_mqa.weight",),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight",),
    "kv_b_proj": ("self_attn.kv_b_proj.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "post_attention_norm": ("post_attention_layernorm.weight",),
    "router": ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight"),
    "router_bias": ("mlp.router.bias",),
    "sinks": ("self_attn.sinks",),
    "score_correction_bias": ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias",
                              "block_sparse_moe.e_score_correction_bias"),
    "shared_expert.gate_proj": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight"),
    "shared_expert.up_proj": ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_expert.down_proj": ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight",),
    "mlp.gate_proj": ("mlp.gate_proj.weight",),
    "mlp.up_proj": ("mlp.up_proj.weight",),
    "mlp.down_proj": ("mlp.down_proj.weight",),
}
_GLOBAL_TENSORS = {"embed_tokens": ("model.embed_tokens.weight",), "norm": ("model.norm.weight",),
                   "lm_head": ("lm_head.weight",)}
_MOE_PREFIXES = ("mlp", "block_sparse_moe")
# Per-expert tensor names (what save_pretrained writes): (gate, up, down).
_EXPERT_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Checkpoint tensors that carry nothing the computation needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_dense_candidates(name: str) -> tuple[str, ...]:
    """The checkpoint names that may hold our dense tensor `name`, in order of preference."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    _, layer, part = name.split(".", 2)
    return tuple(f"model.layers.{layer}.{hf}" for hf in _LAYER_TENSORS[part])


@dataclass(frozen=True)
class ExpertNames:
    """Where one MoE layer's routed experts are: per-expert tensors, or the fused transformers-5 pair.

    Per-expert: `gate`, `up`, `down` are name patterns with an `{e}` field. Fused: `gate` names gate_up_proj
    [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), `up` is the same tensor, `down` names down_proj [E, H, I].
    Interleaved (gpt-oss, fused too): gate_up_proj is [E, H, 2I] with gate in the even columns and up in the odd
    ones, down_proj [E, I, H], and `gate_up_bias` [E, 2I] (interleaved alike) and `down_bias` [E, H] name the
    biases.
    """

    fused: bool
    gate: str
    up: str
    down: str
    interleaved: bool = False
    gate_up_bias: str = ""
    down_bias: str = ""


def hf_expert_names(layer: int, tensor_names: Collection[str]) -> ExpertNames:
    """How the checkpoint stores the experts of `layer`; CheckpointError when it holds neither layout."""
    base = f"model.layers.{layer}"
    for prefix in _MOE_PREFIXES:
        for gate, up, down in _EXPERT_NAMINGS:
            pattern = f"{base}.{prefix}.experts.{{e}}.{{p}}.weight"
            if pattern.format(e=0, p=gate) in tensor_names:
                return ExpertNames(False, *(pattern.replace("{p}", p) for p in (gate, up, down)))
        gate_up = f"{base}.{prefix}.experts.gate_up_proj"
        if gate_up + "_bias" in tensor_names:
            return ExpertNames(True, gate_up, gate_up, f"{base}.{prefix}.experts.down_proj", True,
                               gate_up + "_bias", f"{base}.{prefix}.experts.down_proj_bias")
        if gate_up in tensor_names:
            return ExpertNames(True, gate_up, gate_up, f"{base}.{prefix}.experts.down_proj")
    raise CheckpointError(f"the checkpoint holds no experts for layer {layer} (looked for "
                          f"{base}.mlp.experts.0.gate_proj.weight and {base}.mlp.experts.gate_up_proj)")
