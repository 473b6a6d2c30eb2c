"""A plain-torch Qwen3-MoE decoder used to train the default model, with parameters in transformers' layout.

The computation is that of `transformers.Qwen3MoeForCausalLM` (pre-norm decoder, grouped-query attention with
per-head RMSNorm on q and k, rotary embeddings, a softmax router choosing top-k experts with renormalised weights,
SwiGLU experts), and the parameter names and shapes are the ones transformers uses, so `hf_state_dict` is a plain
rename and `to_hf.py` checks the two implementations agree. It depends on torch alone, so the training machine needs
no particular transformers version.

The MoE block computes every expert for every token as two large matrix products and multiplies the expert outputs
by the routing weights, which are zero outside a token's top-k. That is exactly the sparse computation (the
unselected experts contribute 0 and receive no gradient through the combine), at `num_experts / top_k` times the
expert FLOPs, which for a model this small costs less than scattering tokens to 32 small matrix products.

With `num_experts == 0` every layer uses a dense SwiGLU MLP of `intermediate_size` (transformers' `mlp_only_layers`
for all layers): the dense baseline with the same active parameters when `intermediate_size = top_k *
moe_intermediate_size`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32  # 0: dense MLP in every layer
    top_k: int = 4
    moe_intermediate_size: int = 64
    intermediate_size: int = 256  # dense MLP width (used when num_experts == 0)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    init_std: float = 0.02

    def to_dict(self) -> dict:
        return asdict(self)

    def hf_config(self, **extra):
        """The matching `transformers.Qwen3MoeConfig` (imports transformers)."""
        import transformers

        dense = self.num_experts == 0
        return transformers.Qwen3MoeConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.init_std,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            decoder_sparse_step=1,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts_per_tok=self.top_k,
            num_experts=max(self.num_experts, 1),
            norm_topk_prob=True,
            mlp_only_layers=list(range(self.num_layers)) if dense else [],
            **extra,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # [T, D]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        a = self.a
        q = self.q_norm(self.q_proj(x).view(b, t, a.num_heads, a.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        v = v.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.num_kv_heads != a.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim))


class Router(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))


class Experts(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        e, i, h = a.num_experts, a.moe_intermediate_size, a.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # per expert: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class MoE(nn.Module):
    """Top-k softmax router with renormalised weights over SwiGLU experts (Qwen3-MoE)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.gate = Router(a)
        self.experts = Experts(a)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        a = self.a
        shape = x.shape
        x = x.reshape(-1, a.hidden_size)
        logits = F.linear(x, self.gate.weight)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, a.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, top_i, top_w)  # [N, E], zero outside the top-k
        e, i, h = a.num_experts, a.moe_intermediate_size, a.hidden_size
        gu = F.linear(x, self.experts.gate_up_proj.reshape(e * 2 * i, h)).view(-1, e, 2, i)
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * weights.to(gu.dtype)[:, :, None]  # [N, E, I]
        down = self.experts.down_proj.permute(1, 0, 2).reshape(h, e * i)  # [H, E*I]
        out = F.linear(act.reshape(-1, e * i), down)
        return out.view(shape), {"logits": logits, "probs": probs, "top_i": top_i, "top_w": top_w}


class DenseMLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), None


class Layer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MoE(a) if a.num_experts else DenseMLP(a)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out, route = self.mlp(self.post_attention_layernorm(x))
        return x + out, route


class Body(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` and `lm_head` as in transformers; forward returns logits and per-layer routing."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.model = Body(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int) -> None:
        """Normal(0, std) matrices, std / sqrt(2 L) on the residual outputs, ones for norms."""
        g = torch.Generator().manual_seed(seed)
        a = self.a
        resid_std = a.init_std / math.sqrt(2 * a.num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                std = resid_std if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")) else a.init_std
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        a = self.a
        positions = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(positions, a.head_dim, a.rope_theta)
        x = self.model.embed_tokens(ids)
        routes = []
        for layer in self.model.layers:
            x, route = layer(x, cos, sin)
            routes.append(route)
        return self.lm_head(self.model.norm(x)), routes

    def expert_parameters(self):
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                yield layer.mlp.experts.gate_up_proj
                yield layer.mlp.experts.down_proj


def router_losses(routes: list, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over MoE layers of the load-balancing loss E * sum_e f_e P_e (1.0 when balanced) and the router z-loss.

    f_e is the share of the layer's routes (token, slot) sent to expert e, P_e the mean router probability of e.
    """
    aux, z = [], []
    for r in routes:
        if r is None:
            continue
        counts = torch.zeros(num_experts, device=r["probs"].device).scatter_add_(
            0, r["top_i"].reshape(-1), torch.ones(r["top_i"].numel(), device=r["probs"].device))
        f = counts / r["top_i"].numel()
        aux.append(num_experts * (f * r["probs"].mean(0)).sum())
        z.append(torch.logsumexp(r["logits"].float(), dim=-1).pow(2).mean())
    if not aux:
        zero = torch.zeros((), device="cpu")
        return zero, zero
    return torch.stack(aux).mean(), torch.stack(z).mean()


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """transformers' Qwen3MoeForCausalLM parameter names (they are ours); the tied lm_head is left out."""
    state = {k: v for k, v in model.state_dict().items()}
    if model.a.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def quantize_dequantize_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-row int8 (rows of the last dimension): scale = max|row| / 127, q = round(w / scale)."""
    w32 = w.float()
    scale = w32.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w32 / scale), -127, 127)
    return (q * scale).to(w.dtype)
