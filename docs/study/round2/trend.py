"""The paired held-out gap of a `conceptmoe compare` run over training, one row per validation point.

    python docs/study/round2/trend.py runs/study22/d9.6M-s2 [--model topk-R2] [--base moe]

Reads OUT/BASE/seedN/metrics.jsonl and OUT/MODEL/seedN/metrics.jsonl (the records with "val_bpb",
the held-out slice that training evaluates every few hundred steps) and prints, for each seed and
each validation point both runs have reached, the tokens seen and MODEL - BASE in BPB (> 0: the
base is better). Works on runs still training: the last rows are where both have got to.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptmoe.training.checkpoint import read_metrics


def val_points(run: Path) -> dict[int, float]:
    return {rec["tokens"]: rec["val_bpb"] for rec in read_metrics(run) if "val_bpb" in rec}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a compare --out directory")
    ap.add_argument("--model", default="topk-R2")
    ap.add_argument("--base", default="moe")
    args = ap.parse_args()
    seeds = sorted(p.name for p in (args.out / args.model).glob("seed*") if (args.out / args.base / p.name).is_dir())
    if not seeds:
        ap.error(f"no seed found in both {args.out / args.model} and {args.out / args.base}")
    for seed in seeds:
        base, model = val_points(args.out / args.base / seed), val_points(args.out / args.model / seed)
        print(f"{seed}: tokens, {args.base} BPB, {args.model} BPB, gap")
        for t in sorted(set(base) & set(model)):
            print(f"  {t / 1e6:6.2f}M  {base[t]:.4f}  {model[t]:.4f}  {model[t] - base[t]:+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
