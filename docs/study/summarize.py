"""Collect the MoE-versus-ConceptMoE study (docs/study/report.md) from its `conceptmoe compare` runs.

    python docs/study/summarize.py runs/study/b300k runs/study/b1.2M

For each comparison directory (one token budget each) this copies report.md, report.json,
curves.png and p_hist.png into docs/study/<name>/, and writes docs/study/report.json (per budget:
every model's mean and spread, and the per-seed paired gap ConceptMoE - MoE, the two models of
a seed having seen the same batches) and docs/study/gap.png (the gap against the budget).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _budget(report: dict) -> dict:
    rows = {r["label"]: r for r in report["models"]}
    base = rows["moe"]
    base_by_seed = dict(zip(base["seeds"], base["val_bpb_seeds"]))
    models = []
    for label, r in rows.items():
        gaps = [b - base_by_seed[s] for s, b in zip(r["seeds"], r["val_bpb_seeds"])]
        models.append({
            "label": label, "name": r["name"], "seeds": r["seeds"], "val_bpb": r["val_bpb"],
            "val_bpb_std": r["val_bpb_std"], "val_bpb_seeds": r["val_bpb_seeds"],
            "gap_vs_moe": statistics.fmean(gaps), "gap_vs_moe_std": statistics.stdev(gaps) if len(gaps) > 1 else None,
            "gap_vs_moe_seeds": gaps, "compression": r["compression"],
            "activated_mflops_per_token": r["activated_flops_per_token"] / 1e6,
            "activated_mflops_per_token_realised": r["activated_flops_per_token_realised"] / 1e6,
            "attention_map_mflops_per_token": r["attention_map_flops_per_token"] / 1e6,
            "total_params_m": r["total_params"] / 1e6, "train_tokens_per_s": r["train_tokens_per_s"],
            **{k: r[k] for k in ("p_near_half", "p_decisive", "p_above_half") if k in r}})
    return {"tokens": report["settings"]["tokens"], "seq_len": report["seq_len"], "models": models}


def main(dirs: list[str]) -> None:
    budgets = {}
    for d in map(Path, dirs):
        report = json.loads((d / "report.json").read_text())
        dest = HERE / d.name
        dest.mkdir(exist_ok=True)
        for f in ("report.md", "report.json", "curves.png", "p_hist.png"):
            if (d / f).is_file():
                shutil.copyfile(d / f, dest / f)
        budgets[d.name] = _budget(report)
    (HERE / "report.json").write_text(json.dumps({"budgets": budgets}, indent=2, allow_nan=False) + "\n")
    _plot_gap(budgets, HERE / "gap.png")


def _plot_gap(budgets: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    series: dict[str, list[tuple[int, float, float]]] = {}
    for b in budgets.values():
        for m in b["models"]:
            if m["label"] != "moe" and len(m["seeds"]) > 1:
                series.setdefault(m["label"], []).append((b["tokens"], m["gap_vs_moe"], m["gap_vs_moe_std"]))
    for label, pts in series.items():
        pts.sort()
        ax.errorbar([t / 1e6 for t, _, _ in pts], [g for _, g, _ in pts], yerr=[s for _, _, s in pts],
                    marker="o", capsize=4, label=label)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per model (millions)")
    ax.set_ylabel("val BPB, ConceptMoE - MoE (paired by seed)")
    ax.set_title("Gap to the MoE (mean ± sd over seeds; < 0: ConceptMoE better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python docs/study/summarize.py COMPARE_DIR [COMPARE_DIR ...]")
    main(sys.argv[1:])
