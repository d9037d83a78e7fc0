"""Collect round 2 of the MoE-versus-ConceptMoE study (issue 22) from `conceptmoe compare` outputs.

    python docs/study/round2/summarize.py BUDGET_NAME runs/study22/r1.2M-s0 runs/study22/r1.2M-s1 ...
    python docs/study/round2/summarize.py BUDGET_NAME --keep docs/study/round2/BUDGET_NAME/summary.json NEWDIR

--keep SUMMARY.json carries the per-seed rows of an earlier summary over (runs whose directories are
gone: a fresh machine keeps only the repository); a seed that is also in a directory is read anew.

Each directory is one `compare` (one or more seeds, the same budget, data and variants); they are
merged by model label and paired by seed (a seed fixes the initialisation and the batch order, so
the MoE and the ConceptMoEs of a seed saw the same batches). Writes docs/study/round2/BUDGET_NAME/:
summary.json, table.md (val BPB, paired gap to the MoE, realised compression against R, the router's
decisiveness: the share of held-out boundary probabilities outside [0.1, 0.9) and inside
[0.4, 0.6), the learned router temperature where there is one, the precision each run was computed in:
config.json `precision`) and p_hist.png; plus each
comparison's report.md / report.json / curves.png / p_hist.png under SEEDDIR/.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from conceptmoe.evaluation.compare import decisiveness

HERE = Path(__file__).resolve().parent


def _ms(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _shares(hist: list[int]) -> dict[str, float]:
    d = decisiveness(hist)
    return {"decisive": d["p_decisive"], "near_half": d["p_near_half"]}


def _temperature(run: Path) -> float | None:
    from safetensors import safe_open

    with safe_open(str(run / "model.safetensors"), "pt") as f:
        return float(f.get_tensor("chunk.log_scale").exp()) if "chunk.log_scale" in f.keys() else None


def collect(dirs: list[Path], keep: list[dict] = ()) -> dict:
    models: dict[str, dict] = {}
    settings = None
    for old in keep:
        settings = settings or old["settings"]
        for m in old["models"]:
            cell = models.setdefault(m["label"], {k: m[k] for k in ("label", "name", "ratio", "set")} | {"per_seed": {}})
            cell["per_seed"].update({int(s): row for s, row in m["per_seed"].items()})
    for d in dirs:
        rep = json.loads((d / "report.json").read_text())
        settings = settings or {k: rep["settings"][k] for k in ("preset", "data", "tokens", "batch_size", "lr")}
        for m in rep["models"]:
            cell = models.setdefault(m["label"], {"label": m["label"], "name": m["name"], "ratio": m["ratio"],
                                                  "set": m.get("config", {}), "per_seed": {}})
            precision = dict(zip(m["seeds"], m.get("precision", [])))  # reports from before the record: none
            for s, bpb in zip(m["seeds"], m["val_bpb_seeds"]):
                run = d / m["label"] / f"seed{s}"
                ev = json.loads((run / "eval.json").read_text())
                row = {"val_bpb": bpb, "compression": ev.get("compression", 1.0),
                       "train_tokens_per_s": m["train_tokens_per_s"], "epochs": m.get("epochs"),
                       "precision": precision.get(s)}
                if "p_histogram" in ev:
                    row.update(_shares(ev["p_histogram"]), p_histogram=ev["p_histogram"])
                    row["temperature"] = _temperature(run)
                cell["per_seed"][s] = row
    base = models["moe"]["per_seed"]
    for cell in models.values():
        seeds = sorted(cell["per_seed"])
        rows = [cell["per_seed"][s] for s in seeds]
        cell["seeds"] = seeds
        cell["val_bpb"], cell["val_bpb_sd"] = _ms([r["val_bpb"] for r in rows])
        cell["compression"] = statistics.fmean(r["compression"] for r in rows)
        cell["epochs"] = rows[0]["epochs"]
        cell["precision"] = sorted({r.get("precision") or "not recorded" for r in rows})
        gaps = [cell["per_seed"][s]["val_bpb"] - base[s]["val_bpb"] for s in seeds if s in base]
        if cell["label"] != "moe" and gaps:
            cell["gap_vs_moe"], cell["gap_vs_moe_sd"] = _ms(gaps)
            cell["gap_vs_moe_seeds"] = gaps
        if "decisive" in rows[0]:
            cell["decisive"] = statistics.fmean(r["decisive"] for r in rows)
            cell["near_half"] = statistics.fmean(r["near_half"] for r in rows)
            temps = [r["temperature"] for r in rows if r["temperature"] is not None]
            cell["temperature"] = statistics.fmean(temps) if temps else None
    return {"settings": settings, "models": list(models.values())}


def table(summary: dict) -> str:
    lines = ["| run | model | seeds | val BPB mean ± sd | gap to MoE (paired) mean ± sd | per-seed gaps | gap / sd | "
             "realised R (vs R) | p outside [0.1, 0.9) | p in [0.4, 0.6) | learned exp(a) | epochs | precision |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["models"]:
        sd = f" ± {c['val_bpb_sd']:.4f}" if c["val_bpb_sd"] else ""
        gap = per = z = ""
        if "gap_vs_moe" in c:
            gsd = c["gap_vs_moe_sd"]
            gap = f"{c['gap_vs_moe']:+.4f}" + (f" ± {gsd:.4f}" if gsd else "")
            per = " / ".join(f"{g:+.3f}" for g in c["gap_vs_moe_seeds"])
            z = f"{c['gap_vs_moe'] / gsd:+.1f}" if gsd else ""
        comp = f"{c['compression']:.2f}" + (f" ({(c['compression'] / c['ratio'] - 1):+.0%})" if c["ratio"] > 1 else "")
        dec = f"{c['decisive']:.1%}" if "decisive" in c else ""
        near = f"{c['near_half']:.1%}" if "near_half" in c else ""
        temp = f"{c['temperature']:.2f}" if c.get("temperature") else ""
        ep = f"{c['epochs']:.2f}" if c.get("epochs") is not None else ""
        prec = ", ".join(c.get("precision", []))
        lines.append(f"| {c['label']} | {c['name']} | {len(c['seeds'])} | {c['val_bpb']:.4f}{sd} | {gap} | {per} | {z} | "
                     f"{comp} | {dec} | {near} | {temp} | {ep} | {prec} |")
    return "\n".join(lines) + "\n"


def plot_hist(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in summary["models"] if "decisive" in c]
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cells:
        hists = [r["p_histogram"] for r in c["per_seed"].values()]
        tot = [sum(h[i] for h in hists) for i in range(len(hists[0]))]
        n, k = sum(tot), len(tot)
        ax.step([(i + 0.5) / k for i in range(k)], [t / n for t in tot], where="mid", label=c["label"])
    ax.axvspan(0.1, 0.9, color="0.9", zorder=0)
    ax.set_xlabel("boundary probability p on held-out text (shaded: not decisive)")
    ax.set_ylabel("share of positions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    name, rest, keep = argv[0], argv[1:], []
    while rest[:1] == ["--keep"]:
        if len(rest) < 2 or not Path(rest[1]).is_file():
            print(f"error: --keep needs an existing summary.json, got {rest[1] if len(rest) > 1 else 'nothing'}", file=sys.stderr)
            return 2
        keep.append(json.loads(Path(rest[1]).read_text()))
        rest = rest[2:]
    dirs = [Path(a) for a in rest]
    out = HERE / name
    out.mkdir(parents=True, exist_ok=True)
    summary = collect(dirs, keep)
    for d in dirs:
        (out / d.name).mkdir(exist_ok=True)
        for f in ("report.md", "report.json", "curves.png", "p_hist.png"):
            if (d / f).is_file():
                shutil.copyfile(d / f, out / d.name / f)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (out / "table.md").write_text(table(summary))
    plot_hist(summary, out / "p_hist.png")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
