"""Router calibration for latency benchmarks of untrained ConceptMoEs (CONCEPTMOE.md §2.2, §4).

An untrained cosine router puts boundaries almost anywhere, so the benchmark sets it
(``calibrate_router``) so that exactly a fraction 1/R of the benchmark's own (ĥ_t, ĥ_{t-1}) pairs are boundaries: W_q ĥ = (u·ĥ) e_1 + c e_2, W_k ĥ = (u·ĥ) e_1 ± c e_2
(a random unit u, biases added), so q·k = (u·ĥ_t)(u·ĥ_{t-1}) + τ and p_t >= 0.5 exactly when
that product <= -τ, with τ = -(the 1/R quantile). Encoder states do not depend on boundaries,
so the calibration set is the benchmark input itself (prefill: the longest input; decode: one
untimed pass over the timed steps). The cost of the router is unchanged (two d x d matmuls).
Linear routers get the same treatment through their bias; fixed routers need none; trained
runs are left alone. The realised compression is measured and reported every time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..inference.cache import InferenceState
from ..inference.steps import decode_step
from ..model.lm import ConceptMoELM
from .decode_state import restore, snapshot


@torch.no_grad()
def calibrate_router(model: ConceptMoELM, h: torch.Tensor, h_prev: torch.Tensor, n_boundaries: int,
                     seed: int = 0) -> None:
    """Make exactly ``n_boundaries`` of the N pairs (h (N, D), h_prev (N, D)) boundaries."""
    router, (N, D) = model.chunk, h.shape
    k = min(max(n_boundaries, 0), N)
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g).to(h)
    u = u / u.norm()
    if router.kind == "fixed":
        return
    x = (h.float() @ u.float())
    if router.kind == "linear":  # p = sigmoid(u·ĥ + bias) >= 0.5  <=>  u·ĥ >= -bias, ĥ = h/rms(h)
        s = (router.linear_input(h) @ u.float()).sort(descending=True).values
        thr = s[0] + 1 if k == 0 else (s[k - 1] if k == N else (s[k - 1] + s[k]) / 2)
        router.score.weight.copy_(u[None])
        router.score.bias.fill_(-float(thr))
        return
    s = (x * (h_prev.float() @ u.float())).sort().values  # products, ascending
    thr = s[0] - 1 if k == 0 else (s[-1] + 1 if k == N else (s[k - 1] + s[k]) / 2)
    tau = -float(thr)  # boundary <=> product + tau <= 0
    c = math.sqrt(abs(tau)) or 1e-6
    for name, sign in (("wq", 1.0), ("wk", 1.0 if tau >= 0 else -1.0)):
        lin = nn.Linear(D, D, bias=True).to(h)
        lin.weight.zero_()
        lin.weight[0] = u
        lin.bias.zero_()
        lin.bias[1] = sign * c
        setattr(router, name, lin)


@torch.no_grad()
def calibrate_decode(model: ConceptMoELM, ratio: float, st: InferenceState, tokens: torch.Tensor,
                     seed: int) -> None:
    """One untimed pass over the steps records ĥ; then calibrate and fix the starting key."""
    snap, seen = snapshot(st), []
    router = model.chunk
    orig = router.step

    def record(h, last_key, pos):
        seen.append(h.clone())
        return orig(h, last_key, pos)

    router.step = record
    try:
        for t in tokens:
            decode_step(model, st, t)
    finally:
        del router.step
    H = torch.stack(seen)  # (S, B, D); the step before step 0 is taken to be the last one
    prev = torch.roll(H, 1, dims=0)
    n = round(H.shape[0] * H.shape[1] / ratio)
    calibrate_router(model, H.flatten(0, 1), prev.flatten(0, 1), n, seed)
    restore(st, snap)
    if router.kind == "cosine":
        st.chunk.last_key = router.key(H[-1])
