"""How hard each loss pulls on a trained ConceptMoE's chunk router.

    python docs/study/round2/router_grad.py RUN [RUN ...]

For each run: the model in training mode (boundaries sampled as in training, at the run's final
boundary sharpness) on 16 windows of its held-out text (two batches of 8 x the training length);
the norm of the gradient of the language-model loss (cross-entropy) with respect to the chunk
router's parameters, and of the router's own losses (ratio loss, plus the confidence term where
the run has one), averaged over the two batches. A ratio well above 1 means the decoder, through
the straight-through factor P and the dechunk EMA, still moves the boundaries more than the
router terms do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from conceptmoe.cli.bench import run_held_out_ids  # noqa: E402
from conceptmoe.training.checkpoint import load_run  # noqa: E402
from gap_by_position import held_out_windows  # noqa: E402  (this folder's sibling script)


def norm(grads) -> float:
    return torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)).item()


def router_pulls(run: str, windows: int = 16, batch: int = 8) -> tuple[float, float]:
    torch.manual_seed(0)
    model, cfg, _, run_cfg = load_run(run, "cpu")
    if not cfg.is_concept:
        raise SystemExit(f"error: {run} is a MoE; it has no chunk router")
    model.train()
    model.sharpness_now = cfg.boundary_sharpness_final or cfg.boundary_sharpness
    T = int(run_cfg["train"]["seq_len"])
    x = held_out_windows(run_held_out_ids(run), T, windows)
    params = [p for p in model.chunk.parameters() if p.requires_grad]
    from_ce, from_router = [], []
    for i in range(0, windows, batch):
        out = model(x[i:i + batch], labels=x[i:i + batch])
        ce = out.aux["ce_loss"]
        router = (out.loss - ce - cfg.balance_loss_weight * out.aux["balance_loss"]
                  - cfg.router_z_loss_weight * out.aux["router_z_loss"])
        from_ce.append(norm(torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)))
        from_router.append(norm(torch.autograd.grad(router, params, allow_unused=True)))
    return sum(from_ce) / len(from_ce), sum(from_router) / len(from_router)


def main(runs: list[str]) -> int:
    print("| run | router gradient from the LM loss | from the router terms | ratio |")
    print("|---|---|---|---|")
    for run in runs:
        ce, rt = router_pulls(run)
        print(f"| {run} | {ce:.4f} | {rt:.4f} | {ce / rt:.1f} |" if rt else f"| {run} | {ce:.4f} | 0 | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
