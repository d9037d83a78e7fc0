"""Test helpers for the method-path tests: a "trained-like" ConceptMoE and hand-built references.

A freshly built model hides mistakes: the cosine router starts at W_q = W_k = I (swapping them
changes nothing) and the joint-decoding W' start at zero (dropping z from the decoder changes
nothing). ``trained_like`` gives every one of them random, independent weights.

``reference_losses`` rebuilds the ConceptMoE forward by hand from the model's blocks, with the
router written out as (1 - cos(W_q h_t, W_k h_{t-1})) / 2, a Python loop for the dechunk EMA and
one row at a time for the concept model, so that each gradient path from p can be switched
off on its own (detached) and compared with autograd through the real model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conceptmoe import ModelConfig, build_model

PATHS = ("ste", "ema", "ratio")  # the three ways p reaches the loss


def trained_like(seed: int = 0, router_noise: float = 0.8, joint_std: float = 1.0, **overrides):
    """A tiny ConceptMoE with random independent W_q, W_k (cosine) or score (linear) and W'_q/k/v.

    W_k = W_q + router_noise · N: neighbouring states then agree more often than not, so the
    realised compression is above 1 without being degenerate.
    """
    torch.manual_seed(seed)
    m = build_model(ModelConfig.from_preset("tiny", **overrides))
    d = m.cfg.d_model
    with torch.no_grad():
        if m.cfg.chunk_router == "cosine":
            wq = torch.randn(d, d) / d ** 0.5
            m.chunk.wq.weight.copy_(wq)
            m.chunk.wk.weight.copy_(wq + router_noise * torch.randn(d, d) / d ** 0.5)
        elif m.cfg.chunk_router == "linear":
            m.chunk.score.weight.normal_(std=2 / d ** 0.5)
            m.chunk.score.bias.normal_(std=0.5)
        for blk in m.decoder:
            if blk.attn.joint:
                for lin in (blk.attn.jq, blk.attn.jk, blk.attn.jv):
                    lin.weight.normal_(std=joint_std)
        if m.skip is not None:  # stage_skip: a learned projection, not its zero start
            m.skip.weight.normal_(std=0.5 / d ** 0.5)
        for norm in (m.encoder_norm, m.concept_norm):  # stage_norms: gains away from 1
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return m


def hand_cosine_p(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """p (B, T) from the formula, written out: p_0 = 1, p_t = (1 - cos(W_q h_t, W_k h_{t-1})) / 2."""
    q = h @ wq.T  # (B, T, D)
    k = h @ wk.T
    dot = (q[:, 1:] * k[:, :-1]).sum(-1)
    cos = dot / (q[:, 1:].norm(dim=-1) * k[:, :-1].norm(dim=-1))
    return torch.cat([torch.ones_like(cos[:, :1]), (1 - cos) / 2], dim=1)


def reference_losses(m, ids: torch.Tensor, b: torch.Tensor, paths=PATHS):
    """(ce, ratio_loss) of the cosine-router ConceptMoE ``m`` on ``ids`` with boundaries ``b``.

    p is detached on every path not named in ``paths``: "ste" (the straight-through factor of
    the decoder input), "ema" (the dechunk EMA weights), "ratio" (G in the ratio loss).
    """
    B, T = ids.shape
    h, _ = m.encode(ids)  # (B, T, D)
    p = hand_cosine_p(h, m.chunk.wq.weight, m.chunk.wk.weight)
    on = {k: (p if k in paths else p.detach()) for k in PATHS}
    xs, zs = [], []
    for r in range(B):
        pos = b[r].nonzero().flatten()
        c, _ = m.run_concepts(h[r, pos][None], torch.ones(1, len(pos), dtype=torch.bool))
        z, out = torch.zeros_like(h[r, 0]), []
        for j, t in enumerate(pos.tolist()):
            a = on["ema"][r, t]
            z = a * c[0, j] + (1 - a) * z
            out.append(z)
        z_tok = torch.stack(out)[b[r].long().cumsum(0) - 1]  # (T, D): latest concept at or before t
        P = torch.where(b[r], on["ste"][r], 1 - on["ste"][r])
        ste = 1 + P - P.detach()  # value 1, gradient identity
        xs.append(h[r] + z_tok * ste[:, None])
        zs.append(z_tok)
    x, z_tok = torch.stack(xs), torch.stack(zs)
    cos, sin = m.rope(T, x.device, x.dtype)
    for blk in m.decoder:
        x, _ = blk(x, cos, sin, z=z_tok)
    logits = m.lm_head(m.norm(x))
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    R = m.cfg.compression_ratio
    Fm, G = b.float().mean(), on["ratio"].mean()
    ratio = R / (R - 1) * ((R - 1) * Fm * G + (1 - Fm) * (1 - G))
    return ce, ratio


def router_grad(m, loss: torch.Tensor) -> torch.Tensor:
    """d loss / d (W_q, W_k), flattened into one vector (zeros where there is no path)."""
    params = [m.chunk.wq.weight, m.chunk.wk.weight]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(w)).flatten()
                      for g, w in zip(grads, params)])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def right_padded(lens: list[int], seed: int) -> torch.Tensor:
    """Random token ids (B, max(lens)) with row b's real tokens in [0, lens[b]) and zeros after."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (len(lens), max(lens)), generator=g)
    for i, n in enumerate(lens):
        ids[i, n:] = 0
    return ids
