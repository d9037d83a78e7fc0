"""Batch statistics that span every data-parallel process (CONCEPTMOE.md §2.2 ratio loss, §2b).

The ratio loss (F, G), the load-balance loss (f_e, P_e), the router z-loss and the realised
compression are means over the batch. Under data parallelism each process holds a slice of the
global batch, and the concept layers see a different number of concepts on every process, so
local means would make the loss depend on the world size. The model never asks for a rank:
whoever parallelizes it sets ``model.stats_reduce`` to a function that sums a 1-D tensor over
the data-parallel group (``parallel/distributed.py``). ``None`` (one process) means local =
global. One call per training forward sums every layer's statistics at once.

Gradients: data parallelism *averages* gradients over the W processes, so a global mean
Σ_r s_r / N is written locally as s_r · W / N (plus a detached correction that makes its value
the global mean): the average of the W local gradients is then exactly the gradient of the
global mean. The no-gradient terms (F, f_e) are plain global values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RouterStats:
    """Sufficient statistics of one MoE layer's router over its (valid) tokens."""

    prob_sum: torch.Tensor  # (E,) Σ router probabilities (with grad)
    z_sum: torch.Tensor  # () Σ logsumexp(logits)² (with grad)
    counts: torch.Tensor  # (E,) routed slots per expert (no grad)
    n_tokens: int
    top_k: int


@dataclass
class ChunkStats:
    """Sufficient statistics of the chunk module: Σ p (with grad), boundaries, positions."""

    p_sum: torch.Tensor
    n_boundaries: torch.Tensor
    n_positions: torch.Tensor


def _mean(local_sum: torch.Tensor, total_sum: torch.Tensor, total_n: torch.Tensor,
          world: torch.Tensor) -> torch.Tensor:
    """Global mean with a gradient that data-parallel averaging turns into the exact one."""
    n = total_n.clamp_min(1)
    scaled = local_sum * (world / n)
    return scaled + (total_sum / n - scaled).detach()


def stats_vector(stats: list[RouterStats], chunk: ChunkStats | None = None) -> torch.Tensor:
    """Every statistic of one forward as one flat vector (no grad): per layer counts, Σ probs,
    Σ z; then the chunk's Σ p, boundaries, positions; then the layers' token counts and a 1 (the
    number of parts summed: processes x micro-batches)."""
    parts = []
    for s in stats:
        parts += [s.counts.float(), s.prob_sum.detach().float(), s.z_sum.detach().float().reshape(1)]
    if chunk is not None:
        parts += [torch.stack([chunk.p_sum.detach().float(), chunk.n_boundaries.float(),
                               chunk.n_positions.float()])]
    tail = [float(s.n_tokens) for s in stats] + [1.0]  # host ints: one transfer, not one per layer
    parts.append(torch.tensor(tail, device=parts[0].device))
    return torch.cat(parts)


def router_losses(stats: list[RouterStats], reduce: Reduce | None = None, chunk: ChunkStats | None = None,
                  totals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """(balance loss, z-loss) averaged over layers, and (F, G, compression) of the chunk module.

    Balance per layer: E · Σ_e f_e · P_e (f_e: fraction of routed slots, P_e: mean probability).
    ``totals``: the ``stats_vector`` sums of a larger batch this one is part of (gradient
    accumulation: every micro-batch of every process, measured first without gradients); its
    last entry, the number of parts, scales the gradients as the world size does.
    """
    if totals is not None:
        total = totals
    else:
        flat = stats_vector(stats, chunk)
        total = flat if reduce is None else reduce(flat)
    world = total[-1]
    ns = total[-1 - len(stats):-1]  # tokens per layer
    balance, z, i = [], [], 0
    for s, n in zip(stats, ns):
        E = s.counts.numel()
        counts, prob_sum, z_sum = total[i:i + E], total[i + E:i + 2 * E], total[i + 2 * E]
        i += 2 * E + 1
        f = counts / (n * s.top_k).clamp_min(1)
        balance.append(E * (f * _mean(s.prob_sum.float(), prob_sum, n, world)).sum())
        z.append(_mean(s.z_sum.float(), z_sum, n, world))
    out_chunk = None
    if chunk is not None:
        p_sum, n_b, n_pos = total[i], total[i + 1], total[i + 2]
        F_ = n_b / n_pos.clamp_min(1)
        G = _mean(chunk.p_sum.float(), p_sum, n_pos, world)
        out_chunk = (F_, G, float(n_pos / n_b.clamp_min(1)))
    return torch.stack(balance).mean(), torch.stack(z).mean(), out_chunk
