"""Elastic compression: one ConceptMoE, its ratio R chosen per sequence (issue 21; CONCEPTMOE.md §2).

A model with ``elastic_ratios`` (the trained set R_1 < ... < R_K) is trained on sequences that
each draw their own target R_i, and is told R_i by ``RatioEmbedding``:

- a logit shift s(R) of the router's boundary probability, p' = sigmoid(logit(p) + s(R))
  (every mode; ``ratio_embedding="shift"`` is this alone: the threshold-shift baseline, where
  the router moves its threshold but the concept layers never learn which R made their chunks);
- ``"router"``: also a vector e_r(R) added to the router's input ĥ (B, T, D) before W_q/W_k, so
  the router can change *which* positions it cuts, not only how many;
- ``"router+concept"``: also a vector e_c(R) added to the concepts entering the concept model, so
  the concept layers know the chunk lengths they are given.

Every parameter is a table with one row per trained ratio, interpolated piecewise-linearly in
log R between the trained ratios (``interp_weights``); outside [R_1, R_K] the end segments are
extended, which callers refuse unless asked to extrapolate (``check_ratio``).

The ratio loss is per sequence: F_i and G_i over row i's real positions, L_i against R_i, then
the mean over the rows (``per_sequence_ratio_loss``). A sequence never spans micro-batches or
processes, and those hold equal numbers of rows, so the local mean per micro-batch is exact under
``grad_accum`` and data parallelism (the trainer divides by K, data parallelism averages over W:
the gradient is that of the mean over the global batch), unlike F and G of the fixed-R loss,
which are global sums (``stats.py``).

Shape legend: B batch, T tokens, K trained ratios, D d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .chunking import ratio_loss_fg
from .fp32 import fp32_island


@dataclass
class RatioTerms:
    """What the model adds for each row's ratio."""

    ratio: torch.Tensor  # (B,) the requested R per row
    shift: torch.Tensor  # (B,) logit shift of the boundary probability
    router: torch.Tensor | None  # (B, D) added to the router's input, or None
    concept: torch.Tensor | None  # (B, D) added to the concepts, or None


MAX_TRAINED_RATIO = 64  # tokens per concept; the paper uses 1.5-4
# Trained ratios at least 1% apart: the ratio embedding interpolates in log R between neighbours,
# and two nearly equal ones divide by ~0 (2 and 2.0000000001 gave NaN at step 1; issue 41).
MIN_RATIO_GAP = 1.01


def ratio_set_problem(rs) -> str | None:
    """Why a list of trained ratios (elastic_ratios, --ratios) cannot be trained (None: it can).
    The one check of every path: ``--ratios``, ``--set elastic_ratios``, stored and converted configs."""
    if not (isinstance(rs, list) and len(rs) >= 2 and all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                                          for r in rs)):
        return "give at least two ratios"
    if not all(math.isfinite(r) and 1 < r <= MAX_TRAINED_RATIO for r in rs):
        return f"every ratio must be > 1 and <= {MAX_TRAINED_RATIO}"
    if any(b <= a for a, b in zip(rs, rs[1:])):
        return "the ratios must increase, each given once (e.g. 1.5,2,3)"
    close = [(a, b) for a, b in zip(rs, rs[1:]) if b < a * MIN_RATIO_GAP]
    if close:
        return (f"{close[0][0]!r} and {close[0][1]!r} are too close: neighbouring ratios must differ by at least "
                f"{MIN_RATIO_GAP - 1:.0%}")
    return None


