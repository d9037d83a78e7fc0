"""The quality-vs-compute frontier of elastic and fixed-R runs (issue 21; CONCEPTMOE.md §3, §5).

``frontier(runs, ratios)``: for each run and each requested R it can serve (an elastic run: every
R in its trained range; a fixed-R ConceptMoE: its own R; a MoE: R = 1), the held-out validation
at that R (``evaluation/evaluate.py``) and the compute it costs at the *realised* compression:
activated FLOPs per token and K/V-cache bytes per token (total and concept layers), from
``model/flops.py`` (fp32 bytes, as the model is stored). Compute matching happens at one design
ratio (``--ratio`` of training, ``design_ratio`` in each row): at other R the activated FLOPs
differ, which is the point of the frontier. The ratio embedding itself costs a few vector
additions per sequence and is not counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import files
from ..errors import UserError
from ..model.elastic import check_ratio
from ..model.flops import count_flops
from ..training.checkpoint import model_config_of, read_run_config
from .evaluate import evaluate

DTYPE_BYTES = 4  # the K/V bytes of an fp32 model


def _ratios_for(cfg, ratios: list[float]) -> list[float | None]:
    """The requested ratios this run serves (None: its one fixed R, or a MoE's 1)."""
    if not cfg.is_concept or cfg.elastic_ratios is None:
        return [None]
    served = [r for r in ratios if check_ratio(cfg, [r]) is None]
    if not served:
        lo, hi = cfg.elastic_ratios[0], cfg.elastic_ratios[-1]
        raise UserError(f"none of the ratios {', '.join(f'{r:g}' for r in ratios)} is in the trained range "
                        f"[{lo:g}, {hi:g}] of this run")
    return served


def frontier(runs: list[str], ratios: list[float], device: str = "auto",
             val_tokens: int | None = None) -> list[dict[str, Any]]:
    """One row per (run, R): requested and realised compression, val BPB, FLOPs and KV bytes."""
    rows = []
    for run in runs:
        run_cfg = read_run_config(run)
        cfg = model_config_of(run_cfg)
        seq_len = int(run_cfg.get("train", {}).get("seq_len", 256))
        for r in _ratios_for(cfg, ratios):
            ev = evaluate(run, device=device, max_tokens=val_tokens, ratio=r)
            realised = ev["compression"] if cfg.is_concept else 1.0
            fl = count_flops(cfg, seq_len, compression=realised, dtype_bytes=DTYPE_BYTES)
            concept_kv = (2 * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES * cfg.n_concept_layers
                          * cfg.concept_loops / realised) if cfg.is_concept else 0.0
            rows.append({
                "run": str(run), "name": cfg.name, "elastic": cfg.elastic_ratios is not None,
                "design_ratio": cfg.compression_ratio if cfg.is_concept else 1.0,
                "ratio": r if r is not None else (cfg.compression_ratio if cfg.is_concept else 1.0),
                "compression": realised, "val_bpb": ev["val_bpb"], "val_loss": ev["val_loss"],
                "tokens": ev["tokens"], "activated_flops_per_token": fl["activated_flops_per_token"],
                "kv_bytes_per_token": fl["kv_cache_bytes_per_token"], "concept_kv_bytes_per_token": concept_kv,
            })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<28} {'R asked':>7} {'R real':>7} {'val_bpb':>8} {'MFLOPs/tok':>10} "
            f"{'KV B/tok':>9} {'concept KV B/tok':>16}")
    timed = all("decode_ms_per_token" in r for r in rows)
    lines = [head + (f" {'prefill s':>9} {'decode ms/tok':>13}" if timed else "")]
    for r in rows:
        lines.append(f"{Path(r['run']).name[:28]:<28} {r['ratio']:>7g} {r['compression']:>7.2f} {r['val_bpb']:>8.4f} "
                     f"{r['activated_flops_per_token'] / 1e6:>10.3f} {r['kv_bytes_per_token']:>9.0f} "
                     f"{r['concept_kv_bytes_per_token']:>16.0f}"
                     + (f" {r['prefill_s']:>9.4f} {r['decode_ms_per_token']:>13.3f}" if timed else ""))
    design = sorted({f"{r['design_ratio']:g}" for r in rows if r['elastic']})
    if design:
        lines.append(f"(elastic runs compute-matched at design R = {', '.join(design)}; FLOPs at the realised R)")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str | Path) -> None:
    """val BPB against activated FLOPs/token (and against decode latency when timed), one line
    per run, points labelled with the realised R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [("activated_flops_per_token", 1e-6, "activated MFLOPs per token (at the realised compression)")]
    if all("decode_ms_per_token" in r for r in rows):
        axes.append(("decode_ms_per_token", 1.0, "decode latency, ms per token (this machine)"))
    fig, panels = plt.subplots(1, len(axes), figsize=(6.5 * len(axes), 4.5), dpi=120, squeeze=False)
    for ax, (key, scale, label) in zip(panels[0], axes):
        for run in dict.fromkeys(r["run"] for r in rows):
            mine = sorted((r for r in rows if r["run"] == run), key=lambda r: r[key])
            xs, ys = [r[key] * scale for r in mine], [r["val_bpb"] for r in mine]
            ax.plot(xs, ys, marker="o", label=f"{Path(run).name} ({mine[0]['name']})")
            for r, x, y in zip(mine, xs, ys):
                ax.annotate(f"R={r['compression']:.2f}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel("validation bits per byte")
        ax.set_title("Quality vs compute: one elastic model, several budgets")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with files.replacing(Path(path)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
