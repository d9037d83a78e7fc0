"""Fine-grained mixture-of-experts feed-forward layer (CONCEPTMOE.md §2b).

A softmax router (fp32) picks top-k of E SwiGLU experts per token; optional shared expert(s)
(Qwen-MoE style sigmoid gate optional); Switch load-balancing loss and router z-loss.

Two dispatch paths with one entry point, ``MoE.forward(x, dispatch=...)``:
- ``"grouped"`` (default): sort the (token, expert) pairs by expert and run one
  ``torch.nn.functional.grouped_mm`` per projection (falls back to ``"split"`` when
  grouped_mm is unavailable, for float64, and when a row of d_model or expert_hidden
  elements is not a multiple of 16 bytes, which grouped_mm rejects: e.g. expert_hidden=18 in
  fp32); on CPU in bf16 the groups are padded (``CPU_GROUP_ROWS``), with many rows all to one
  capacity and run as one batched matmul per projection instead;
- ``"split"``: the same sorted layout with a loop over experts on contiguous slices;
- ``"loop"``: the obviously-correct reference, a loop over experts with boolean masks.

Shape legend: N tokens (flattened), D d_model, E experts, K top-k, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .fp32 import fp32_island
from .stats import RouterStats

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")
# CPU, bf16: every expert's rows are padded to a multiple of this, so that the grouped matmuls'
# per-expert shapes repeat from step to step. oneDNN builds (JIT-compiles) a kernel for every
# new bf16 matmul shape, ~1 ms, 10-20x the matmul itself; with the routing changing every step,
# unpadded groups pay that on almost every call.
CPU_GROUP_ROWS = 64
# CPU, bf16, many rows (training, prefill): every expert padded to the same capacity (the largest
# group, rounded up as above) and the experts run as one batched matmul (E, cap, D) @ (E, D, F).
# One oneDNN call instead of grouped_mm's matmul per expert: 3-4x faster at the small preset's
# shapes (32 experts of 256 rows x 256 x 64: 0.40 vs 1.51 ms), still ~2x at twice the padding.
# Taken while the padding stays below this multiple of the real rows; else the padded groups.
CPU_BMM_MAX_PADDING = 2.0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs matmuls in here (bf16 under bf16 autocast), else x's own."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grouped_mm_fits(x: torch.Tensor, hidden: int) -> bool:
    """Whether grouped_mm takes these operands: it needs 16-byte row strides (D and F)."""
    dtype = compute_dtype(x)
    if not _HAS_GROUPED_MM or dtype == torch.float64:
        return False
    size = dtype.itemsize
    return (x.shape[-1] * size) % 16 == 0 and (hidden * size) % 16 == 0


@dataclass
class MoEAux:
    """Router statistics of one MoE layer; its own balance and z-loss follow from them. (The
    model's loss sums the statistics over all layers and processes instead: ``stats.py``.)"""

    stats: RouterStats

    @property
    def balance_loss(self) -> torch.Tensor:
        """Switch load-balancing loss of this layer over its tokens: E · Σ_e f_e · P_e."""
        s, E = self.stats, self.stats.counts.numel()
        if s.n_tokens == 0:
            return s.prob_sum.sum() * 0
        f = s.counts.float() / (s.n_tokens * s.top_k)  # fraction of routed slots per expert
        P = s.prob_sum / s.n_tokens
        balance = E * (f * P).sum()
        return balance

    @property
    def z_loss(self) -> torch.Tensor:
        """Router z-loss of this layer: mean logsumexp(logits)²."""
        return self.stats.z_sum / max(self.stats.n_tokens, 1)


@fp32_island
def _route(x: torch.Tensor, weight: torch.Tensor, top_k: int,
           norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = F.linear(x, weight)  # (N, E)
    probs = logits.softmax(dim=-1)
    w, idx = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return logits, probs, w, idx


class _GatherRows(torch.autograd.Function):
    """x[idx] for rows; the backward sums with ``index_add_`` (autograd's default, ``index_put_``
    with accumulate, is 2-6x slower on CPU, most in bf16)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(idx)
        ctx.rows = x.shape[0]
        return x[idx]

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        return g.new_zeros(ctx.rows, *g.shape[1:]).index_add_(0, idx, g), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    grouped_mm's CPU backward rejects expanded (stride-0) gradients such as those of ``y.sum()``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for shared experts."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _round_rows(counts: torch.Tensor, multiple: int) -> torch.Tensor:
    """Row counts rounded up to a multiple of ``multiple``, or to a power of two below it."""
    pow2 = torch.exp2(torch.ceil(torch.log2(counts.double()))).long()  # 0 rows stay 0
    return torch.where(counts > multiple, (counts + multiple - 1) // multiple * multiple, pow2)


def _pad_groups(tok: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor, ws: torch.Tensor,
                sentinel: int, multiple: int = CPU_GROUP_ROWS,
                cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted layout with every expert's rows rounded up to a multiple of ``multiple``, or up
    to a power of two below it (decoding: a few rows per expert), or all to ``cap`` rows when it is
    given: (token of each padded row, ``sentinel`` for padding), padded counts (E,), routing
    weights (0 for padding), and the padded row of each sorted slot (N*K,).
    ``experts`` (N*K,): the expert of each sorted slot."""
    padded = _round_rows(counts, multiple) if cap is None else torch.full_like(counts, cap)
    rank = torch.arange(experts.numel(), device=tok.device) - (counts.cumsum(0) - counts)[experts]
    dest = (padded.cumsum(0) - padded)[experts] + rank  # padded row of each sorted slot
    M = int(padded.sum())
    return (tok.new_full((M,), sentinel).index_copy_(0, dest, tok), padded,
            ws.new_zeros(M, 1).index_copy(0, dest, ws), dest)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus optional shared experts."""

    def __init__(self, d: int, n_experts: int, top_k: int, hidden: int, n_shared: int = 0,
                 shared_hidden: int = 0, shared_gate: bool = False, norm_topk_prob: bool = False) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.router = nn.Linear(d, n_experts, bias=False)
        std = d ** -0.5
        # Stored as (E, in, out) so grouped_mm can use them without a transpose.
        self.w_gate = nn.Parameter(torch.randn(n_experts, d, hidden) * std)
        self.w_up = nn.Parameter(torch.randn(n_experts, d, hidden) * std)
        self.w_down = nn.Parameter(torch.randn(n_experts, hidden, d) * hidden ** -0.5)
        self.shared = SwiGLU(d, n_shared * (shared_hidden or hidden)) if n_shared else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if (n_shared and shared_gate) else None
        # (module, rows grouped by global expert, counts (E,), grouped, routing weights (M, 1)) ->
        # weighted outputs in the same order;
        # set by expert parallelism (parallel/expert_parallel.py), None: all experts are here.
        self.expert_dispatch: Callable | None = None

    # ----- routing -----
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns router logits (N, E) fp32, probs (N, E), top-k weights (N, K), indices (N, K)."""
        # An fp32 island: autocast would cast the upcast matmul back to bf16 (logit errors ~4e-3).
        return _route(x, self.router.weight, self.top_k, self.norm_topk_prob)

    def aux_terms(self, logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor) -> MoEAux:
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts)
        z_sum = fp32_island(lambda z: torch.logsumexp(z, dim=-1).pow(2).sum())(logits)
        return MoEAux(RouterStats(probs.sum(0), z_sum, counts.detach(), idx.shape[0], self.top_k))

    # ----- expert compute -----
    def _experts_loop(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Reference: for each expert, the tokens that picked it (boolean mask)."""
        y = torch.zeros_like(x)
        for e in range(self.n_experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            h = F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])
            y.index_add_(0, tok, (h @ self.w_down[e]) * w[tok, slot, None].to(x.dtype))
        return y

    def expert_ffn(self, xs: torch.Tensor, counts: torch.Tensor, grouped: bool,
                   scale: torch.Tensor | None = None, cap: int | None = None) -> torch.Tensor:
        """SwiGLU of rows xs (M, D) grouped by expert: counts[e] rows for this module's e-th expert.

        ``scale`` (M, 1): routing weights, applied to the hidden activations (M, F) before the
        down projection, which is linear: cheaper than scaling the outputs (M, D) when F < D.
        ``cap``: every expert has exactly ``cap`` rows (M = E * cap): one batched matmul each."""
        if cap is not None or grouped:
            # grouped_mm is not on autocast's list: the weights follow xs (bf16 rows under autocast)
            w_gate, w_up, w_down = (w.to(xs.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if cap is not None:
            E, D = counts.numel(), xs.shape[-1]
            x3 = xs.view(E, cap, D)
            h = F.silu(torch.bmm(x3, w_gate)) * torch.bmm(x3, w_up)  # (E, cap, F)
            if scale is not None:
                h = h * scale.view(E, cap, 1)
            return torch.bmm(h, w_down).view(E * cap, D)
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)
            g = _ContiguousGrad.apply(F.grouped_mm(xs, w_gate, offs=offs))
            u = _ContiguousGrad.apply(F.grouped_mm(xs, w_up, offs=offs))
            h = F.silu(g) * u
            return _ContiguousGrad.apply(F.grouped_mm(h if scale is None else h * scale, w_down, offs=offs))
        parts = []
        for e, (xe, se) in enumerate(zip(xs.split(counts.tolist()),
                                         (scale if scale is not None else xs[:, :1]).split(counts.tolist()))):
            if xe.shape[0]:
                h = F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])
                parts.append((h if scale is None else h * se) @ self.w_down[e])
        return torch.cat(parts) if parts else xs[:0]

    @torch.compiler.disable  # data-dependent group sizes; grouped_mm has no fp32 fake kernel on CPU
    def _experts_sorted(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                        grouped: bool, xc: torch.Tensor) -> torch.Tensor:
        """Sort (token, expert) pairs by expert; one grouped matmul (or a split loop) per weight.
        ``xc``: x in the compute dtype (bf16 under autocast); the result is in x's dtype."""
        N, K = idx.shape
        flat = idx.flatten()  # (N*K,)
        order = flat.argsort(stable=True)
        tok = order // K  # token of each sorted slot
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.expert_dispatch is not None:  # experts on other processes (installed from outside)
            # the rows travel and the experts run in the compute dtype (bf16 under autocast), the
            # routing weights scale the hidden activations: the arithmetic of the local path below
            ws = w.flatten()[order, None].to(xc.dtype)  # (N*K, 1) routing weight of each sorted slot
            out = self.expert_dispatch(self, _GatherRows.apply(xc, tok), counts, grouped, ws)  # (N*K, D)
            return x.new_zeros(x.shape).index_add_(0, tok, out.to(x.dtype))
        ws = w.flatten()[order, None].to(xc.dtype)
        if grouped and x.device.type == "cpu" and xc.dtype != torch.float32:
            cap = int(_round_rows(counts.max(), CPU_GROUP_ROWS))  # one host sync, as the padding's
            cap = cap if cap * self.n_experts <= CPU_BMM_MAX_PADDING * flat.numel() else None
            tok, counts, ws, dest = _pad_groups(tok, counts, flat[order], ws, N, cap=cap)
            xp = torch.cat([xc, xc.new_zeros(1, xc.shape[1])])  # row N: the padding rows' zero input
            out = self.expert_ffn(_GatherRows.apply(xp, tok), counts, grouped, scale=ws, cap=cap)  # (padded, D)
            # Each token's K rows, picked out of the padded ones (the padding is never cast or
            # summed), added in x's dtype.
            row = torch.empty_like(dest).index_copy_(0, order, dest)  # (N*K,) padded row of token t's k-th expert
            return _GatherRows.apply(out, row).view(N, K, -1).sum(1, dtype=x.dtype)
        out = self.expert_ffn(_GatherRows.apply(xc, tok), counts, grouped, scale=ws)  # (N*K, D)
        return x.new_zeros(x.shape).index_add_(0, tok, out.to(x.dtype))  # the K experts summed in x's dtype

    def forward(self, x: torch.Tensor, dispatch: str = "grouped") -> tuple[torch.Tensor, MoEAux]:
        """x: (N, D) valid tokens only. Returns (N, D) and the router aux terms."""
        logits, probs, w, idx = self.route(x)  # from fp32 x
        aux = self.aux_terms(logits, probs, idx)
        xc = x.to(compute_dtype(x))  # one cast for the experts and the shared expert (bf16 under autocast)
        if x.shape[0] == 0:
            y = x * 0
        elif dispatch == "loop":
            y = self._experts_loop(x, w, idx)
        elif dispatch in ("grouped", "split"):
            grouped = dispatch == "grouped" and _grouped_mm_fits(x, self.w_down.shape[1])
            y = self._experts_sorted(x, w, idx, grouped, xc)
        else:
            raise ValueError(f"unknown MoE dispatch {dispatch!r}")
        if self.shared is not None:
            s = self.shared(xc)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(xc)) * s
            y = y + s
        return y, aux
