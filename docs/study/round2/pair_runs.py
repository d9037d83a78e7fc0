"""Pair single `conceptmoe train` runs with the MoE of an earlier budget's summary, by seed.

    python docs/study/round2/pair_runs.py NAME BASE_SUMMARY LABEL=RUN_DIR [LABEL=RUN_DIR ...]

For a ConceptMoE trained alone (`conceptmoe train --seed S ...` with the settings `compare` gives
its ConceptMoE, e.g. another learning rate) against the MoE already trained on the same seed, data
and budget (the MoE's val BPB per seed from BASE_SUMMARY, a summarize.py summary.json; a seed fixes
the initialisation and the batch order). Writes docs/study/round2/NAME/: summary.json, table.md,
and each run's config.json and eval.json under LABEL-seedS/.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from conceptmoe.evaluation.compare import decisiveness

HERE = Path(__file__).resolve().parent


def _ms(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):+.4f}" + (f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else "")


def main(name: str, base: Path, specs: list[str]) -> None:
    moe = next(m for m in json.loads(base.read_text())["models"] if m["label"] == "moe")["per_seed"]
    dest = HERE / name
    dest.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict] = {}
    for spec in specs:
        label, run = spec.split("=", 1)
        run = Path(run)
        cfg, ev = json.loads((run / "config.json").read_text()), json.loads((run / "eval.json").read_text())
        seed = cfg["train"]["seed"]
        d = decisiveness(ev["p_histogram"])
        cell = cells.setdefault(label, {"label": label, "lr": cfg["train"]["lr"], "per_seed": {}})
        cell["per_seed"][seed] = {"val_bpb": ev["val_bpb"], "moe_val_bpb": moe[str(seed)]["val_bpb"],
                                  "gap": ev["val_bpb"] - moe[str(seed)]["val_bpb"],
                                  "compression": ev["compression"], "near_half": d["p_near_half"],
                                  "decisive": d["p_decisive"]}
        keep = dest / f"{label}-seed{seed}"
        keep.mkdir(exist_ok=True)
        for f in ("config.json", "eval.json"):
            shutil.copy(run / f, keep / f)
    lines = ["| run | lr | seeds | val BPB per seed | MoE per seed | gap to MoE (paired) | realised R | "
             "p in [0.4, 0.6) |", "|---|---|---|---|---|---|---|---|"]
    for c in cells.values():
        rows = [c["per_seed"][s] for s in sorted(c["per_seed"])]
        per = lambda key, fmt: " / ".join(format(r[key], fmt) for r in rows)  # noqa: E731
        lines.append(f"| {c['label']} | {c['lr']:g} | {len(rows)} | {per('val_bpb', '.4f')} "
                     f"| {per('moe_val_bpb', '.4f')} | {_ms([r['gap'] for r in rows])} | {per('compression', '.2f')} "
                     f"| {statistics.fmean(r['near_half'] for r in rows):.1%} |")
    (dest / "table.md").write_text("\n".join(lines) + "\n")
    (dest / "summary.json").write_text(json.dumps({"base": str(base), "models": list(cells.values())}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
