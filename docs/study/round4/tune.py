"""Round 4's tuning grid (issue 67): the MoE and the ConceptMoE tuned with one budget on the tuning split.

    nohup python docs/study/round4/tune.py run --jobs 2 > runs/study4/tune.log 2>&1 &   # resumable
    python docs/study/round4/tune.py report                                              # the record

Every run is the README's default budget (1.6M tokens, batch 8 x 256, the small preset; the
ConceptMoE compute-matched by top-k at R = 2) on ``--data shakespeare-tune``: trained on the
training plays less three tuning plays (data/corpus.py TUNING_PLAYS), validated on those. The
held-out plays the README reports are never read. fp32, one thread per process, seeds 0-2.

The grid, 7 points a model x 3 seeds = 42 runs, in three phases; a phase starts for a model when
its previous phase has finished, and picks from it by the mean tuning BPB over the seeds:

| phase | MoE (learning rate, warm-up)                     | ConceptMoE (rates, stage options)                   |
|-------|--------------------------------------------------|-----------------------------------------------------|
| 1     | lr 1e-3, 2e-3 (today), 3e-3, 4e-3                | lr 1e-3 (today); 2e-3 and 3e-3 with the rule's      |
|       |                                                  | stage rates (auto: 1, 1/sqrt 2); 2e-3 with 1, 0.5   |
| 2     | the best lr, warm-up half and double (20, 78)    | the best rates + stage_norms; + stage_skip          |
| 3     | the best warm-up at the lr halfway to the better | the best rates + stage_norms + stage_skip           |
|       | neighbour of the best lr                         |                                                     |

Rerunning ``run`` skips finished runs (their eval.json, or the committed tuning.json where runs/
is gone) and resumes interrupted ones (``train --resume``).
``report`` writes docs/study/round4/tuning.json and tuning.md from the runs' eval.json files.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lanes  # noqa: E402
ROOT = Path("runs/study4/tune")
SEEDS = (0, 1, 2)
COMMON = ["--data", "shakespeare-tune", "--dtype", "fp32", "--tokens", "1600000"]
DEFAULT_WARMUP = 39  # 5% of the 781 steps


def _cm(lr: float, mults: str | None = None, norms: bool = False, skip: bool = False) -> list[str]:
    args = ["--lr", f"{lr:g}"] + (["--stage-lr-mults", mults] if mults else [])
    return args + (["--set", "stage_norms=true"] if norms else []) + (["--set", "stage_skip=true"] if skip else [])


PHASE1 = {
    "moe": {f"moe-lr{lr:g}": ["--model", "moe", "--lr", f"{lr:g}"] for lr in (1e-3, 2e-3, 3e-3, 4e-3)},
    "cm": {"cm-lr0.001": _cm(1e-3), "cm-lr0.002-auto": _cm(2e-3, "auto"),
           "cm-lr0.003-auto": _cm(3e-3, "auto"), "cm-lr0.002-half": _cm(2e-3, "1,0.5")},
}


def bpb(label: str, seed: int) -> float | None:
    """A run's tuning BPB: its eval.json, else the committed record (runs/ may not survive the machine)."""
    got = lanes.bpb(ROOT / label / f"seed{seed}")
    return got if got is not None else _recorded().get((label, seed))


def _recorded() -> dict[tuple[str, int], float]:
    f = HERE / "tuning.json"
    if not f.exists():
        return {}
    return {(p["label"], int(s)): v for p in json.loads(f.read_text())["points"]
            for s, v in p["tuning_bpb"].items() if v is not None}


def mean_bpb(label: str) -> float | None:
    vals = [bpb(label, s) for s in SEEDS]
    return None if any(v is None for v in vals) else statistics.mean(vals)


