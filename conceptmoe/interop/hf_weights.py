"""Hugging Face MoE tensors <-> our ``MoELM`` state dict, key by key (CONCEPTMOE.md §2b block).

Our layout (``model/lm.py``, ``model/moe.py``)      HF layout (``model.layers.N.`` prefix)
  embed.weight / norm.weight / lm_head.weight      model.embed_tokens / model.norm / lm_head
  layers.N.attn_norm / moe_norm                    input_layernorm / post_attention_layernorm
  layers.N.attn.{wq,wk,wv,wo}                      self_attn.{q,k,v,o}_proj (.weight; .bias per cfg.attn_bias)
  layers.N.attn.{q_norm,k_norm}                    self_attn.{q_norm,k_norm}
  layers.N.moe.router                              mlp.gate
  layers.N.moe.w_gate, w_up (E, D, F)              mlp.experts.E.{gate,up}_proj (F, D) on disk, or
  layers.N.moe.w_down (E, F, D)                    mlp.experts.E.down_proj (D, F); fused in memory:
                                                   mlp.experts.gate_up_proj (E, 2F, D), down_proj (E, D, F)
  layers.N.moe.shared.{gate,up,down}               mlp.shared_expert.{gate,up,down}_proj (Qwen2-MoE)
  layers.N.moe.shared_gate                         mlp.shared_expert_gate (Qwen2-MoE)

``from_hf`` accepts per-expert (on-disk) and fused (transformers 5 in-memory) keys, converts
floating dtypes to fp32, checks every shape and refuses unknown or leftover keys by name.
``to_hf`` writes either form. Shape legend: E experts, D d_model, F expert hidden.
"""

from __future__ import annotations

import re

import torch

from ..errors import UserError
from ..model.config import ModelConfig

ATTN = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))


def attn_biases(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """The (ours, HF) attention projections that carry a bias: none, q/k/v or q/k/v/o."""
    return {"none": (), "qkv": ATTN[:3], "qkvo": ATTN}[cfg.attn_bias]
SHARED = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
_INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|model\.rotary_emb\.inv_freq")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our MoELM's parameter shapes, computed without building it (checkpoints may be large)."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.expert_hidden
    qd, kvd, E = cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_experts
    norm = {"head": (hd, hd), "full": (qd, kvd)}.get(cfg.qk_norm)
    out = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "moe_norm.weight": (d,),
                    p + "attn.wq.weight": (qd, d), p + "attn.wk.weight": (kvd, d),
                    p + "attn.wv.weight": (kvd, d), p + "attn.wo.weight": (d, qd),
                    p + "moe.router.weight": (E, d), p + "moe.w_gate": (E, d, f),
                    p + "moe.w_up": (E, d, f), p + "moe.w_down": (E, f, d)})
        for ours, _ in attn_biases(cfg):
            out[f"{p}attn.{ours}.bias"] = out[f"{p}attn.{ours}.weight"][:1]
        if norm:
            out.update({p + "attn.q_norm.weight": (norm[0],), p + "attn.k_norm.weight": (norm[1],)})
        if cfg.n_shared_experts:
            s = cfg.n_shared_experts * cfg.shared_size
            out.update({p + "moe.shared.gate.weight": (s, d), p + "moe.shared.up.weight": (s, d),
                        p + "moe.shared.down.weight": (d, s)})
            if cfg.shared_expert_gate:
                out[p + "moe.shared_gate.weight"] = (1, d)
    return out