def interp_weights(ratio: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear weights in log R over sorted knots (K,): ratio (B,) -> (B, K), rows sum to 1.

    Beyond the ends the first/last segment is extended linearly (weights may leave [0, 1])."""
    x, k = ratio.float().log(), knots.float().log()
    K = k.numel()
    if K == 1:
        return torch.ones(x.shape[0], 1, device=x.device)
    i = (torch.searchsorted(k, x.contiguous(), right=True) - 1).clamp(0, K - 2)  # (B,) segment
    t = (x - k[i]) / (k[i + 1] - k[i])  # (B,) position inside it
    w = torch.zeros(x.shape[0], K, device=x.device)
    w.scatter_(1, i[:, None], (1 - t)[:, None])
    return w.scatter_add(1, (i + 1)[:, None], t[:, None])


# The concept vector is CONCEPT_SCALE x its parameter: Adam moves every weight by ~lr per step
# whatever its gradient, and a vector added to concept states of rms ~0.04 must move slower than
# that (at scale 1 it reached rms 0.018 in 500 tiny steps and cost ~0.05 BPB; notes of issue 21).
CONCEPT_SCALE = 0.1


class RatioEmbedding(nn.Module):
    """Per-trained-ratio tables (shift, router vector, concept vector), interpolated in log R."""

    def __init__(self, ratios: list[float], d: int, mode: str, design: float) -> None:
        super().__init__()
        # The trained ratios are config, not state: a plain list (a buffer would be left
        # uninitialised by loaders that build the model on the meta device, e.g. transformers).
        self.mode, self.ratios = mode, sorted(float(r) for r in ratios)
        # Start from the boundary odds of 1/R relative to the design ratio: the router begins near
        # its fixed-R behaviour at ``design`` and cuts more (fewer) boundaries below (above) it.
        self.shift = nn.Parameter(math.log(design - 1) - torch.log(torch.tensor(self.ratios) - 1))  # (K,)
        K = len(ratios)
        self.router = nn.Parameter(torch.zeros(K, d)) if mode != "shift" else None  # (K, D)
        self.concept = nn.Parameter(torch.zeros(K, d)) if mode == "router+concept" else None

    def forward(self, ratio: torch.Tensor) -> RatioTerms:
        w = interp_weights(ratio, torch.tensor(self.ratios, device=ratio.device))  # (B, K)
        mix = fp32_island(lambda t: None if t is None else w @ t)  # fp32: small tables, exact interpolation
        concept = None if self.concept is None else CONCEPT_SCALE * mix(self.concept)
        return RatioTerms(ratio, mix(self.shift), mix(self.router), concept)


def per_sequence_ratio_loss(p: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor,
                            real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean over rows of L_i = ratio loss(F_i, G_i, R_i); also (F (B,), G (B,)).

    p (B, T) probabilities, b (B, T) decisions, ratio (B,), real (B, T) bool real positions."""
    return _per_sequence(p, b, ratio, real)


@fp32_island
def _per_sequence(p: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor,
                  real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.ones_like(p) if real is None else real.float()
    n = w.sum(1).clamp_min(1)  # (B,)
    F_ = ((b.float() * w).sum(1) / n).detach()
    G = (p * w).sum(1) / n
    return ratio_loss_fg(F_, G, ratio).mean(), F_, G


def as_ratios(ratio, batch: int, device: torch.device) -> torch.Tensor:
    """A ratio argument (number, sequence or tensor of one per row) as a (B,) float tensor."""
    r = torch.as_tensor(ratio, dtype=torch.float32, device=device).flatten()
    if r.numel() == 1:
        r = r.expand(batch)
    if r.numel() != batch:
        raise ValueError(f"ratio: one value or one per row ({batch}), got {r.numel()}")
    return r


# How far an asked-for extrapolation may reach: at most this factor beyond the trained range (in R),
# and never R <= 1. The end segments of the tables are extended linearly in log R, which means
# nothing far away (R = 1e300 overflowed the shift and read as "diverged weights"; issue 41).
EXTRAPOLATE_FACTOR = 2.0
TOL = 1e-6  # relative: a ratio passed through float32 (a tensor per row) still names its trained value


def extrapolation_range(cfg) -> tuple[float, float]:
    """(lowest, highest) R an elastic config serves with extrapolation (lowest is exclusive when 1)."""
    lo, hi = min(cfg.elastic_ratios), max(cfg.elastic_ratios)
    return max(1.0, lo / EXTRAPOLATE_FACTOR), hi * EXTRAPOLATE_FACTOR


def ratio_values(ratio) -> list[float]:
    """The distinct values of a ratio argument (number, sequence or tensor), for ``check_ratio``."""
    return torch.as_tensor(ratio, dtype=torch.float64).flatten().unique().tolist()


def check_ratio(cfg, ratios: list[float], extrapolate: bool = False, flag: str = "--ratio") -> str | None:
    """Why these requested ratios cannot be served by this config (None: they can): the one check of
    every entry point (CLI flags, ``model(ids, ratio=)``, ``generate``, the transformers model).
    ``flag`` names what the user gave (``--ratio``, ``ratio``, ``concept_ratio``)."""
    ask = "--extrapolate" if flag.startswith("--") else "extrapolate=True"
    if not cfg.is_concept:
        return f"{flag} applies to ConceptMoE runs only (this run is a plain MoE)"
    bad = [r for r in ratios if not (math.isfinite(r) and r > 1)]
    if bad:
        return f"{flag}: a ratio must be a finite number > 1, got {bad[0]:g}"
    if cfg.elastic_ratios is None:
        off = [r for r in ratios if abs(r - cfg.compression_ratio) > TOL * r]
        if off:
            return (f"{flag}: this run was trained for R={cfg.compression_ratio:g} only (not elastic); "
                    f"train with --ratios to choose R at inference")
        return None
    lo, hi = min(cfg.elastic_ratios), max(cfg.elastic_ratios)
    out = [r for r in ratios if not lo * (1 - TOL) <= r <= hi * (1 + TOL)]
    if out and not extrapolate:
        return f"{flag}: R={out[0]:g} is outside the trained range [{lo:g}, {hi:g}]; pass {ask} to try it anyway"
    elo, ehi = extrapolation_range(cfg)
    far = [r for r in out if not (r > elo * (1 - TOL) and r <= ehi * (1 + TOL))]
    if far:
        reach = f"({elo:g}, {ehi:g}]" if elo == 1 else f"[{elo:g}, {ehi:g}]"
        return (f"{flag}: R={far[0]:g} is too far outside the trained range [{lo:g}, {hi:g}]: {ask} reaches "
                f"at most {EXTRAPOLATE_FACTOR:g}x beyond it, R in {reach}")
    return None


def require_ratio(cfg, ratio: float | None, extrapolate: bool = False) -> float | None:
    """``ratio`` if this config can serve it (None stays None: the design ratio); else a UserError."""
    from ..errors import UserError

    if ratio is None:
        if extrapolate:
            raise UserError("--extrapolate applies to a --ratio outside the trained range")
        return None
    why = check_ratio(cfg, [ratio], extrapolate)
    if why:
        raise UserError(why)
    return float(ratio)
