"""Validation metrics the training loop logs: loss, bits per byte and realised compression
(CONCEPTMOE.md §5).

``evaluate_tokens``: the model over a token stream in windows of ``seq_len`` that overlap by
one token, so every token but the very first is predicted exactly once.
``val_loss`` = mean next-token cross-entropy (nats); ``val_bpb`` = summed NLL in bits divided
by the UTF-8 bytes of the predicted tokens (exact for a byte-level BPE, see data/tokenizer.py);
``compression`` = tokens per concept over the evaluated windows (1.0 for a plain MoE);
``tokens`` = predicted tokens; ``p_histogram`` (ConceptMoE) = counts of the router's boundary
probability in ``P_BINS`` equal bins over [0, 1] (a window's first position, p = 1, left out).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import UserError
from ..model.health import P_BINS, HealthTally, summary

# P_BINS (model/health.py): boundary-probability histogram bins over [0, 1] (how decisive the router is)
EVAL_BATCH = 16  # windows per forward pass: one fixed value, so every evaluation path agrees bitwise


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, end) windows of at most seq_len tokens, consecutive ones sharing one token."""
    out, start = [], 0
    while start < n_tokens - 1:
        end = min(start + seq_len, n_tokens)
        out.append((start, end))
        start = end - 1
    return out


@torch.no_grad()
def evaluate_tokens(model: torch.nn.Module, ids: np.ndarray, byte_len: np.ndarray, seq_len: int,
                    batch_size: int = EVAL_BATCH, max_tokens: int | None = None,
                    progress: bool = False, ratio: float | None = None, extrapolate: bool = False,
                    health: bool = False) -> dict[str, Any]:
    """Validation numbers of ``model`` over the token ids ``ids`` (restores train/eval mode).

    ``progress`` shows a bar for validations of more than a few batches. ``ratio``: the R asked
    of an elastic ConceptMoE (reported as ``ratio`` beside the realised ``compression``), outside
    its trained range only with ``extrapolate``.
    """
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise UserError("evaluation text is too short: it needs at least two tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tally, before = (HealthTally(training=False) if health else None), getattr(model, "health", None)
    if tally is not None:
        model.health = tally
    nll, n_pred, n_bytes, n_tok, n_concepts = 0.0, 0, 0, 0, 0
    p_hist = torch.zeros(P_BINS, dtype=torch.float64)
    spans = windows(len(ids), seq_len)
    full = [s for s in spans if s[1] - s[0] == seq_len]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[s] for s in spans if s[1] - s[0] != seq_len]  # the short tail runs alone
    for group in tqdm(groups, desc="validating", unit="batch", leave=False, dynamic_ncols=True,
                      disable=not progress or len(groups) <= 8):
        x = torch.from_numpy(np.stack([ids[a:b] for a, b in group]).astype(np.int64)).to(device)
        out = model(x) if ratio is None else model(x, ratio=ratio, extrapolate=extrapolate)
        logits = out.logits[:, :-1].float()  # (B, T-1, V): position t predicts t+1
        target = x[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="sum").item()
        n_pred += target.numel()
        n_bytes += int(byte_len[target.cpu().numpy()].sum())
        n_tok += x.numel()
        n_concepts += int(out.boundaries.sum()) if out.boundaries is not None else x.numel()
        if out.chunks is not None:  # position 0 of a window is a boundary by definition (p = 1)
            p_hist += torch.histc(out.chunks.p[:, 1:].double().cpu(), bins=P_BINS, min=0.0, max=1.0)
    model.train(was_training)
    if tally is not None:
        model.health = before
    result = {"val_loss": nll / n_pred, "val_bpb": nll / math.log(2) / max(n_bytes, 1),
              "compression": n_tok / max(n_concepts, 1), "tokens": n_pred}
    if ratio is not None:
        result["ratio"] = float(ratio)
    if p_hist.sum() > 0:
        result["p_histogram"] = [int(c) for c in p_hist.tolist()]
    if tally is not None:
        result["health"] = summary(tally, model.cfg)
        if model.cfg.is_concept:
            result["health"]["target"] = float(ratio or model.cfg.compression_ratio)
    return result
