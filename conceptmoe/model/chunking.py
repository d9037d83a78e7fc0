"""Chunk and dechunk modules: token -> concept compression and back (CONCEPTMOE.md §2, items 2–5).

- ``ChunkRouter``: boundary probabilities p_t. ``cosine`` (the paper's router):
  p_t = clamp((1 - cos(W_q h_t, W_k h_{t-1})) / 2, 0, 1); ``linear``: sigmoid of a linear score
  of the RMS-normalised state, w·h_t/rms(h_t) + c; ``fixed``: every R-th token (ablations).
  p_0 = 1 always.
- ``boundaries``: p >= 0.5 in eval, Bernoulli(sharpen(p)) while training ("boundary noise").
  Both rules put p = 0.5 on the boundary side, so eval and training agree on which side of
  the threshold a probability lies.
- ``ratio_loss``: keeps the realised compression near R. ``shift_p``: the logit shift that an
  elastic model's ratio embedding applies to p (``elastic.py``).
- ``gather_concepts``: the padded (B, C, D) concept tensor (boundary state or mean since the
  previous boundary), its mask and per-concept probabilities.
- ``dechunk``: EMA over concepts (parallel scan, ``scan.py``) of the concept outputs (or of the
  concept model's updates c_out - c_in), broadcast back to tokens, times the straight-through
  estimator of the probability of the decision taken.

Shape legend: B batch, T tokens, C concepts (max over the batch), D d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import torch
import torch.nn.functional as F
from torch import nn

from .fp32 import fp32_island
from .scan import ema_scan

LINEAR_INIT_SPREAD = 2.0  # std of the linear router's initial scores (see ChunkRouter)


@dataclass
class Chunks:
    """The result of chunking a batch of token states."""

    p: torch.Tensor  # (B, T) boundary probability
    b: torch.Tensor  # (B, T) bool boundary decision
    concept_index: torch.Tensor  # (B, T) long: j(t) = cumsum(b)_t - 1, concept each token reads
    concepts: torch.Tensor  # (B, C, D)
    mask: torch.Tensor  # (B, C) bool: real concept (rows have different counts)
    concept_p: torch.Tensor  # (B, C) p at each concept's boundary (0 for padding)
    positions: torch.Tensor  # (B, C) long token position of each concept's boundary


def _fp32_linear(lin: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """W h in fp32 whatever autocast says (the cosine router: boundaries hinge on small angles)."""
    return fp32_island(F.linear)(h, lin.weight, lin.bias)


class ChunkRouter(nn.Module):
    """Boundary probabilities from encoder states. ``step`` is the one-token cached form."""

    def __init__(self, d: int, kind: str = "cosine", ratio: float = 2.0, temperature: str = "none") -> None:
        super().__init__()
        self.kind, self.ratio = kind, ratio
        self.log_scale: nn.Parameter | None = None
        if kind == "cosine":
            self.wq = nn.Linear(d, d, bias=False)
            self.wk = nn.Linear(d, d, bias=False)
            # Identity start: p_t begins as the plain cosine distance of neighbouring states.
            nn.init.eye_(self.wq.weight)
            nn.init.eye_(self.wk.weight)
            # A learned inverse temperature exp(a) on the logit of p (a = 0: the paper's p).
            if temperature == "learned":
                self.log_scale = nn.Parameter(torch.zeros(()))
        elif kind == "linear":
            # The score reads the RMS-normalised state, so its spread does not depend on the
            # residual stream's scale: w ~ N(0, s²/d) gives scores ~ N(c, s²) across tokens, and
            # c puts a fraction 1/R of them above 0 (p >= 0.5) at the start, in eval and (through
            # sharpen) in training alike. A zero w would make every p equal, so eval would take
            # all tokens or none.
            self.score = nn.Linear(d, 1, bias=True)
            nn.init.normal_(self.score.weight, std=LINEAR_INIT_SPREAD / d ** 0.5)
            nn.init.constant_(self.score.bias,
                              -LINEAR_INIT_SPREAD * NormalDist().inv_cdf(1 - 1 / ratio))

    def forward(self, h: torch.Tensor, offset: int = 0, shift: torch.Tensor | None = None) -> torch.Tensor:
        """h: (B, T, D) -> p: (B, T) in [0, 1], with p = 1 at absolute position 0.

        ``shift`` (B,): a logit shift per row (elastic ratios, ``elastic.py``)."""
        B, T, _ = h.shape
        pos = torch.arange(offset, offset + T, device=h.device)
        if self.kind == "cosine":
            q, k = _fp32_linear(self.wq, h), _fp32_linear(self.wk, h)
            k_prev = torch.cat([k[:, :1], k[:, :-1]], dim=1)  # position 0 is overwritten below
            p = self._temper(self._cosine_p(q, k_prev))
        elif self.kind == "linear":
            p = self._linear(h)
        else:
            p = fixed_boundaries(pos, self.ratio).float().expand(B, T)
        if shift is not None:
            p = shift_p(p, shift[:, None])
        return torch.where(pos == 0, torch.ones_like(p), p)

    def step(self, h: torch.Tensor, last_key: torch.Tensor | None, pos: torch.Tensor,
             shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: h (B, D), cached W_k h_{t-1} (B, D), positions (B,) -> p (B,), new key."""
        key = None
        if self.kind == "cosine":
            q, key = _fp32_linear(self.wq, h), _fp32_linear(self.wk, h)
            if last_key is None:
                last_key = key  # only reached at position 0, where p is overwritten below
            p = self._temper(self._cosine_p(q, last_key))
        elif self.kind == "linear":
            p = self._linear(h)
        else:
            p = fixed_boundaries(pos, self.ratio).float()
        if shift is not None:
            p = shift_p(p, shift)
        return torch.where(pos == 0, torch.ones_like(p), p), key

    def key(self, h: torch.Tensor) -> torch.Tensor:
        """The cosine router's key W_k h (..., D) in fp32, as ``forward`` and ``step`` compute it:
        what a cache keeps of the last token."""
        return _fp32_linear(self.wk, h)

    def _temper(self, p: torch.Tensor) -> torch.Tensor:
        """sigmoid(exp(a) · logit(p)) with the learned scalar a (``router_temperature="learned"``):
        exp(a) > 1 pushes p away from 0.5, < 1 towards it; the decision p >= 0.5 is unchanged."""
        if self.log_scale is None:
            return p
        return _tempered(p, self.log_scale)

    @staticmethod
    @fp32_island
    def _cosine_p(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return ((1 - F.cosine_similarity(q, k, dim=-1)) / 2).clamp(0, 1)

    @staticmethod
    def linear_input(h: torch.Tensor) -> torch.Tensor:
        """What the linear router's score reads: h / rms(h) in fp32, (..., D)."""
        hf = h.float()
        return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _linear(self, h: torch.Tensor) -> torch.Tensor:
        """Linear router: sigmoid(w · h/rms(h) + c), h (..., D) -> p (...)."""
        return _linear_p(h, self.score.weight, self.score.bias)


@fp32_island
def _linear_p(h: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(F.linear(ChunkRouter.linear_input(h), w, c).squeeze(-1))


@fp32_island
def _tempered(p: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(_logit(p) * log_scale.exp())


@fp32_island
def shift_p(p: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """sigmoid(logit(p) + shift) in fp32: the elastic ratio's threshold shift (``elastic.py``)."""
    return torch.sigmoid(_logit(p) + shift)


def _logit(p: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) in fp32, p clamped to [1e-6, 1 - 1e-6] (p = 0 or 1 stays finite)."""
    q = p.float().clamp(1e-6, 1 - 1e-6)
    return torch.log(q) - torch.log1p(-q)


def fixed_boundaries(pos: torch.Tensor, ratio: float) -> torch.Tensor:
    """True where floor(t / R) changes: every R-th token (fractional R allowed), t = 0 included."""
    return (pos == 0) | (torch.floor(pos / ratio) != torch.floor((pos - 1) / ratio))


def sharpness_at(cfg, step: int, total: int) -> float:
    """The training-time boundary sharpness at optimizer step ``step`` of ``total``: constant
    ``boundary_sharpness``, or annealed linearly to ``boundary_sharpness_final`` at the last step."""
    s0, s1 = cfg.boundary_sharpness, cfg.boundary_sharpness_final
    if s1 is None or total <= 1:
        return s0 if s1 is None else s1
    return s0 + (s1 - s0) * min(max(step, 0), total - 1) / (total - 1)


def confidence_weight_at(cfg, step: int, total: int) -> float:
    """The confidence term's weight at optimizer step ``step`` of ``total``: 0 for the first
    ``router_confidence_start`` fraction of the steps, ``router_confidence_weight`` from there."""
    on = step >= cfg.router_confidence_start * total
    return cfg.router_confidence_weight if on else 0.0


def sharpen(p: torch.Tensor, s: float) -> torch.Tensor:
    """Push p toward 0/1: p^(1/s) from 0.5 up, 1 - (1-p)^(1/s) below (sharpness s).

    p = 0.5 goes up (to 0.5^(1/s)), like the eval rule p >= 0.5 that makes it a boundary.
    """
    return torch.where(p >= 0.5, p.pow(1 / s), 1 - (1 - p).pow(1 / s))


def boundaries(p: torch.Tensor, training: bool, noise: bool, sharpness: float,
               uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Boundary decisions (B, T) bool. Training with noise samples Bernoulli(sharpen(p)): as
    ``uniforms < sharpen(p)`` when uniforms (B, T) in [0, 1) are given, else from the global RNG."""
    if training and noise:
        with torch.no_grad():
            # A diverged router (p NaN) must reach the loss as NaN, not crash the sampler.
            q = sharpen(p.detach(), sharpness).nan_to_num(0.5)
            b = uniforms.to(q) < q if uniforms is not None else torch.bernoulli(q).bool()
    else:
        b = p >= 0.5
    b[:, 0] = True  # a sequence always starts a concept (p_0 = 1 already; be exact)
    return b


def ratio_loss(p: torch.Tensor, b: torch.Tensor, ratio: float,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """L = R/(R-1)·((R-1)·F·G + (1-F)·(1-G)); F = mean(b) (no grad), G = mean(p)."""
    return _ratio_loss(p, b, ratio, valid)


@fp32_island
def _ratio_loss(p: torch.Tensor, b: torch.Tensor, ratio: float, valid: torch.Tensor | None) -> torch.Tensor:
    if valid is None:
        Fm, G = b.float().mean().detach(), p.mean()
    else:
        n = valid.float().sum().clamp_min(1)
        Fm = ((b & valid).float().sum() / n).detach()
        G = (p * valid).sum() / n
    return ratio_loss_fg(Fm, G, ratio)


def ratio_loss_fg(Fm: torch.Tensor, G: torch.Tensor, R: float) -> torch.Tensor:
    """The ratio loss from F (fraction of boundaries, no grad) and G (mean probability)."""
    return R / (R - 1) * ((R - 1) * Fm * G + (1 - Fm) * (1 - G))


def padded_count(longest: int, pad_to: int, T: int) -> int:
    """The concept tensor's length: the longest row's count rounded up to a multiple of ``pad_to``,
    at most T (``gather_concepts``)."""
    return min(-(-longest // pad_to) * pad_to, T) if pad_to > 1 else longest


def gather_concepts(h: torch.Tensor, p: torch.Tensor, b: torch.Tensor,
                    pooling: str = "boundary", pad_to: int = 1) -> Chunks:
    """Select the concept vectors of each row into a right-padded (B, C, D) tensor.

    ``pad_to``: C is the largest row's count rounded up to a multiple of it (at most T), so that
    the concept layers see few distinct lengths; the extra slots are padding like any other."""
    B, T, D = h.shape
    counts = b.sum(1)  # (B,)
    C = padded_count(int(counts.max()), pad_to, T)
    cidx = b.long().cumsum(1) - 1  # (B, T) j(t)
    rows, cols = b.nonzero(as_tuple=True)
    slots = cidx[rows, cols]
    mask = torch.arange(C, device=h.device)[None] < counts[:, None]  # (B, C)
    positions = torch.zeros(B, C, dtype=torch.long, device=h.device)
    positions[rows, slots] = cols
    concept_p = p.new_zeros(B, C)
    concept_p[rows, slots] = p[rows, cols]
    if pooling == "boundary":
        concepts = h.new_zeros(B, C, D)
        concepts[rows, slots] = h[rows, cols]
    else:
        # Concept j merges tokens (b_{j-1}, b_j]: segment id = cumsum(b) - b, trailing tokens dropped.
        seg = cidx + 1 - b.long()  # (B, T)
        keep = seg < counts[:, None]
        flat = (torch.arange(B, device=h.device)[:, None] * C + seg)[keep]
        sums = h.new_zeros(B * C, D).index_add_(0, flat, h[keep])
        n = h.new_zeros(B * C).index_add_(0, flat, torch.ones_like(flat, dtype=h.dtype))
        concepts = (sums / n.clamp_min(1)[:, None]).view(B, C, D)
    return Chunks(p, b, cidx, concepts, mask, concept_p, positions)


def ste_ones(x: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: value 1 forward, identity gradient backward."""
    return 1 + x - x.detach()


def dechunk(chunks: Chunks, c_out: torch.Tensor,
            c_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """EMA the concept outputs (B, C, D), or with ``c_in`` the updates c_out - c_in, and broadcast to tokens.

    Returns (z_tok, z_scaled): z_tok = z_{j(t)} (B, T, D) for joint decoding, and
    z_scaled = z_tok · STE(P_t) to add to the residual stream. Carrying the update
    (``dechunk_source="update"``) keeps ĥ from being counted twice: with every token a concept
    and p = 1, ĥ_t + z_t is exactly the concept model's output at t.
    """
    src = c_out if c_in is None else c_out - c_in
    z = fp32_island(ema_scan)(chunks.concept_p, src).to(src.dtype)  # (B, C, D): the scan in fp32
    idx = chunks.concept_index.unsqueeze(-1).expand(-1, -1, z.shape[-1])
    z_tok = torch.gather(z, 1, idx)  # (B, T, D)
    P = torch.where(chunks.b, chunks.p, 1 - chunks.p)  # probability of the decision taken
    return z_tok, z_tok * ste_ones(P).unsqueeze(-1).to(z_tok.dtype)
