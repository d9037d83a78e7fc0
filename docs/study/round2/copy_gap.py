"""How much of a ConceptMoE's gap to its paired MoE is in-context copying.

    python docs/study/round2/copy_gap.py MOE_RUN CONCEPTMOE_RUN [MOE_RUN CONCEPTMOE_RUN ...] [--windows 64] [--json OUT [--append]]

Each pair is scored on the same held-out windows (as gap_by_position.py: windows of the run's
training length spread evenly over the held-out split, fp32, the ConceptMoE with its eval-mode
boundaries). Every next-token prediction t -> t + 1 is put in one class by what the window held
before it:

- ``repeat``: the bigram (x_t, x_t+1) occurred earlier in the window, so copying what followed
  the earlier x_t predicts it (what induction heads do);
- ``seen``: x_t+1 occurred earlier in the window, but not after x_t;
- ``new``: x_t+1 did not occur earlier in the window.

Printed per class: its share of the predictions, both models' loss (nats per token), the gap
(ConceptMoE - MoE; > 0: the MoE is better) and the class's share of the whole gap. Then a
synthetic probe, the standard induction test: windows of random tokens (drawn independently at
their held-out frequency) whose second half repeats the first; the loss on the first half (nothing to copy)
and on the second half (everything can be copied). A model with working induction heads drops
to near zero on the second half. The runs of a pair must share tokenizer and held-out text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gap_by_position import held_out_windows, load_pair, token_losses  # noqa: E402

from conceptmoe.files import write_json  # noqa: E402

CLASSES = ("repeat", "seen", "new")


def copy_classes(w: torch.Tensor) -> torch.Tensor:
    """For windows w (N, T): the class of each prediction t -> t + 1 (N, T - 1): 0 repeat (the pair
    (x_t, x_t+1) occurred before), 1 seen (x_t+1 is one of x_0 .. x_t), 2 new."""
    N, T = w.shape
    out = torch.full((N, T - 1), 2, dtype=torch.long)
    for n in range(N):
        row = w[n].tolist()
        toks, pairs = {row[0]}, set()
        for t in range(T - 1):
            a, b = row[t], row[t + 1]
            out[n, t] = 0 if (a, b) in pairs else (1 if b in toks else 2)
            pairs.add((a, b))
            toks.add(b)
    return out


def repeated_random(ids: torch.Tensor, n: int, T: int, seed: int = 0) -> torch.Tensor:
    """``n`` windows of ``T`` tokens: T // 2 tokens drawn at random from the held-out split (so at
    their frequency there, independently of each other), then the same again."""
    g = torch.Generator().manual_seed(seed)
    half = ids[torch.randint(len(ids), (n, T // 2), generator=g)]
    return torch.cat([half, half], dim=1)


def score_pair(moe_dir: str, cm_dir: str, n_windows: int) -> dict:
    moe, cm, ids, T = load_pair(moe_dir, cm_dir)
    w = held_out_windows(ids, T, n_windows)
    lm, _ = token_losses(moe, w)
    lc, b = token_losses(cm, w)
    cls = copy_classes(w)
    gap = lc - lm
    total = gap.sum().item()
    rows = []
    for k, name in enumerate(CLASSES):
        sel = cls == k
        cnt = int(sel.sum())
        if cnt:
            rows.append({"class": name, "share": cnt / sel.numel(), "moe": lm[sel].mean().item(),
                         "conceptmoe": lc[sel].mean().item(), "gap": gap[sel].mean().item(),
                         "share_of_gap": gap[sel].sum().item() / total if total else 0.0})
    rows.append({"class": "all", "share": 1.0, "moe": lm.mean().item(), "conceptmoe": lc.mean().item(),
                 "gap": gap.mean().item(), "share_of_gap": 1.0})
    r = repeated_random(ids, n_windows, T)
    rm, _ = token_losses(moe, r)
    rc, _ = token_losses(cm, r)
    h = T // 2
    probe = {"moe_first_half": rm[:, :h - 1].mean().item(), "moe_second_half": rm[:, h:].mean().item(),
             "conceptmoe_first_half": rc[:, :h - 1].mean().item(), "conceptmoe_second_half": rc[:, h:].mean().item()}
    return {"moe": moe_dir, "conceptmoe": cm_dir, "windows": len(w), "seq_len": T,
            "compression": b.numel() / b.sum().item(), "rows": rows, "induction_probe": probe}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="MOE_RUN CONCEPTMOE_RUN pairs")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--append", action="store_true",
                    help="add to the pairs already in --json (a pair scored again replaces its old entry)")
    args = ap.parse_args()
    if len(args.runs) % 2:
        ap.error("give the runs in pairs: MOE_RUN CONCEPTMOE_RUN ...")
    old = []
    if args.append:
        if not args.json or not Path(args.json).is_file():
            ap.error("--append needs an existing --json file")
        old = json.loads(Path(args.json).read_text())
    torch.manual_seed(0)
    results = []
    for moe_dir, cm_dir in zip(args.runs[::2], args.runs[1::2]):
        res = score_pair(moe_dir, cm_dir, args.windows)
        results.append(res)
        print(f"\n{moe_dir} vs {cm_dir}: {res['windows']} held-out windows of {res['seq_len']} tokens, "
              f"realised compression {res['compression']:.2f}")
        print("| prediction | share | MoE loss | ConceptMoE loss | gap | share of the gap |")
        print("|---|---|---|---|---|---|")
        for r in res["rows"]:
            print(f"| {r['class']} | {r['share']:.1%} | {r['moe']:.3f} | {r['conceptmoe']:.3f} | "
                  f"{r['gap']:+.3f} | {r['share_of_gap']:.0%} |")
        p = res["induction_probe"]
        print(f"repeated random tokens, loss first half -> second half: MoE {p['moe_first_half']:.2f} -> "
              f"{p['moe_second_half']:.2f}, ConceptMoE {p['conceptmoe_first_half']:.2f} -> "
              f"{p['conceptmoe_second_half']:.2f}")
    if args.json:
        new = {(r["moe"], r["conceptmoe"]) for r in results}
        write_json(Path(args.json), [r for r in old if (r["moe"], r["conceptmoe"]) not in new] + results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
