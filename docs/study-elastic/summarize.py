"""Summarise the elastic-ratio study (docs/study-elastic/README.md) from `conceptmoe frontier --json`.

    python docs/study-elastic/summarize.py runs/study21/frontier.json [runs/study21/frontier-anneal.json ...]

Run directories are named KIND-sSEED (elastic-router-s0, fixed-R2-s1, moe-s0, ...). Writes, next to
this script: summary.json (per kind and R: mean and sd over seeds of val BPB, realised compression,
activated MFLOPs/token, decode latency; the paired gaps elastic - fixed-R specialist, per seed),
table.md (the same as markdown) and frontier.png (val BPB against MFLOPs/token and, when the rows
were timed with --latency, against decode ms/token; means over seeds).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _kind_seed(run: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.+)-s(\d+)", Path(run).name)
    if not m:
        raise SystemExit(f"error: run directory {run} is not named KIND-sSEED")
    return m.group(1), int(m.group(2))


def _parts(kind: str) -> tuple[str, str]:
    """KIND -> (prefix, base): "anneal-fixed-R2" -> ("anneal-", "fixed"), "elastic-router" ->
    ("", "elastic-router"), "moe" -> ("", "moe"); a prefix names a setting whose runs pair up."""
    m = re.fullmatch(r"(.*?)(moe|fixed-R[0-9.]+|elastic-.+)", kind)
    if not m:
        raise SystemExit(f"error: run kind {kind} is not moe, fixed-R<R> or elastic-<embedding>")
    base = "fixed" if m.group(2).startswith("fixed-R") else m.group(2)
    return m.group(1), base


def _ms(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def collect(rows: list[dict]) -> dict:
    by = defaultdict(dict)  # (kind, R) -> seed -> row
    for r in rows:
        kind, seed = _kind_seed(r["run"])
        by[(kind, round(r["ratio"], 4))][seed] = r
    cells = []
    for (kind, R), seeds in sorted(by.items()):
        rs = [seeds[s] for s in sorted(seeds)]
        cell = {"kind": kind, "ratio": R, "seeds": sorted(seeds), "name": rs[0]["name"],
                "val_bpb_seeds": [r["val_bpb"] for r in rs]}
        for key, out in (("val_bpb", "val_bpb"), ("compression", "compression"),
                         ("activated_flops_per_token", "mflops_per_token"),
                         ("decode_ms_per_token", "decode_ms_per_token"), ("prefill_s", "prefill_s"),
                         ("concept_kv_bytes_per_token", "concept_kv_bytes_per_token")):
            if all(key in r for r in rs):
                scale = 1e-6 if key == "activated_flops_per_token" else 1.0
                cell[out], cell[out + "_sd"] = _ms([r[key] * scale for r in rs])
        prefix, base = _parts(kind)  # an elastic run pairs with the specialists of its own setting
        fixed = by.get((f"{prefix}fixed-R{R:g}", R))
        if base.startswith("elastic") and fixed:  # paired by seed: the same batches in the same order
            gaps = [seeds[s]["val_bpb"] - fixed[s]["val_bpb"] for s in sorted(seeds) if s in fixed]
            if gaps:
                cell["gap_vs_fixed"], cell["gap_vs_fixed_sd"] = _ms(gaps)
                cell["gap_vs_fixed_seeds"] = gaps
        cells.append(cell)
    return {"cells": cells}


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def table(summary: dict) -> str:
    lines = ["| model | R | seeds | val BPB mean ± sd | per seed | elastic − fixed-R (paired) | realised R | "
             "MFLOPs/token | decode ms/token | concept-KV B/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {"moe": 0, "fixed": 1, "elastic-router": 2, "elastic-shift": 3}
    key = lambda c: (c["ratio"], _parts(c["kind"])[0], order.get(_parts(c["kind"])[1], 9), c["kind"])  # noqa: E731
    cells = sorted(summary["cells"], key=key)
    for c in cells:
        gap = ""
        if "gap_vs_fixed" in c:
            gap = f"{c['gap_vs_fixed']:+.4f}" + (f" ± {c['gap_vs_fixed_sd']:.4f}" if c["gap_vs_fixed_sd"] else "")
            gap += " (" + " / ".join(f"{g:+.3f}" for g in c["gap_vs_fixed_seeds"]) + ")"
        sd = f" ± {c['val_bpb_sd']:.4f}" if c.get("val_bpb_sd") else ""
        lines.append(f"| {c['kind']} | {c['ratio']:g} | {len(c['seeds'])} | {c['val_bpb']:.4f}{sd} | "
                     f"{' / '.join(f'{b:.4f}' for b in c['val_bpb_seeds'])} | {gap} | {c['compression']:.2f} | "
                     f"{c['mflops_per_token']:.2f} | {_f(c.get('decode_ms_per_token'), '.2f')} | "
                     f"{_f(c.get('concept_kv_bytes_per_token'), '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = all("decode_ms_per_token" in c for c in summary["cells"])
    xs = [("mflops_per_token", "activated MFLOPs/token (at the realised R)")]
    if timed:
        xs.append(("decode_ms_per_token", "decode ms/token (2-core CPU)"))
    fig, axes = plt.subplots(1, len(xs), figsize=(6 * len(xs), 4.2), squeeze=False)
    groups = defaultdict(list)
    for c in summary["cells"]:
        prefix, base = _parts(c["kind"])
        groups[prefix + "fixed-R specialists" if base == "fixed" else c["kind"]].append(c)
    style = {"moe": ("k", "s"), "fixed-R specialists": ("tab:blue", "o"), "elastic-router": ("tab:red", "^"),
             "elastic-shift": ("tab:gray", "v"), "anneal-fixed-R specialists": ("tab:cyan", "o"),
             "anneal-elastic-router": ("tab:orange", "^")}
    for ax, (key, label) in zip(axes[0], xs):
        for g, cs in sorted(groups.items()):
            cs = sorted(cs, key=lambda c: c["ratio"])
            color, marker = style.get(g, ("tab:green", "d"))
            ax.errorbar([c[key] for c in cs], [c["val_bpb"] for c in cs], yerr=[c.get("val_bpb_sd") or 0 for c in cs],
                        color=color, marker=marker, label=g, capsize=3, linestyle="-" if len(cs) > 1 else "none")
            for c in cs:
                if c["kind"] != "moe":
                    ax.annotate(f"{c['ratio']:g}→{c['compression']:.1f}", (c[key], c["val_bpb"]), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel("val BPB (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("one elastic ConceptMoE vs fixed-R specialists (small preset; labels: requested R → realised R)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    rows = [r for a in argv for r in json.loads(Path(a).read_text())]
    summary = collect(rows)
    (HERE / "frontier.json").write_text(json.dumps(rows, indent=1) + "\n")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (HERE / "table.md").write_text(table(summary))
    plot(summary, HERE / "frontier.png")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
