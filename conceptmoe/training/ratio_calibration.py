"""The last step of an elastic run: each trained R realised by the inference rule (issue 41).

Training cuts boundaries by sampling Bernoulli(sharpen(p)); inference cuts where p >= 0.5. The
ratio loss holds the *sampled* compression at each R, and the rule at inference lands near it
only where the router is decisive. An elastic tiny run (``--ratios 1.5,2,3,4``, 300 steps) on
the text it was tuned on realised every R within 15% at inference, on 120 stdlib modules 4.71 at
R = 4 (+18%). So after the last step the threshold shift of each trained ratio (the ratio
embedding's ``shift`` table, a logit added to the router's p) is moved until the rule p >= 0.5
realises exactly that R on a slice of the *training* text (the first batches of epoch 0, never
held-out text); between trained ratios the shift stays interpolated in log R.

The move is a bisection per ratio on one scalar; the encoder runs once per ratio (its states do
not depend on the shift) and only the router is re-run, so it costs a few forward passes. The
checkpoint keeps the trained weights (a resumed or extended run trains on from them and is
calibrated again at its end); ``model.safetensors`` and the final evaluation take the calibrated
shift. Every rank computes the same moves from the same global batches (the encoder's MoE layers
may be collective under expert parallelism or FSDP, so every rank runs it).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..files import set_modes
from ..model.chunking import boundaries

CALIBRATION_TOKENS = 32_768  # training tokens the rule is measured on
ITERATIONS = 30  # bisection steps on the logit shift
SPAN = 8.0  # |shift move| searched, in logits
SHIFT_KEY = "ratio_embed.shift"  # the table in model.safetensors


def realised(model: torch.nn.Module, h: torch.Tensor, terms, move: float) -> float:
    """Tokens per boundary of the inference rule for the ratio terms ``terms`` with their shift moved
    by ``move``."""
    b = boundaries(model.route(h, dataclasses.replace(terms, shift=terms.shift + move)), training=False,
                   noise=False, sharpness=1.0)
    return b.numel() / max(int(b.sum()), 1)


def solve(model: torch.nn.Module, h: torch.Tensor, terms, ratio: float) -> float:
    """The shift move that makes the rule realise ``ratio`` (compression falls as the shift rises)."""
    lo, hi = -SPAN, SPAN
    for _ in range(ITERATIONS):
        mid = (lo + hi) / 2
        if realised(model, h, terms, mid) > ratio:
            lo = mid  # too few boundaries: raise p
        else:
            hi = mid
    return (lo + hi) / 2


def training_slice(sampler, n_tokens: int = CALIBRATION_TOKENS) -> torch.Tensor | None:
    """The first global batches of epoch 0 (B', T); the sampler's position is restored. None for
    samplers of other tasks (the digits task's batches are dicts)."""
    keep = sampler.position
    sampler.set_position({**keep, **{k: 0 for k in keep}})
    rows, n = [], 0
    try:
        while n < n_tokens:
            x = sampler.next()
            if not torch.is_tensor(x):
                return None
            rows.append(x)
            n += x.numel()
    finally:
        sampler.set_position(keep)
    return torch.cat(rows)


@torch.no_grad()
def calibrate(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Move each trained ratio's shift so that the inference rule realises it on ``ids`` (B, T).
    ``model``: the unwrapped elastic ConceptMoE. Returns the record (per ratio: realised before,
    the move, realised after); the moves are applied to ``model`` in place."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    h, _ = model.encode(ids.to(dev))
    h = h.float()
    rows = []
    for ratio in model.ratio_embed.ratios:
        terms = model.ratio_terms(ratio, h.shape[0], h.device)  # the move only changes the shift
        move = solve(model, h, terms, ratio)
        rows.append({"ratio": ratio, "before": realised(model, h, terms, 0.0), "shift_move": move,
                     "after": realised(model, h, terms, move)})
    model.train(was_training)
    apply(model, [r["shift_move"] for r in rows])
    return {"tokens": int(ids.numel()), "source": "training text (first batches of epoch 0)", "ratios": rows}


@torch.no_grad()
def apply(model: torch.nn.Module, moves: list[float]) -> None:
    """Add the moves to the ratio embedding's shift table (a plain or a gathered full model)."""
    shift = model.ratio_embed.shift
    shift.add_(torch.tensor(moves, dtype=shift.dtype, device=shift.device))


def rewrite_weights(path: Path, moves: list[float]) -> None:
    """Replace ``path`` (a hard link to the last checkpoint's weights) by a copy whose shift table
    holds the moves; the checkpoint's file is left as it is. Atomic."""
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    tensors[SHIFT_KEY] = tensors[SHIFT_KEY] + torch.tensor(moves, dtype=tensors[SHIFT_KEY].dtype)
    tmp = path.with_name(f".{path.name}.calibrated.tmp")
    save_file(tensors, tmp, metadata=meta)
    set_modes(tmp)  # safetensors writes 0600; a run's files get the umask's mode
    os.replace(tmp, path)


def note(record: dict[str, Any]) -> str:
    parts = [f"R={r['ratio']:g}: {r['before']:.2f} -> {r['after']:.2f} (shift {r['shift_move']:+.2f})"
             for r in record["ratios"]]
    return (f"calibrated each trained R to the inference rule p >= 0.5 on {record['tokens']:,} training tokens: "
            + ", ".join(parts))