class _Source:
    """HF tensors being consumed: ``take`` pops a key (fp32), missing keys are a UserError."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.t = dict(tensors)

    def take(self, key: str) -> torch.Tensor:
        if key not in self.t:
            raise UserError(f"checkpoint lacks tensor {key!r}")
        x = self.t.pop(key)
        if not x.is_floating_point():
            raise UserError(f"tensor {key!r} has dtype {x.dtype}; only float weights (no quantization)")
        return x.float()

    def has(self, key: str) -> bool:
        return key in self.t


def _experts(src: _Source, p: str, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate, w_up (E, D, F), w_down (E, F, D)) from fused or per-expert keys of layer prefix p."""
    fused = src.has(p + "mlp.experts.gate_up_proj")
    if fused and src.has(p + "mlp.experts.0.gate_proj.weight"):
        raise UserError(f"layer {p}: both fused and per-expert expert weights are present")
    if fused:
        gu, down = src.take(p + "mlp.experts.gate_up_proj"), src.take(p + "mlp.experts.down_proj")  # (E, 2F, D), (E, D, F)
        if gu.dim() != 3 or gu.shape[1] % 2:
            raise UserError(f"{p}mlp.experts.gate_up_proj has shape {tuple(gu.shape)}, expected (E, 2F, D)")
        g, u = gu.chunk(2, dim=1)
        return g.transpose(1, 2), u.transpose(1, 2), down.transpose(1, 2)
    per = [[src.take(f"{p}mlp.experts.{e}.{n}_proj.weight") for e in range(E)] for n in ("gate", "up", "down")]
    try:
        g, u, dn = (torch.stack(ws) for ws in per)  # (E, F, D), (E, F, D), (E, D, F)
    except RuntimeError:
        raise UserError(f"{p}mlp.experts.*: experts of different shapes") from None
    return g.transpose(1, 2), u.transpose(1, 2), dn.transpose(1, 2)


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our MoELM state dict (fp32, contiguous) from HF tensors; refuses unknown or leftover keys."""
    src, out = _Source(tensors), {}
    out["embed.weight"] = src.take("model.embed_tokens.weight")
    out["norm.weight"] = src.take("model.norm.weight")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = src.take("lm_head.weight")
    # A tied checkpoint may still store lm_head.weight: accepted only as an exact copy.
    elif src.has("lm_head.weight") and not torch.equal(src.take("lm_head.weight"), out["embed.weight"]):
        raise UserError("tie_word_embeddings is true but lm_head.weight differs from the embedding")
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attn_norm.weight"] = src.take(p + "input_layernorm.weight")
        out[q + "moe_norm.weight"] = src.take(p + "post_attention_layernorm.weight")
        for ours, theirs in ATTN:
            out[f"{q}attn.{ours}.weight"] = src.take(f"{p}self_attn.{theirs}.weight")
        for ours, theirs in attn_biases(cfg):
            out[f"{q}attn.{ours}.bias"] = src.take(f"{p}self_attn.{theirs}.bias")
        if cfg.qk_norm != "none":
            out[q + "attn.q_norm.weight"] = src.take(p + "self_attn.q_norm.weight")
            out[q + "attn.k_norm.weight"] = src.take(p + "self_attn.k_norm.weight")
        out[q + "moe.router.weight"] = src.take(p + "mlp.gate.weight")
        out[q + "moe.w_gate"], out[q + "moe.w_up"], out[q + "moe.w_down"] = _experts(src, p, cfg.n_experts)
        if cfg.n_shared_experts:
            for ours, theirs in SHARED:
                out[f"{q}moe.shared.{ours}.weight"] = src.take(f"{p}mlp.shared_expert.{theirs}.weight")
            out[q + "moe.shared_gate.weight"] = src.take(p + "mlp.shared_expert_gate.weight")
    _drop_inv_freq(src, cfg)
    if src.t:
        left = sorted(src.t)
        raise UserError(f"checkpoint holds {len(left)} tensor(s) this {cfg.extra.get('hf_architecture', 'MoE')} "
                        f"import does not understand: {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}")
    want = expected_shapes(cfg)
    for k, v in out.items():
        if tuple(v.shape) != want[k]:
            raise UserError(f"tensor for {k} has shape {tuple(v.shape)}, config.json implies {want[k]}")
    return {k: v.contiguous() for k, v in out.items()}


def _drop_inv_freq(src: _Source, cfg: ModelConfig) -> None:
    """Old checkpoints store RoPE ``inv_freq`` buffers: accept them only if they match ours."""
    hd = cfg.head_dim
    want = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    for key in [k for k in src.t if _INV_FREQ.fullmatch(k)]:
        inv = src.take(key).double()
        if inv.shape != want.shape or not torch.allclose(inv, want, rtol=1e-5):
            raise UserError(f"{key} does not match rope theta {cfg.rope_theta:g} and head_dim {hd}")


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, arch: str, fused: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors (per-expert on-disk keys, or ``fused`` in-memory keys) from our MoELM state dict.

    ``arch == "qwen2_moe"`` fills in the always-present gated shared expert exactly (see
    ``hf_config.hf_config_from_model``). Tied embeddings: ``lm_head.weight`` only when ``fused``.
    """
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if fused or not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    d = cfg.d_model
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = state[q + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = state[q + "moe_norm.weight"]
        for ours, theirs in ATTN:
            out[f"{p}self_attn.{theirs}.weight"] = state[f"{q}attn.{ours}.weight"]
        for ours, theirs in attn_biases(cfg):
            out[f"{p}self_attn.{theirs}.bias"] = state[f"{q}attn.{ours}.bias"]
        if arch != "qwen2_moe" and cfg.attn_bias == "qkv":  # attention_bias covers o_proj too: zero
            out[p + "self_attn.o_proj.bias"] = torch.zeros(d)
        if arch == "qwen2_moe" and cfg.attn_bias == "none":  # qkv_bias is always true there: zeros
            for ours, theirs in ATTN[:3]:
                out[f"{p}self_attn.{theirs}.bias"] = torch.zeros(state[f"{q}attn.{ours}.weight"].shape[0])
        if cfg.qk_norm != "none":
            out[p + "self_attn.q_norm.weight"] = state[q + "attn.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = state[q + "attn.k_norm.weight"]
        out[p + "mlp.gate.weight"] = state[q + "moe.router.weight"]
        g, u, dn = state[q + "moe.w_gate"], state[q + "moe.w_up"], state[q + "moe.w_down"]  # (E, D, F), (E, F, D)
        if fused:
            out[p + "mlp.experts.gate_up_proj"] = torch.cat([g.transpose(1, 2), u.transpose(1, 2)], dim=1)
            out[p + "mlp.experts.down_proj"] = dn.transpose(1, 2)
        else:
            for e in range(cfg.n_experts):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = g[e].T
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = u[e].T
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = dn[e].T
        if arch != "qwen2_moe":
            continue
        if cfg.n_shared_experts:
            sh = {theirs: state[f"{q}moe.shared.{ours}.weight"] for ours, theirs in SHARED}
            gate = state.get(q + "moe.shared_gate.weight")
            if gate is None:  # ungated shared expert: sigmoid(0) * (2 * down) == down, exactly
                gate, sh["down_proj"] = torch.zeros(1, d), 2 * sh["down_proj"]
        else:  # no shared expert: one of width 1 that contributes exactly zero
            sh = {"gate_proj": torch.zeros(1, d), "up_proj": torch.zeros(1, d), "down_proj": torch.zeros(d, 1)}
            gate = torch.zeros(1, d)
        for theirs, w in sh.items():
            out[f"{p}mlp.shared_expert.{theirs}.weight"] = w
        out[p + "mlp.shared_expert_gate.weight"] = gate
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
