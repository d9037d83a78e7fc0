"""Table, JSON and bar chart (in the style of the paper's Figure 5) for ``latency.run_latency``.

``latency.json`` holds ``settings``, ``models`` (name, kind, strategy, target compression,
whether the router was calibrated, parameters, activated FLOPs/token, config), ``prefill``
and ``decode`` rows (per model and length: ``median_s`` and all ``times_s``, ``speedup_pct``
against the MoE baseline, realised ``compression``, ``kv_bytes`` measured from the caches and
``kv_bytes_analytic`` from ``flops.count_flops``, attention-map FLOPs), and ``kv_check``: per
ConceptMoE model the measured KV bytes relative to the MoE next to the analytic figure
(token-rate layers + concept layers x loops / R) / MoE layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import replacing, write_text


def kv_check(result: dict) -> list[dict]:
    """Measured vs analytic KV-cache size of each ConceptMoE relative to the MoE (prefill rows)."""
    base = result["models"][0]
    rows = result["prefill"] or result["decode"]
    length_key = "tokens" if result["prefill"] else "kv_len"
    by = {(r["model"], r[length_key]): r for r in rows}
    out = []
    for m in result["models"][1:]:
        cfg = m["config"]
        if cfg["kind"] != "conceptmoe":
            continue
        token_layers = cfg["n_encoder_layers"] + cfg["n_decoder_layers"]
        concept = cfg["n_layers"] - token_layers
        analytic = (token_layers + concept * cfg["concept_loops"] / m["target_compression"]) / base["config"]["n_layers"]
        for (name, L), r in by.items():
            if name != m["name"]:
                continue
            measured = r["kv_bytes"] / by[(base["name"], L)]["kv_bytes"]
            out.append({"model": name, length_key: L, "kv_ratio_vs_moe": measured,
                        "kv_ratio_analytic": analytic, "rel_error": measured / analytic - 1})
    return out


def format_table(result: dict) -> str:
    lines = []
    if "peak_gflops" in result:
        lines.append(f"{result.get('dtype', 'fp32')}, {result['threads']} threads; MFU against the measured "
                     f"matmul peak ({result['peak_gflops']:.0f} GFLOP/s)")
    for phase, key, unit in (("prefill", "tokens", "s"), ("decode", "kv_len", "ms/step")):
        rows = result.get(phase) or []
        if not rows:
            continue
        scale = 1e3 if phase == "decode" else 1.0
        head = f"{phase} ({unit})"
        lines.append(f"{head:<14} {'length':>7}  {'model':<30} {'median':>10} {'speedup':>9} "
                     f"{'R':>5} {'KV MiB':>9} {'attn GFLOP':>11} {'GFLOP/s':>8} {'MFU':>6}")
        for r in rows:
            flops = r.get("attention_map_flops", r.get("attention_map_flops_per_token", 0))
            lines.append(f"{'':<14} {r[key]:>7}  {r['model']:<30} {r['median_s'] * scale:>10.4f} "
                         f"{r['speedup_pct']:>+8.1f}% {r['compression']:>5.2f} "
                         f"{r['kv_bytes'] / 2**20:>9.1f} {flops / 1e9:>11.3f} "
                         f"{r.get('gflops_per_s', float('nan')):>8.1f} {r.get('mfu', float('nan')):>6.1%}")
        lines.append("")
    for c in result.get("kv_check", []):
        L = c.get("tokens", c.get("kv_len"))
        lines.append(f"KV cache vs MoE  {c['model']:<30} L={L:<6} measured {c['kv_ratio_vs_moe']:.3f}  "
                     f"analytic {c['kv_ratio_analytic']:.3f}  ({c['rel_error']:+.1%})")
    return "\n".join(lines).rstrip() + "\n"


def plot_latency(result: dict, path: str | Path) -> Path:
    """Grouped bars of speedup % vs MoE per length: prefill left, decode right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(p, k) for p, k in (("prefill", "tokens"), ("decode", "kv_len")) if result.get(p)]
    fig, axes = plt.subplots(1, max(1, len(phases)), figsize=(6.5 * max(1, len(phases)), 4.2),
                             squeeze=False)
    names = [m["name"] for m in result["models"][1:]]
    for ax, (phase, key) in zip(axes[0], phases):
        rows = result[phase]
        lengths = sorted({r[key] for r in rows})
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            vals = [next((r["speedup_pct"] for r in rows if r["model"] == name and r[key] == L), 0.0)
                    for L in lengths]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(lengths))]
            bars = ax.bar(xs, vals, width, label=name)
            ax.bar_label(bars, labels=[f"{v:+.0f}%" for v in vals], fontsize=7, padding=2)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_xlabel("prompt tokens" if phase == "prefill" else "cached tokens (KV length)")
        ax.set_ylabel(f"{phase} speedup vs {result['models'][0]['name']} (%)")
        batch = rows[0]["batch"]
        ax.set_title(f"{phase.capitalize()} latency (batch {batch})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(labels) - 1) // 4), 1, 1))
    path = Path(path)
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write latency.json and latency.png into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["kv_check"] = kv_check(result)
    js = out / "latency.json"
    write_text(js, json.dumps(result, indent=2, allow_nan=False) + "\n")
    return {"json": js, "plot": plot_latency(result, out / "latency.png")}
