"""A run's held-out token ids for the benchmarks that send or time real text (bench latency, bench serve)."""

from __future__ import annotations

import torch

from ..errors import UserError


def run_held_out_ids(run_dir: str) -> torch.Tensor:
    """The token ids of a run's held-out split (as ``conceptmoe eval`` rebuilds and checks it);
    the weights are not read here (the benchmark loads the run itself)."""
    from ..evaluation.evaluate import held_out_tokens
    from ..training.checkpoint import load_run_meta

    cfg, tok, run_cfg = load_run_meta(run_dir)
    ids, _ = held_out_tokens(run_cfg, cfg, tok)
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise UserError(f"{run_dir}: its held-out split is empty")
    return ids
