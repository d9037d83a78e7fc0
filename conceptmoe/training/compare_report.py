"""The comparison's report: verdict lines, ``report.md`` and the plots (``curves.png``: val BPB
against training tokens and wall-clock; ``p_hist.png``: the routers' boundary probabilities).

``compare.build_report`` makes the report dict; this module only renders it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def verdict(rows: list[dict]) -> list[str]:
    """One line per ConceptMoE: does it reach the baseline's BPB, is compression within 10% of R?"""
    base = rows[0]
    lines = []
    for r in rows[1:]:
        wins = r["val_bpb"] <= base["val_bpb"]
        within = abs(r["compression"] - r["ratio"]) <= 0.1 * r["ratio"]
        lines.append(f"{r['label']} ({r['name']}): val BPB {r['val_bpb']:.4f} vs MoE {base['val_bpb']:.4f} "
                     f"({'<=' if wins else '>'} baseline, {r['val_bpb'] - base['val_bpb']:+.4f}); "
                     f"compression {r['compression']:.2f} vs R={r['ratio']:g} "
                     f"({'within' if within else 'outside'} 10%)")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    head = (f"# MoE vs ConceptMoE ({s['preset']} preset)\n\n"
            f"Data: {s['data'] or 'Shakespeare (held-out plays: see conceptmoe/training/data.py)'}; "
            f"{s['tokens']:,} training tokens per model; batch {s['batch_size']} x {s['seq_len']}; "
            f"lr {s['lr']:g}; seeds {', '.join(map(str, s['seeds']))}.\n"
            f"FLOPs are analytic (conceptmoe/model/flops.py) at the target R and, next to them, at the "
            f"realised compression (what the model actually spent); attention-map FLOPs at "
            f"sequence length {report['seq_len']}. Compression is realized tokens/concept on the "
            f"held-out text.\n\n")
    table = ["| run | model | seeds | val BPB (mean ± sd) | val loss | compression | activated MFLOPs/token "
             "at R | at realised compression | total params | attn-map MFLOPs/token | train tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        table.append(f"| {r['label']} | {r['name']} | {len(r.get('seeds', [0]))} | {r['val_bpb']:.4f} ± {r['val_bpb_std']:.4f} "
                     f"| {r['val_loss']:.4f} | {r['compression']:.2f} | {r['activated_flops_per_token'] / 1e6:.2f} "
                     f"| {r['activated_flops_per_token_realised'] / 1e6:.2f} "
                     f"| {r['total_params'] / 1e6:.2f}M | {r['attention_map_flops_per_token'] / 1e6:.3f} "
                     f"| {r['train_tokens_per_s']:.0f} |")
    verdict_md = "\n".join(f"- {line}" for line in report["verdict"])
    router = ["| run | p in [0.4, 0.6) | p < 0.1 or p >= 0.9 | p >= 0.5 |", "|---|---|---|---|"]
    router += [f"| {r['label']} | {r['p_near_half']:.1%} | {r['p_decisive']:.1%} | {r['p_above_half']:.1%} |"
               for r in report["models"] if "p_histogram" in r]
    router_md = ("\n\n## Router decisiveness\n\nBoundary probability p on held-out text (first seed; "
                 "a window's first position left out): the share near the 0.5 threshold, the share "
                 "decided firmly, and the share that becomes a boundary.\n\n" + "\n".join(router)
                 + "\n\n![boundary probability histograms](p_hist.png)" if len(router) > 2 else "")
    return (head + "\n".join(table) + "\n\n## Verdict\n\n" + verdict_md + "\n\n![validation curves](curves.png)"
            + router_md + "\n")


def plot_curves(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120, sharey=True)
    for r in report["models"]:
        if r["curve"]:
            t, b = zip(*r["curve"])
            label = f"{r['label']} ({r['name']}, {len(r.get('seeds', [0]))} seed(s))"
            ax.plot([x / 1e6 for x in t], b, marker="o", ms=3, label=label)
        if r.get("curve_seconds"):
            sec, b = zip(*r["curve_seconds"])
            ax_t.plot([x / 60 for x in sec], b, marker="o", ms=3)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation bits per byte (held-out slice)")
    ax_t.set_xlabel("training wall-clock (minutes, validation excluded)")
    ax.set_title("MoE vs compute-matched ConceptMoE")
    for a in (ax, ax_t):
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_p_histograms(report: dict[str, Any], path: Path) -> None:
    """Density of the boundary probability p per ConceptMoE (first seed, held-out text)."""
    rows = [r for r in report["models"] if "p_histogram" in r]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in rows:
        hist = r["p_histogram"]
        k, n = len(hist), max(sum(hist), 1)
        ax.step([i / k for i in range(k + 1)], [c / n * k for c in hist] + [hist[-1] / n * k], where="post",
                label=r["label"])
    ax.axvline(0.5, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("boundary probability p (held-out text)")
    ax.set_ylabel("density")
    ax.set_yscale("log")
    ax.set_title("How decisive is the chunk router?")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
