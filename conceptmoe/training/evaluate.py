"""Validation metrics: loss, bits per byte and realized compression (CONCEPTMOE.md §5).

- ``evaluate_tokens``: the model over a token stream in windows of ``seq_len`` that overlap by
  one token, so every token but the very first is predicted exactly once.
  ``val_loss`` = mean next-token cross-entropy (nats); ``val_bpb`` = summed NLL in bits divided
  by the UTF-8 bytes of the predicted tokens (exact for a byte-level BPE, see tokenizer.py);
  ``compression`` = tokens per concept over the evaluated windows (1.0 for a plain MoE);
  ``tokens`` = predicted tokens; ``p_histogram`` (ConceptMoE) = counts of the router's boundary
  probability in ``P_BINS`` equal bins over [0, 1] (a window's first position, p = 1, left out).
- ``evaluate(run_dir, data=None)``: a trained run on its own held-out split, or on all the text
  under ``data`` (memory-mapped token shards when the run's data was made by ``conceptmoe prepare``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import UserError
from .checkpoint import load_run
from .data import DOC_SEP, check_record, load_corpus, read_documents
from .shards import is_prepared, open_prepared
from .tokenizer import byte_lengths, encode_documents, sha256

P_BINS = 20  # boundary-probability histogram bins over [0, 1] (ConceptMoE: how decisive the router is)
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
                    progress: bool = False) -> dict[str, Any]:
    """Validation numbers of ``model`` over the token ids ``ids`` (restores train/eval mode).

    ``progress`` shows a bar for validations of more than a few batches.
    """
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise UserError("evaluation text is too short: it needs at least two tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, n_pred, n_bytes, n_tok, n_concepts = 0.0, 0, 0, 0, 0
    p_hist = torch.zeros(P_BINS, dtype=torch.float64)
    spans = windows(len(ids), seq_len)
    full = [s for s in spans if s[1] - s[0] == seq_len]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[s] for s in spans if s[1] - s[0] != seq_len]  # the short tail runs alone
    for group in tqdm(groups, desc="validating", unit="batch", leave=False, dynamic_ncols=True,
                      disable=not progress or len(groups) <= 8):
        x = torch.from_numpy(np.stack([ids[a:b] for a, b in group]).astype(np.int64)).to(device)
        out = model(x)
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
    result = {"val_loss": nll / n_pred, "val_bpb": nll / math.log(2) / max(n_bytes, 1),
              "compression": n_tok / max(n_concepts, 1), "tokens": n_pred}
    if p_hist.sum() > 0:
        result["p_histogram"] = [int(c) for c in p_hist.tolist()]
    return result


def evaluate(run_dir: str | Path, data: str | Path | None = None, device: str = "auto",
             batch_size: int | None = None, max_tokens: int | None = None,
             progress: bool = False) -> dict[str, Any]:
    """Evaluate a trained run: on its held-out split, or on all the text under ``data``
    (a directory made by ``conceptmoe prepare``: its held-out split).

    The held-out split is rebuilt from the run's stored (absolute) data path and checked
    against the stored fingerprint; ``max_tokens`` defaults to the run's ``val_tokens``.
    """
    model, cfg, tok, run_cfg = load_run(run_dir, device)
    train_cfg = run_cfg.get("train", {})
    source = train_cfg.get("data") if data is None else data
    prep = open_prepared(source) if is_prepared(source) else None  # `conceptmoe prepare` shards
    if prep is not None and sha256(tok) != prep.manifest["tokenizer"]["sha256"]:
        raise UserError(f"{source} was prepared with another tokenizer than the run's")
    if data is None:
        record = run_cfg.get("data")
        corpus = prep or load_corpus(train_cfg.get("data"), legacy_split=record is None)
        check_record(record, corpus.record())
        texts = None if prep else [d.text for d in corpus.val]
        if max_tokens is None:
            max_tokens = train_cfg.get("val_tokens")
    else:
        texts = None if prep else [d.text for d in read_documents(data)]
    ids = prep.val_tokens if prep else encode_documents(tok, texts, DOC_SEP)
    if prep is None and int(ids.max(initial=0)) >= cfg.vocab_size:
        raise UserError("tokenizer.json does not fit the model's vocabulary; the run is damaged")
    seq_len = int(train_cfg.get("seq_len", 256))
    return evaluate_tokens(model, ids, byte_lengths(tok, cfg.vocab_size), seq_len,
                           batch_size or EVAL_BATCH, max_tokens, progress)
