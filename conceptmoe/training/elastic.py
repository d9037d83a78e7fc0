"""Elastic training: which target R each training sequence draws (issue 21; ``model/elastic.py``).

``conceptmoe train --ratios 1.5,2,3,4`` (or weighted, ``1.5:1,2:2,3:1,4:1``) trains one model for
every R of the set. Sequence n of the run (global sample index n = batches drawn before its own
(optimizer steps plus skipped steps) · batch_size + row) draws
its R from a hash of (seed, n) alone, so the draw does not depend on how the batch is split over
processes or micro-batches, nor on where a run was resumed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import UserError
from ..model.elastic import ratio_set_problem

_MASK = (1 << 64) - 1


def parse_ratios(spec) -> list[list[float]] | None:
    """``"1.5,2,3:2"`` (or stored [[R, weight], ...]) -> [[R, weight], ...] sorted by R; None stays None."""
    if spec is None:
        return None
    try:
        if isinstance(spec, str):
            items = [s.strip() for s in spec.split(",") if s.strip()]
            pairs = [[float(s.split(":")[0]), float(s.split(":")[1]) if ":" in s else 1.0] for s in items]
        else:
            pairs = [[float(r), float(w)] for r, w in spec]
    except (ValueError, IndexError, TypeError):
        raise UserError(f"--ratios: expected ratios like 1.5,2,3,4 or 1.5:1,2:2 (got {spec!r})") from None
    pairs.sort()
    why = ratio_set_problem([r for r, _ in pairs])
    if why:
        raise UserError(f"--ratios: {why} (got {spec!r})")
    if not all(math.isfinite(w) and w > 0 for _, w in pairs):
        raise UserError(f"--ratios: every weight must be a finite number > 0 (got {spec!r})")
    return pairs


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (a counter-based random number)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK)
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_MASK)
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_MASK)
        return x ^ (x >> np.uint64(31))


def sample_ratios(seed: int, first: int, n: int, pairs: list[list[float]]) -> torch.Tensor:
    """Target R (n,) of global samples first .. first+n-1: R_k with probability w_k / Σ w."""
    index = np.arange(first, first + n, dtype=np.uint64)
    key = _splitmix64(np.full(n, seed, dtype=np.uint64)) ^ index
    u = (_splitmix64(key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # [0, 1)
    w = np.array([p[1] for p in pairs], dtype=np.float64)
    k = np.searchsorted(np.cumsum(w) / w.sum(), u, side="right").clip(0, len(pairs) - 1)
    return torch.tensor([pairs[i][0] for i in k], dtype=torch.float32)
