"""Where a ConceptMoE loses to its paired MoE: over training, and by the token's place in a concept.

    python docs/study/round2/gap_by_position.py MOE_RUN CONCEPTMOE_RUN [--windows 64] [--json OUT]

Both runs must share the tokenizer and held-out text (one `compare` seed, or a `train` paired
with it). The held-out split is cut into windows of the run's training length (every window
starts a concept, as in training); each model scores every next-token prediction in fp32, the
ConceptMoE with its deterministic (eval-mode) boundaries. A prediction made at position t is
grouped by t's offset inside its concept (0: t is the concept's first token) and by whether
the token to predict, t + 1, starts the next concept. Printed: per group, the share of
predictions, both models' loss (nats per token) and the gap (ConceptMoE - MoE; > 0: the MoE is
better), and the group's share of the whole gap. Before that, from both runs' metrics.jsonl: the
training cross-entropy of each tenth of the run (both runs saw the same batches), and its gap.
``--ema-off`` adds a column: the ConceptMoE's loss with its dechunk EMA switched off at evaluation
(every concept's smoothing weight p set to 1, so z_j = c_j; boundaries unchanged), which says how
much the trained model relies on mixing each concept with the ones before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from conceptmoe.cli.bench import run_held_out_ids  # noqa: E402
from conceptmoe.model import lm as lm_module  # noqa: E402
from conceptmoe.training.checkpoint import load_run  # noqa: E402

MAX_OFFSET = 4  # offsets >= this are one group


@torch.no_grad()
def token_losses(model, windows: torch.Tensor, batch: int = 8):
    """(per-prediction losses (N, T-1), the concept boundaries (N, T) or None)."""
    losses, bounds = [], []
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        out = model(x)
        logits = out.logits[:, :-1].float()
        losses.append(F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none"))
        bounds.append(getattr(out, "boundaries", None))
    return torch.cat(losses), (torch.cat(bounds) if bounds[0] is not None else None)


def ema_off(dechunk):
    """``dechunk`` with every concept's EMA weight p set to 1 (no mixing with earlier concepts)."""
    def wrapped(chunks, *args):
        return dechunk(dataclasses.replace(chunks, concept_p=torch.ones_like(chunks.concept_p)), *args)
    return wrapped


def held_out_windows(ids: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """Up to ``n`` windows of ``T`` tokens spread evenly over the held-out ids (N, T); the split is
    a few hundred files, so the windows sample all of it."""
    n = min(n, ids.numel() // T)
    starts = torch.linspace(0, ids.numel() // T - 1, n).long() * T
    return torch.stack([ids[s:s + T] for s in starts])


def load_pair(moe_dir: str, cm_dir: str):
    """(MoE, ConceptMoE, their shared held-out ids, training length) of two paired runs; exits
    with a message when the runs do not share their held-out text."""
    moe, _, _, _ = load_run(moe_dir, "cpu")
    cm, _, _, cm_cfg = load_run(cm_dir, "cpu")
    ids = run_held_out_ids(cm_dir)
    if not torch.equal(ids, run_held_out_ids(moe_dir)):
        sys.exit(f"error: {moe_dir} and {cm_dir} do not share their held-out text (pair runs of one seed)")
    return moe, cm, ids, int(cm_cfg["train"]["seq_len"])


def offsets_in_concept(b: torch.Tensor) -> torch.Tensor:
    """For boundaries b (N, T), each position's offset from its concept's first token."""
    T = b.shape[1]
    pos = torch.arange(T).expand_as(b)
    start = torch.where(b, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - start


def training_curve(moe_dir: str, cm_dir: str, parts: int = 10) -> list[dict]:
    """Mean training cross-entropy of both runs over each of ``parts`` equal spans of steps."""
    def ce(run):
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
        return {r["step"]: r["ce_loss"] for r in rows if "ce_loss" in r}
    m, c = ce(moe_dir), ce(cm_dir)
    steps = sorted(set(m) & set(c))
    out = []
    for i in range(parts):
        span = steps[len(steps) * i // parts: len(steps) * (i + 1) // parts]
        if span:
            mm, cc = (sum(d[s] for s in span) / len(span) for d in (m, c))
            out.append({"steps": [span[0], span[-1]], "moe": mm, "conceptmoe": cc, "gap": cc - mm})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("moe")
    ap.add_argument("conceptmoe")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--ema-off", action="store_true", help="also score the ConceptMoE without its dechunk EMA")
    args = ap.parse_args()
    torch.manual_seed(0)
    moe, cm, ids, T = load_pair(args.moe, args.conceptmoe)
    curve = training_curve(args.moe, args.conceptmoe)
    print("| steps | MoE training CE | ConceptMoE training CE | gap |")
    print("|---|---|---|---|")
    for r in curve:
        print(f"| {r['steps'][0]}-{r['steps'][1]} | {r['moe']:.3f} | {r['conceptmoe']:.3f} | {r['gap']:+.3f} |")
    windows = held_out_windows(ids, T, args.windows)
    n = len(windows)
    lm, _ = token_losses(moe, windows)
    lc, b = token_losses(cm, windows)
    lx = None
    if args.ema_off:
        original = lm_module.dechunk
        lm_module.dechunk = ema_off(original)
        try:
            lx, bx = token_losses(cm, windows)
        finally:
            lm_module.dechunk = original
        assert torch.equal(bx, b)  # the same concepts, only their mixing differs
    off = offsets_in_concept(b)[:, :-1].clamp(max=MAX_OFFSET)
    next_starts = b[:, 1:]
    gap = lc - lm
    total = gap.sum().item()
    rows = []
    for name, sel in ([(f"offset {k}" if k < MAX_OFFSET else f"offset >= {k}", off == k) for k in range(MAX_OFFSET + 1)]
                      + [("next token starts a concept", next_starts), ("next token inside the concept", ~next_starts),
                         ("all", torch.ones_like(next_starts))]):
        k = int(sel.sum())
        if k == 0:
            continue
        rows.append({"group": name, "share": k / sel.numel(), "moe": lm[sel].mean().item(),
                     "conceptmoe": lc[sel].mean().item(), "gap": gap[sel].mean().item(),
                     "share_of_gap": gap[sel].sum().item() / total if total else 0.0,
                     **({} if lx is None else {"conceptmoe_ema_off": lx[sel].mean().item()})})
    print(f"\n{n} held-out windows of {T} tokens; realised compression {b.numel() / b.sum().item():.2f}")
    extra = " ConceptMoE, EMA off |" if lx is not None else ""
    print("| predictions made at | share | MoE loss | ConceptMoE loss | gap | share of the gap |" + extra)
    print("|---|---|---|---|---|---|" + ("---|" if extra else ""))
    for r in rows:
        print(f"| {r['group']} | {r['share']:.1%} | {r['moe']:.3f} | {r['conceptmoe']:.3f} | "
              f"{r['gap']:+.3f} | {r['share_of_gap']:.0%} |" + (f" {r['conceptmoe_ema_off']:.3f} |" if extra else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"moe": args.moe, "conceptmoe": args.conceptmoe, "windows": n,
                                               "seq_len": T, "rows": rows, "training": curve}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
