"""The router's and experts' health, counted as the model runs (CONCEPTMOE.md §2.2 chunk router, §2b experts).

A ``HealthTally`` set on a model (``model.health``) adds up, over every forward of its mode
(training or evaluation), what each MoE layer's router did (routed slots per expert, Σ logsumexp²
for the z-loss, tokens) and what the chunk router did (boundaries and positions, per target R for
an elastic model; a histogram of the boundary probabilities p, whose bins give the share within
``NEAR_THRESHOLD`` of the 0.5 threshold). Everything stays on the model's device as running sums:
no host sync per forward. ``vector``/``summary``: one flat vector that data-parallel processes sum
(whoever parallelizes the model does that; the model never asks for a rank), and the figures of a
summed vector: tokens per expert, load imbalance (max/mean), dead experts (no token over the
tally), z-loss per layer; realised compression against its target, the p histogram, the share near
the threshold. The gradient-accumulation statistics pass (``collect_stats``) is not counted.

Shape legend: E experts of a layer, P_BINS histogram bins, B batch, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stats import RouterStats

P_BINS = 20  # equal bins of p over [0, 1] (the same bins as training/validation.py's p_histogram)
NEAR_THRESHOLD = 0.1  # p in [0.5 - this, 0.5 + this) counts as undecided: histogram bins 8-11 of 20
NEAR_BINS = range(round((0.5 - NEAR_THRESHOLD) * P_BINS), round((0.5 + NEAR_THRESHOLD) * P_BINS))
COMPRESSION_BAND = 0.15  # realised compression more than 15% off its target R leaves the band


def layer_names(cfg) -> list[str]:
    """One name per MoE layer in the order the model runs them (a looped concept model's blocks once per loop)."""
    if not cfg.is_concept:
        return [f"layer{i}" for i in range(cfg.n_layers)]
    loops = cfg.concept_loops
    concept = [f"concept{i}" + (f".loop{k}" if loops > 1 else "") for k in range(loops)
               for i in range(cfg.n_concept_layers)]
    return ([f"encoder{i}" for i in range(cfg.n_encoder_layers)] + concept
            + [f"decoder{i}" for i in range(cfg.n_decoder_layers)])


@dataclass
class HealthTally:
    """Running sums of the routers' work over the forwards of one mode (``training``): in place on
    the model's device, a few small ops per layer and forward, no host sync."""

    training: bool = True
    counts_sum: list[torch.Tensor] = field(default_factory=list)  # per layer (E,) long: routed slots per expert
    z_sum: list[torch.Tensor] = field(default_factory=list)  # per layer () float64: Σ logsumexp²
    n_tokens: list[int] = field(default_factory=list)  # per layer: tokens routed
    p_hist: torch.Tensor | None = None  # (P_BINS,) float64: p histogram
    boundaries: torch.Tensor | None = None  # () long
    positions: int | torch.Tensor = 0  # real positions (a tensor when padding is masked)
    by_ratio: torch.Tensor | None = None  # (n_ratios, 2): boundaries, positions per target R
    forwards: int = 0

    def counts(self, model) -> bool:
        """Whether this forward of ``model`` is counted (its mode, and not the statistics pass)."""
        return model.training == self.training and model._stats_capture is None

    @torch.no_grad()
    def add_router(self, stats: list[RouterStats]) -> None:
        self.forwards += 1
        if not self.counts_sum:
            self.counts_sum = [s.counts.detach().clone() for s in stats]
            self.z_sum = [s.z_sum.detach().double() for s in stats]
            self.n_tokens = [s.n_tokens for s in stats]
            return
        for i, s in enumerate(stats):
            self.counts_sum[i] += s.counts
            self.z_sum[i] += s.z_sum.detach()
            self.n_tokens[i] += s.n_tokens

    @torch.no_grad()
    def add_chunk(self, p: torch.Tensor, b: torch.Tensor, real: torch.Tensor | None,
                  ratios: list[float] | None = None, row_ratio: torch.Tensor | None = None) -> None:
        """p (B, T), decisions b (B, T), real positions (B, T) or None; an elastic model's trained
        ratios and each row's target R (B,). Position 0 of a row (p = 1 by definition) is left out
        of the histogram, padding of everything."""
        q = p.detach()[:, 1:]
        if real is not None:
            real = real.bool()
            q, b = q[real[:, 1:]], b & real
        hist, nb = torch.histc(q.float(), bins=P_BINS, min=0.0, max=1.0), b.sum()
        if self.p_hist is None:
            self.p_hist, self.boundaries = hist.double(), nb
        else:
            self.p_hist += hist
            self.boundaries += nb
        self.positions = self.positions + (b.numel() if real is None else real.sum())
        if ratios and row_ratio is not None:
            pos = torch.full_like(b[:, 0], b.shape[1], dtype=torch.long) if real is None else real.sum(1)  # (B,)
            targets = torch.tensor([float(r) for r in ratios], device=b.device)
            which = torch.isclose(row_ratio.float()[None], targets[:, None]).double()  # (n_ratios, B)
            here = torch.stack([which @ b.sum(1).double(), which @ pos.double()], 1)
            self.by_ratio = here if self.by_ratio is None else self.by_ratio + here

    def vector(self) -> torch.Tensor:
        """Every running sum as one flat float64 vector (what data-parallel processes sum)."""
        dev = self.counts_sum[0].device if self.counts_sum else "cpu"
        host = torch.tensor(self.n_tokens + [float(self.forwards)], dtype=torch.float64, device=dev)
        parts = ([c.double() for c in self.counts_sum] + [torch.stack(self.z_sum)]) if self.z_sum else []
        if self.p_hist is not None:
            pos = torch.as_tensor(self.positions, dtype=torch.float64, device=dev).reshape(1)
            parts += [self.p_hist, self.boundaries.double().reshape(1), pos]
        if self.by_ratio is not None:
            parts.append(self.by_ratio.reshape(-1))
        return torch.cat(parts + [host])

    def reset(self) -> None:
        self.counts_sum, self.z_sum, self.n_tokens = [], [], []
        self.p_hist, self.boundaries, self.positions, self.by_ratio, self.forwards = None, None, 0, None, 0


def expert_figures(counts: list[float], z_sum: float, n_tokens: float) -> dict:
    """One layer: routed slots per expert, load imbalance max/mean, dead experts (no slot), z-loss."""
    mean = sum(counts) / max(len(counts), 1)
    return {"tokens": [int(c) for c in counts], "imbalance": max(counts) / mean if mean > 0 else 0.0,
            "dead": sum(1 for c in counts if c == 0), "z_loss": z_sum / max(n_tokens, 1.0)}


def summary(tally: HealthTally, cfg, vec: torch.Tensor | None = None) -> dict:
    """The figures of a tally (``vec``: its ``vector()`` summed over processes; default its own)."""
    v = (tally.vector() if vec is None else vec).double().cpu().tolist()
    L = len(tally.counts_sum)
    sizes = [c.numel() for c in tally.counts_sum]
    n_tokens, forwards = v[len(v) - L - 1:-1], int(v[-1])
    i = sum(sizes)
    z = v[i:i + L]
    i += L
    out: dict = {"forwards": forwards}
    if tally.p_hist is not None:
        hist, (nb, pos) = v[i:i + P_BINS], v[i + P_BINS:i + P_BINS + 2]
        i += P_BINS + 2
        out["compression"] = pos / max(nb, 1.0)
        out["p_histogram"] = [int(c) for c in hist]
        out["near_threshold"] = sum(hist[k] for k in NEAR_BINS) / max(sum(hist), 1.0)
    if tally.by_ratio is not None:
        pairs = [v[i + 2 * k:i + 2 * k + 2] for k in range(tally.by_ratio.shape[0])]
        out["compression_by_ratio"] = {f"{r:g}": pos / nb for r, (nb, pos) in zip(cfg.elastic_ratios, pairs) if nb > 0}
    experts, j = {}, 0
    for k, (name, E) in enumerate(zip(layer_names(cfg), sizes)):
        experts[name] = expert_figures(v[j:j + E], z[k], n_tokens[k])
        j += E
    out["experts"] = experts
    return out


def compression_off(realised: float, target: float) -> float | None:
    """How far realised is off target (a fraction, signed) when it leaves ``COMPRESSION_BAND``, else None."""
    if not target > 1 or not realised > 0:
        return None
    off = realised / target - 1
    return off if abs(off) > COMPRESSION_BAND else None
