"""Our blocks on vLLM's kernels: the dense projections fused and on vLLM's linear layers, the
routed experts on its fused MoE, attention through its paged cache.

vLLM's own MoE models run q, k and v as one matmul, the shared expert's gate and up as one, each on
a weight vLLM prepacks for the CPU (oneDNN) after loading. Our blocks keep them apart (seven dense
matmuls a block, plus three more for joint decoding). ``BlockLinears`` holds one block's
projections fused:

- ``qkv``: [W_q; W_k; W_v]; with joint decoding ``joint_qkv``: [W'_q; W'_k; W'_v] on z (q = W_q x +
  W'_q z). One matmul over [x, z] for all six gave wrong tokens on the trained 1.2M pair once
  inductor compiled the decoder (eager was exact, the tiny test models too; not reproduced in
  isolation, cause not found), so they stay two;
- ``o``: W_o;
- ``gate_up``, ``down``: the shared expert's [gate; up] and down (None without one).

The router and the shared-expert gate stay ours (fp32 logits, as the reference computes them).
Queries, keys and values stay token-major (N, heads · Dh), the layout vLLM's attention reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from ..model.attention import rotate
from ..model.lm import Block


def _linear(d_in: int, d_out: int, bias: bool, prefix: str) -> ReplicatedLinear:
    return ReplicatedLinear(d_in, d_out, bias=bias, params_dtype=torch.get_default_dtype(), prefix=prefix,
                            return_bias=False)


class BlockLinears(nn.Module):
    """One block's dense projections, fused, on vLLM's linear layers (filled by ``load_from``)."""

    def __init__(self, blk: Block, prefix: str) -> None:
        super().__init__()
        a, shared = blk.attn, blk.moe.shared
        self.joint, self.qk_norm, self.heads, self.kv_heads = a.joint, a.qk_norm, a.n_heads, a.n_kv
        d, qd, kvd = a.wq.in_features, a.wq.out_features, a.wk.out_features
        self.split = [qd, kvd, kvd]
        self.qkv = _linear(d, qd + 2 * kvd, a.wq.bias is not None, f"{prefix}.qkv")
        self.joint_qkv = _linear(d, qd + 2 * kvd, False, f"{prefix}.joint_qkv") if a.joint else None
        self.o = _linear(qd, d, a.wo.bias is not None, f"{prefix}.o")
        self.gate_up = self.down = None
        if shared is not None:
            hidden = shared.gate.out_features
            self.gate_up = _linear(d, 2 * hidden, False, f"{prefix}.gate_up")
            self.down = _linear(hidden, d, False, f"{prefix}.down")

    @torch.no_grad()
    def load_from(self, blk: Block) -> None:
        """Copy the block's weights in, fused."""
        a, shared = blk.attn, blk.moe.shared
        self.qkv.weight.copy_(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]))
        if self.joint:
            self.joint_qkv.weight.copy_(torch.cat([a.jq.weight, a.jk.weight, a.jv.weight]))
        if self.qkv.bias is not None:
            self.qkv.bias.copy_(torch.cat([a.wq.bias, a.wk.bias, a.wv.bias]))
        self.o.weight.copy_(a.wo.weight)
        if self.o.bias is not None:
            self.o.bias.copy_(a.wo.bias)
        if shared is not None:
            self.gate_up.weight.copy_(torch.cat([shared.gate.weight, shared.up.weight]))
            self.down.weight.copy_(shared.down.weight)


def _rope(t: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (``model/attention.rotate``) on token-major t (N, heads · Dh), cos and sin (N, Dh)."""
    n = t.shape[0]
    return rotate(t.view(n, heads, -1), cos[:, None], sin[:, None]).reshape(n, -1)


def run_block(blk: Block, lin: BlockLinears, attn, experts, x: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    """Our block on a flat batch x (N, D): vLLM ``Attention`` ``attn`` on its paged cache, vLLM's
    fused MoE ``experts`` for the routed experts. ``z``: the dechunked concepts (joint decoding)."""
    h = blk.attn_norm(x)
    qkv = lin.qkv(h)
    if lin.joint and z is not None:
        qkv = qkv + lin.joint_qkv(z.to(h.dtype))
    q, k, v = qkv.split(lin.split, -1)
    a = blk.attn
    if lin.qk_norm == "full":
        q, k = a.q_norm(q), a.k_norm(k)
    elif lin.qk_norm == "head":
        n = q.shape[0]
        q = a.q_norm(q.view(n, lin.heads, -1)).reshape(n, -1)
        k = a.k_norm(k.view(n, lin.kv_heads, -1)).reshape(n, -1)
    o = attn(_rope(q, lin.heads, cos, sin), _rope(k, lin.kv_heads, cos, sin), v.contiguous())  # (N, H · Dh)
    x = x + lin.o(o.to(x.dtype))
    return x + _ffn(blk, lin, experts, blk.moe_norm(x))


def _ffn(blk: Block, lin: BlockLinears, experts, h: torch.Tensor) -> torch.Tensor:
    """The block's MoE on h (N, D): our fp32 router's logits, vLLM's fused experts, the shared expert."""
    moe = blk.moe
    logits = F.linear(h.float(), moe.router.weight.float())  # (N, E) fp32, as ours
    y = experts(hidden_states=h, router_logits=logits)
    if lin.gate_up is not None:
        g, u = lin.gate_up(h).chunk(2, -1)
        s = lin.down(F.silu(g) * u)
        y = y + (torch.sigmoid(moe.shared_gate(h)) * s if moe.shared_gate is not None else s)
    return y
