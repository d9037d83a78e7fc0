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
    (HERE / "tables.md").write_text(tables(budgets))


def _seed0(m: dict, key: str = "val_bpb_seeds") -> float:
    return m[key][m["seeds"].index(0)]


def tables(budgets: dict) -> str:
    """The study's tables in markdown: multi-seed rows per budget, then every variant at seed 0."""
    out = ["## Multi-seed rows\n", "| budget | run | model | seeds | val BPB mean ± sd | gap to MoE (paired) mean ± sd "
           "| per-seed gaps | compression | MFLOPs/token at R / realised | attn-map MFLOPs/token | train tokens/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in budgets.items():
        for m in b["models"]:
            if len(m["seeds"]) < 2:
                continue
            gap = "" if m["label"] == "moe" else f"{m['gap_vs_moe']:+.4f} ± {m['gap_vs_moe_std']:.4f}"
            per = "" if m["label"] == "moe" else " / ".join(f"{g:+.3f}" for g in m["gap_vs_moe_seeds"])
            out.append(f"| {b['tokens'] / 1e6:g}M | {m['label']} | {m['name']} | {len(m['seeds'])} "
                       f"| {m['val_bpb']:.4f} ± {m['val_bpb_std']:.4f} | {gap} | {per} | {m['compression']:.2f} "
                       f"| {m['activated_mflops_per_token']:.2f} / {m['activated_mflops_per_token_realised']:.2f} "
                       f"| {m['attention_map_mflops_per_token']:.3f} | {m['train_tokens_per_s']:.0f} |")
    for name, b in budgets.items():
        rows = {m["label"]: m for m in b["models"]}
        if "topk-R2" not in rows or len(rows) <= 3:
            continue
        base = _seed0(rows["topk-R2"])
        out += [f"\n## Every variant at {b['tokens'] / 1e6:g}M tokens, seed 0\n",
                "| run | model | val BPB | vs MoE | vs topk-R2 | compression | p in [0.4, 0.6) | p < 0.1 or ≥ 0.9 "
                "| train tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
        for m in b["models"]:
            if 0 not in m["seeds"]:
                continue
            v = _seed0(m)
            p = (f"{m['p_near_half']:.0%} | {m['p_decisive']:.1%}" if "p_near_half" in m else "– | –")
            vs_moe = "" if m["label"] == "moe" else f"{_seed0(m, 'gap_vs_moe_seeds'):+.4f}"
            out.append(f"| {m['label']} | {m['name']} | {v:.4f} | {vs_moe} | {v - base:+.4f} | {m['compression']:.2f} "
                       f"| {p} | {m['train_tokens_per_s']:.0f} |")
    return "\n".join(out) + "\n"


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
    ax.set_title("Gap to the MoE (mean ± sd over seeds; < 0: ConceptMoE better)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python docs/study/summarize.py COMPARE_DIR [COMPARE_DIR ...]")
    main(sys.argv[1:])
