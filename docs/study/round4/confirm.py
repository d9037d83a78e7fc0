"""Round 4's confirmation on held-out text (issue 67 item 4), after the tuning grid (``tune.py``).

    nohup python docs/study/round4/confirm.py run --jobs 2 > runs/study4/confirm.log 2>&1 &   # resumable
    python docs/study/round4/confirm.py report                                               # confirm.json, .md

Each model at its best point of the tuning grid (lowest mean tuning BPB over its seeds, read from
the runs), trained paired by seed (a seed fixes both models' initialisation and batch order) and
validated on the held-out text the README reports:

| budget | data | seeds |
|---|---|---|
| the README's default (1.6M tokens) | Shakespeare (the held-out plays) | 0-7 |
| 1.2M tokens | `python-stdlib` (its held-out files) | 0-7 |
| 4.8M tokens | `python-stdlib` | 0-2 |

fp32, one thread a process. ``report`` gives each budget's paired gap ConceptMoE - MoE (> 0: the
MoE is better) with its Student-t 95% interval and verdict (round 3's ``interval.py``), every seed
beside it. ``run`` refuses to start before the grid is complete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "round3"))
import lanes  # noqa: E402
import tune  # noqa: E402
from interval import interval  # noqa: E402

ROOT = Path("runs/study4/confirm")
BUDGETS = {"default": (["--data", "shakespeare", "--tokens", "1600000"], range(8)),
           "1.2M": (["--data", "python-stdlib", "--tokens", "1200000"], range(8)),
           "4.8M": (["--data", "python-stdlib", "--tokens", "4800000"], range(3))}


def tuned() -> dict[str, list[str]]:
    """Each model's best point of the grid: its train flags (without the grid's data and budget)."""
    points, complete = tune.grid()
    if not complete:
        raise SystemExit("error: the tuning grid is not complete (python docs/study/round4/tune.py report)")
    out = {}
    for model in ("moe", "cm"):
        mine = {k: v for k, v in points.items() if k.startswith("moe") == (model == "moe")}
        out[model] = mine[tune.best(mine)]
    return out


def plan() -> tuple[dict[Path, list[str]], bool]:
    flags = tuned()
    runs = {}
    for budget, (data, seeds) in BUDGETS.items():
        for s in seeds:
            for model in ("cm", "moe"):
                runs[ROOT / budget / model / f"seed{s}"] = flags[model] + data + ["--dtype", "fp32", "--seed", str(s)]
    return runs, True


def report() -> dict:
    flags = tuned()
    rec = {"what": "issue 67: both models at their tuned points, paired by seed, on held-out text",
           "tuned_flags": flags, "machine": lanes.cpu(), "commit": lanes.commit(), "budgets": {}}
    lines = ["# Round 4 confirmation (held-out text, fp32)", "", f"Machine: {rec['machine']}; code {rec['commit']}. "
             f"MoE: `{' '.join(flags['moe'])}`; ConceptMoE: `{' '.join(flags['cm'])}`.", "",
             "| budget | seeds | MoE BPB | ConceptMoE BPB | paired gap | 95% interval | answer |", "|---|---|---|---|---|---|---|"]
    for budget, (_, seeds) in BUDGETS.items():
        per = {m: {s: lanes.bpb(ROOT / budget / m / f"seed{s}") for s in seeds} for m in ("moe", "cm")}
        paired = [s for s in seeds if per["moe"][s] is not None and per["cm"][s] is not None]
        res = interval([per["cm"][s] - per["moe"][s] for s in paired]) if paired else None
        rec["budgets"][budget] = {"per_seed": per, "paired_seeds": paired, "gap": res}
        if res:
            mean = lambda m: sum(per[m][s] for s in paired) / len(paired)  # noqa: E731
            lo, hi = res["ci95"]
            ci = f"[{lo:+.4f}, {hi:+.4f}]" if lo is not None else "-"
            lines.append(f"| {budget} | {len(paired)} of {len(seeds)} | {mean('moe'):.4f} | {mean('cm'):.4f} "
                         f"| {res['mean']:+.4f} | {ci} | {res['verdict']} |")
    (HERE / "confirm.json").write_text(json.dumps(rec, indent=2) + "\n")
    (HERE / "confirm.md").write_text("\n".join(lines) + "\n")
    return rec


def main() -> None:
    lanes.main(__doc__, plan, report, HERE / "confirm.md")


if __name__ == "__main__":
    main()
