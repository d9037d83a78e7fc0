"""Analytic compute accounting: parameters, activated FLOPs, attention-map FLOPs, KV-cache bytes.

Implements CONCEPTMOE.md §3. Activated FLOPs per token count the linear layers only
(attention projections, joint-decoding W', router, activated routed experts, shared experts,
chunk-router projections, the stage skip's projection (``stage_skip``), LM head) at 2 FLOPs per multiply-accumulate, plus 1 FLOP per
attention-bias element (``attn_bias``). Concept-model layers
count with weight ``concept_loops / R``: they run on about L/R positions. Attention-map FLOPs
(QKᵀ and AV) are reported separately, averaged over causal positions of a sequence of length
``seq_len``: 4·H·Dh·(n+1)/2 per position for a layer over n positions. KV-cache bytes per token
count K and V of every layer; concept layers keep one cache per loop with about 1/R entries
per token.

A vision-language config (``image_size`` > 0) also counts its patch embedding (C·P²·d MACs
at an image position, ``vision.py``) at ``image_fraction`` of the positions (default 1: every
position a patch, an upper bound) and its parameters; text-only accounting is unchanged.

``activated_params`` = all parameters minus the routed experts a token does not select
(embeddings included, concept layers counted once, the chunk router's learned temperature and an
elastic model's ratio-embedding tables included: they have no per-token MACs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass
class LayerCost:
    """Per-position multiply-accumulates and parameters of one block."""

    macs: float
    params: int
    inactive_params: int


def _block(cfg: ModelConfig, n_experts: int, top_k: int, joint: bool) -> LayerCost:
    d, qd, kvd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = d * qd + 2 * d * kvd + qd * d
    bias = {"none": 0, "qkv": qd + 2 * kvd, "qkvo": qd + 2 * kvd + d}[cfg.attn_bias]
    joint_w = (d * qd + 2 * d * kvd) if joint else 0
    expert = 3 * d * cfg.expert_hidden
    shared = cfg.n_shared_experts * 3 * d * cfg.shared_size
    gate = d if (cfg.n_shared_experts and cfg.shared_expert_gate) else 0
    router = d * n_experts
    macs = attn + bias / 2 + joint_w + router + top_k * expert + shared + gate  # a bias add: 1 FLOP
    norms = 2 * d + {"none": 0, "head": 2 * cfg.head_dim, "full": qd + kvd}[cfg.qk_norm]
    params = attn + bias + joint_w + router + n_experts * expert + shared + gate + norms
    return LayerCost(macs, params, (n_experts - top_k) * expert)


def _ratio_embedding_params(cfg: ModelConfig) -> int:
    """An elastic model's tables (``elastic.py``), one row per trained ratio: the logit shift, the
    router vector (``router``, ``router+concept``) and the concept vector (``router+concept``).
    Interpolated once per sequence and added, not multiplied: no per-token MACs."""
    if not cfg.elastic_ratios:
        return 0
    vectors = {"shift": 0, "router": 1, "router+concept": 2}[cfg.ratio_embedding]
    return len(cfg.elastic_ratios) * (1 + vectors * cfg.d_model)


def count_flops(cfg: ModelConfig, seq_len: int = 2048, compression: float | None = None,
                dtype_bytes: int = 2, image_fraction: float = 1.0) -> dict:
    """Compute accounting of ``cfg`` at sequence length ``seq_len``.

    ``compression`` overrides R (tokens per concept) with a realised value, e.g. from a forward
    pass. Returns a JSON-ready dict; see the module docstring for the conventions.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 (got {seq_len})")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1 (got {dtype_bytes})")
    d, V = cfg.d_model, cfg.vocab_size
    R = 1.0 if not cfg.is_concept else float(compression or cfg.compression_ratio)
    if R < 1:
        raise ValueError(f"compression must be >= 1 (got {R})")
    token_layers: list[LayerCost] = []
    if cfg.is_concept:
        token_layers += [_block(cfg, cfg.n_experts, cfg.top_k, False)] * cfg.n_encoder_layers
        n_joint = cfg.n_joint_layers
        token_layers += [_block(cfg, cfg.n_experts, cfg.top_k, False)] * (cfg.n_decoder_layers - n_joint)
        token_layers += [_block(cfg, cfg.n_experts, cfg.top_k, True)] * n_joint
        concept_layers = [_block(cfg, cfg.concept_experts, cfg.concept_k, False)] * cfg.n_concept_layers
        loops = cfg.concept_loops
        chunk_macs = {"cosine": 2 * d * d, "linear": d, "fixed": 0}[cfg.chunk_router]
        chunk_params = {"cosine": 2 * d * d, "linear": d + 1, "fixed": 0}[cfg.chunk_router]
        chunk_params += cfg.chunk_router == "cosine" and cfg.router_temperature == "learned"  # exp(a): one scalar
        chunk_params += _ratio_embedding_params(cfg)
        skip_macs = d * d if cfg.stage_skip else 0  # W ĥ at every token (model/lm.py skip_out)
        chunk_params += skip_macs + (2 * d if cfg.stage_norms else 0)
    else:
        concept_layers, loops, chunk_macs, chunk_params, skip_macs = [], 1, 0, 0, 0
        token_layers = [_block(cfg, cfg.n_experts, cfg.top_k, False)] * cfg.n_layers
    head = d * V
    embed_params = V * d + (0 if cfg.tie_embeddings else V * d) + d  # + final norm
    token_macs = sum(c.macs for c in token_layers)
    concept_macs = sum(c.macs for c in concept_layers) * loops / R
    patch_in = cfg.image_channels * cfg.patch_size ** 2
    patch_macs = patch_in * d * image_fraction if cfg.image_size else 0
    patch_params = (patch_in * d + d + cfg.n_patches * d + d) if cfg.image_size else 0
    macs = token_macs + concept_macs + chunk_macs + skip_macs + head + patch_macs
    layers = token_layers + concept_layers
    total = sum(c.params for c in layers) + chunk_params + embed_params + patch_params
    inactive = sum(c.inactive_params for c in layers)

    hd_h = cfg.n_heads * cfg.head_dim
    n_tok, n_con = seq_len, seq_len / R
    per_pos = lambda n: 4 * hd_h * (n + 1) / 2  # noqa: E731  QKᵀ + AV, causal average
    attn_map = len(token_layers) * per_pos(n_tok) + len(concept_layers) * loops * per_pos(n_con) / R
    kv_layer = 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    kv = kv_layer * (len(token_layers) + len(concept_layers) * loops / R)
    out = {
        "name": cfg.name,
        "kind": cfg.kind,
        "compression": R,
        "seq_len": seq_len,
        "total_params": int(total),
        "activated_params": int(total - inactive),
        "activated_flops_per_token": 2 * macs,
        "attention_map_flops_per_token": attn_map,
        "kv_cache_bytes_per_token": kv,
        "breakdown_flops_per_token": {
            "token_layers": 2 * token_macs,
            "concept_layers": 2 * concept_macs,
            "chunk_router": 2 * chunk_macs,
            "lm_head": 2 * head,
        },
    }
    if cfg.image_size:
        out["breakdown_flops_per_token"]["patch_embed"] = 2 * patch_macs
    if skip_macs:
        out["breakdown_flops_per_token"]["stage_skip"] = 2 * skip_macs
    return out