def best(points: dict[str, list[str]]) -> str | None:
    means = {k: mean_bpb(k) for k in points}
    return None if any(v is None for v in means.values()) else min(means, key=means.get)


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def grid() -> tuple[dict[str, list[str]], bool]:
    """Every point known so far (label -> train flags) and whether the grid is complete."""
    points = {**PHASE1["moe"], **PHASE1["cm"]}
    done = True
    m1 = best(PHASE1["moe"])
    if m1 is None:
        done = False
    else:
        lr = float(_arg(PHASE1["moe"][m1], "--lr"))
        m2 = {f"{m1}-wu{w}": PHASE1["moe"][m1] + ["--warmup-steps", str(w)] for w in (20, 78)}
        points.update(m2)
        m2b = best({m1: PHASE1["moe"][m1], **m2})
        if m2b is None:
            done = False
        else:
            lrs = sorted(float(_arg(a, "--lr")) for a in PHASE1["moe"].values())
            i = lrs.index(lr)
            nbrs = [lrs[j] for j in (i - 1, i + 1) if 0 <= j < len(lrs)]
            nb = min(nbrs, key=lambda x: mean_bpb(f"moe-lr{x:g}"))
            mid = (lr + nb) / 2
            wu = _arg(points[m2b], "--warmup-steps") or str(DEFAULT_WARMUP)
            points[f"moe-lr{mid:g}-wu{wu}"] = ["--model", "moe", "--lr", f"{mid:g}", "--warmup-steps", wu]
    c1 = best(PHASE1["cm"])
    if c1 is None:
        done = False
    else:
        c2 = {f"{c1}-norms": PHASE1["cm"][c1] + ["--set", "stage_norms=true"],
              f"{c1}-skip": PHASE1["cm"][c1] + ["--set", "stage_skip=true"]}
        points.update(c2)
        points[f"{c1}-norms-skip"] = PHASE1["cm"][c1] + ["--set", "stage_norms=true", "--set", "stage_skip=true"]
    return points, done and all(mean_bpb(k) is not None for k in points)


def plan() -> tuple[dict[Path, list[str]], bool]:
    """Every run of the grid known so far (run directory -> train flags), MoE and ConceptMoE
    interleaved, seeds before points; whether the grid is complete."""
    points, done = grid()
    moe = [(k, s) for s in SEEDS for k in points if k.startswith("moe")]
    cm = [(k, s) for s in SEEDS for k in points if not k.startswith("moe")]
    order = [t for i in range(max(len(moe), len(cm))) for t in (cm[i:i + 1] + moe[i:i + 1])]
    return {ROOT / k / f"seed{s}": points[k] + COMMON + ["--seed", str(s)] for k, s in order if bpb(k, s) is None}, done


def report() -> dict:
    points, done = grid()
    rows = []
    for label, flags in points.items():
        vals = {s: bpb(label, s) for s in SEEDS}
        got = [v for v in vals.values() if v is not None]
        rows.append({"label": label, "model": "moe" if label.startswith("moe") else "conceptmoe", "flags": flags,
                     "tuning_bpb": {str(s): v for s, v in vals.items()},
                     "mean": statistics.mean(got) if got else None,
                     "sd": statistics.stdev(got) if len(got) > 1 else None, "seeds_done": len(got)})
    commit = lanes.commit()
    rec = {"what": "issue 67 tuning grid on the tuning split (shakespeare-tune), README default budget",
           "common_flags": COMMON, "seeds": list(SEEDS), "complete": done, "machine": lanes.cpu(), "commit": commit,
           "points": rows}
    (HERE / "tuning.json").write_text(json.dumps(rec, indent=2) + "\n")
    lines = ["# Round 4 tuning grid (tuning split, 1.6M tokens, fp32, 3 seeds)", "",
             f"Machine: {rec['machine']}; code {commit}; complete: {done}. Lower is better; the best of each "
             "model in bold.", "", "| point | flags | seed 0 | seed 1 | seed 2 | mean | sd |", "|---|---|---|---|---|---|---|"]
    bests = {}
    for r in rows:
        if r["seeds_done"] == len(SEEDS) and (r["model"] not in bests or r["mean"] < bests[r["model"]]["mean"]):
            bests[r["model"]] = r
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for r in rows:
        name = f"**{r['label']}**" if bests.get(r["model"]) is r else r["label"]
        lines.append(f"| {name} | `{' '.join(r['flags'])}` | " + " | ".join(fmt(r["tuning_bpb"][str(s)]) for s in SEEDS)
                     + f" | {fmt(r['mean'])} | {fmt(r['sd'])} |")
    (HERE / "tuning.md").write_text("\n".join(lines) + "\n")
    return rec


def main() -> None:
    lanes.main(__doc__, plan, report, HERE / "tuning.md")


if __name__ == "__main__":
    main()
