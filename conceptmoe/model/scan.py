"""Parallel, numerically stable linear scan for the dechunk EMA (CONCEPTMOE.md §2, item 5).

The dechunk module smooths concept outputs with z_j = p_j·c_j + (1 − p_j)·z_{j−1}. That is the
first-order linear recurrence z_j = x_j + a_j·z_{j−1} with x_j = p_j·c_j and a_j = 1 − p_j.

``linear_scan`` evaluates it blockwise (the "chunked scan" of state-space models):
1. inside blocks of Q steps, z = W·x with W[j, i] = prod_{k=i+1..j} a_k, built as exp of a
   *segment sum* of log a computed by a masked cumsum (no subtraction of large prefix sums,
   so no cancellation);
2. the state at each block end is carried across blocks by the same scan, recursively, on a
   sequence Q times shorter;
3. each position adds its block's incoming state times the decay since the block start.
log a is clamped at log(1e-30) ≈ −69, so p = 1 (a = 0) gives no log(0) = −inf, and p = 0
gives log 1 = 0: no NaN or inf forward or backward. Cumulative decays below e^-60 are set to
exact zeros so that no fp32 denormals reach the matmuls (they are very slow on CPUs).

``ema_scan_reference`` is the sequential loop the tests and benchmark compare against.

Shape legend: B batch, C concepts, D channels, Q block length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 16
_LOG_FLOOR = -69.0  # exp(-69) ~ 1e-30: "zero" decay without -inf
_LOG_ZERO = -60.0  # cumulative log-decays below this become exact zeros (exp(-60) ~ 9e-27):
# left as they are they would produce fp32 denormals, which make CPU matmuls ~4x slower


def _segsum(log_a: torch.Tensor) -> torch.Tensor:
    """(..., Q) -> (..., Q, Q) with out[j, i] = sum_{k=i+1..j} log_a[k] for i <= j, -inf above."""
    Q = log_a.shape[-1]
    x = log_a[..., :, None].expand(*log_a.shape, Q)  # (..., Q(k), Q(i)) value log_a[k]
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=log_a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0)  # keep log_a[k] only where k > i
    seg = x.cumsum(dim=-2)  # seg[j, i] = sum_{i<k<=j} log_a[k]
    lower = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=log_a.device))
    return seg.masked_fill(~lower | (seg < _LOG_ZERO), float("-inf"))


def linear_scan(x: torch.Tensor, log_a: torch.Tensor, block: int = BLOCK,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """z_j = s_j x_j + exp(log_a_j) z_{j-1}, z_{-1} = 0 (s = ``scale``, default 1).

    x: (B, C, D), log_a and scale: (B, C) -> (B, C, D). The scale is folded into the block
    matrices so the (B, C, D) input is never rescaled elementwise.
    """
    B, C, D = x.shape
    if C <= block:
        W = torch.exp(_segsum(log_a)).to(x.dtype)  # (B, C, C)
        if scale is not None:
            W = W * scale[:, None, :].to(x.dtype)
        return W @ x
    pad = (-C) % block
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
        log_a = F.pad(log_a, (0, pad))
        scale = F.pad(scale, (0, pad)) if scale is not None else None
    nb = x.shape[1] // block
    xb = x.view(B * nb, block, D)
    lb = log_a.view(B, nb, block)
    W = torch.exp(_segsum(lb)).to(x.dtype).view(B * nb, block, block)  # W[j, i] = a_{i+1..j}
    if scale is not None:
        W = W * scale.reshape(B * nb, 1, block).to(x.dtype)
    z = W @ xb  # (B*nb, Q, D) intra-block scan with zero incoming state
    ends = z[:, -1].clone().view(B, nb, D)  # block-end states (clone: z is updated in place)
    block_log = lb.sum(-1).clamp_min(_LOG_FLOOR)  # (B, nb) decay across a whole block
    ends = linear_scan(ends, block_log, block)  # true states at block ends (recursive)
    incoming = F.pad(ends[:, :-1], (0, 0, 1, 0)).reshape(B * nb, 1, D)
    cum = lb.cumsum(-1)
    decay = torch.exp(cum.masked_fill(cum < _LOG_ZERO, float("-inf")))  # block start -> j
    decay = decay.to(x.dtype).view(B * nb, block, 1)
    z.baddbmm_(decay, incoming)  # add the carried state, decayed from the block start
    return z.view(B, nb * block, D)[:, :C]


def ema_log_decay(p: torch.Tensor) -> torch.Tensor:
    """log(1 - p), finite for p in [0, 1] (p = 1 maps to the floor, gradient 0 there)."""
    pf = p.to(torch.promote_types(p.dtype, torch.float32))
    return torch.log((1 - pf).clamp_min(1e-30)).clamp_min(_LOG_FLOOR)


def ema_scan(p: torch.Tensor, c: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Dechunk EMA z_j = p_j c_j + (1-p_j) z_{j-1}. p: (B, C), c: (B, C, D) -> (B, C, D)."""
    return linear_scan(c, ema_log_decay(p), block, scale=p)


def ema_scan_reference(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Sequential loop over concepts: the obviously-correct reference for ``ema_scan``."""
    z = torch.zeros_like(c[:, 0])
    out = []
    for j in range(c.shape[1]):
        pj = p[:, j, None].to(c.dtype)
        z = pj * c[:, j] + (1 - pj) * z
        out.append(z)
    return torch.stack(out, dim=1)
