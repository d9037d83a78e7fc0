"""RMSNorm, rotary embeddings and causal self-attention with optional joint decoding.

Implements the attention half of the MoE block (CONCEPTMOE.md §2b) and the joint-decoding
projections of the decoder (§2, item 6): ``q = W_q·x + W'_q·z`` (likewise k, v), where ``z``
is the dechunked concept of the token and ``W'`` starts at zero.

Shape legend: B batch, T sequence (tokens or concepts), D d_model, H query heads,
G key/value heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .fp32 import fp32_island
from .moe import compute_dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 activations keep their precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer ``positions`` of any shape: returns (*positions.shape, Dh)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                        dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv  # (..., Dh/2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face / Llama convention). x: (B, H, T, Dh); cos: (B|1, T, Dh)."""
    return rotate(x, cos[:, None], sin[:, None])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, with cos and sin (..., Dh) already shaped to broadcast against x."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)  # bf16 q, k stay bf16 under autocast


# CPU training in bf16: up to this many keys SDPA's bf16 backward is slower than the fp32 one
# (single thread, forward + backward: 128 keys 20 vs 10 ms, 256 keys 25 vs 23 ms; at 1024 keys bf16
# wins, 18 vs 25 ms), so short sequences (concepts) attend in fp32 while training.
CPU_FP32_ATTENTION_MAX_KEYS = 256


def _fp32_attention(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad
            and k.shape[-2] <= CPU_FP32_ATTENTION_MAX_KEYS)


class Attention(nn.Module):
    """Causal grouped-query self-attention; ``joint=True`` adds zero-initialised W'_q/W'_k/W'_v."""

    def __init__(self, cfg: ModelConfig, joint: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d, qd, kvd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        qkv_bias, o_bias = cfg.attn_bias != "none", cfg.attn_bias == "qkvo"
        self.wq = nn.Linear(d, qd, bias=qkv_bias)
        self.wk = nn.Linear(d, kvd, bias=qkv_bias)
        self.wv = nn.Linear(d, kvd, bias=qkv_bias)
        self.wo = nn.Linear(qd, d, bias=o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.norm_eps), RMSNorm(self.hd, cfg.norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(qd, cfg.norm_eps), RMSNorm(kvd, cfg.norm_eps)
        self.joint = joint
        if joint:
            self.jq = nn.Linear(d, qd, bias=False)
            self.jk = nn.Linear(d, kvd, bias=False)
            self.jv = nn.Linear(d, kvd, bias=False)
            for lin in (self.jq, self.jk, self.jv):
                nn.init.zeros_(lin.weight)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values with RoPE applied: (B, H, T, Dh), (B, G, T, Dh), (B, G, T, Dh)."""
        B, T, _ = x.shape
        x = x.to(compute_dtype(x))  # one cast for the three projections (bf16 under autocast)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.joint and z is not None:
            z = z.to(compute_dtype(z))
            q, k, v = q + self.jq(z), k + self.jk(z), v + self.jv(z)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """SDPA over given q (B,H,Tq,Dh) and k/v (B,G,Tk,Dh); returns (B, Tq, D) after W_o."""
        B, _, Tq, _ = q.shape
        dtype, fp32 = q.dtype, _fp32_attention(q, k)
        sdpa = fp32_island(F.scaled_dot_product_attention) if fp32 else F.scaled_dot_product_attention
        out = sdpa(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                   enable_gqa=self.n_kv != self.n_heads).to(dtype)
        return self.wo(out.transpose(1, 2).reshape(B, Tq, self.n_heads * self.hd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                z: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin, z)  # (B, H|G, T, Dh)
        return self.attend(q, k, v)
