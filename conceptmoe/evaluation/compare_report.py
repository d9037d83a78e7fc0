"""The comparison's report: verdict lines, ``report.md`` and the plots (``curves.png``: val BPB
against training tokens and wall-clock; ``p_hist.png``: the routers' boundary probabilities).

``compare.build_report`` makes a text comparison's report dict; this module renders it, with
the epochs of the training data each budget used (``data_epochs``: a figure past
``MAX_HEADLINE_EPOCHS`` repeats its data and is flagged). On the
vision-language digits task (``--data vlm-digits``) the report is built here too
(``build_vlm_report``): per model, the held-out text loss and answer accuracy (mean ± sd over
seeds), the accuracy of each answer field, the realised compression over all, image and text
positions, and the analytic FLOPs (patch embedding included) and parameters.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..model.flops import count_flops
from ..training import checkpoint as ck
from ..training.config import DEFAULT_LR, TrainConfig, model_config

MAX_HEADLINE_EPOCHS = 2.0  # beyond this many passes over the training data a figure is not a headline


def data_epochs(record: dict, metrics: list[list[dict]]) -> dict[str, Any]:
    """The training data (a run's config.json ``data`` record) and the epochs of it that runs with
    these ``metrics`` trained: tokens trained (mean over seeds) / the data's training tokens.
    ``epochs`` is None for runs whose record predates token counts."""
    trained = [max((m["tokens"] for m in ms if "tokens" in m), default=0) for ms in metrics]
    tokens = statistics.fmean(trained) if trained else 0.0
    have = record.get("train_tokens")
    keep = ("source", "sha256", "train_tokens", "val_tokens", "recipe")
    return {**{k: record[k] for k in keep if k in record}, "tokens_trained": tokens,
            "epochs": tokens / have if have else None}


def data_line(data: dict[str, Any]) -> str:
    """report.md's line on the training data: its size and the epochs of it each model trained."""
    if data.get("epochs") is None:
        return "Training data: epochs unknown (the runs' config.json predates token counts).\n"
    recipe = data.get("recipe")
    made = f", {recipe['version']}, fingerprint {recipe['sha256'][:12]}" if recipe else ""
    warn = (f" More than {MAX_HEADLINE_EPOCHS:g} epochs: the models saw the same text repeatedly; not a "
            f"headline figure." if data["epochs"] > MAX_HEADLINE_EPOCHS else "")
    return (f"Training data: {data['train_tokens']:,} tokens ({data.get('source')}{made}); each model trained "
            f"{data['tokens_trained']:,.0f} tokens = **{data['epochs']:.2f} epochs** of it.{warn}\n")


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


def lr_text(lr: float | None) -> str:
    """The comparison's learning rate: one for all, or (None) each model's default."""
    if lr is not None:
        return f"lr {lr:g}"
    return "lr: each model's default (" + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")"


def precision_line(models: list[dict[str, Any]]) -> str:
    """How the runs were computed (config.json ``precision``: bf16 autocast or fp32; "bf16,fp32" when a
    resumed run was switched), one line; a mix is spelled out per run, since it is a confound."""
    runs = [(m["label"], s, p) for m in models for s, p in zip(m.get("seeds", [0]), m.get("precision", []))]
    kinds = {p for *_, p in runs}
    if not runs or kinds == {None}:
        return ""
    if len(kinds) == 1:
        return f"Precision: {runs[0][2]} for every run.\n"
    each = ", ".join(f"{label} seed {s}: {p or 'not recorded'}" for label, s, p in runs)
    return f"Precision differs between runs ({each}): compare the models within one precision.\n"


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    head = (f"# MoE vs ConceptMoE ({s['preset']} preset)\n\n"
            f"Data: {s['data'] or 'Shakespeare (held-out plays: see conceptmoe/data/corpus.py)'}; "
            f"{s['tokens']:,} training tokens per model; batch {s['batch_size']} x {s['seq_len']}; "
            f"{lr_text(s['lr'])}; seeds {', '.join(map(str, s['seeds']))}.\n"
            f"FLOPs are analytic (conceptmoe/model/flops.py) at the target R and, next to them, at the "
            f"realised compression (what the model actually spent); attention-map FLOPs at "
            f"sequence length {report['seq_len']}. Compression is realized tokens/concept on the "
            f"held-out text.\n" + (data_line(report["data"]) if "data" in report else "")
            + precision_line(report["models"]) + "\n")
    table = ["| run | model | seeds | val BPB (mean ± sd) | val loss | compression | activated MFLOPs/token "
             "at R | at realised compression | total params | attn-map MFLOPs/token | train tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        own_lr = f" (lr {r['lr']:g})" if r.get("lr", s["lr"]) != s["lr"] else ""  # a variant's own, or per model
        table.append(f"| {r['label']} | {r['name']}{own_lr} | {len(r.get('seeds', [0]))} | {r['val_bpb']:.4f} ± {r['val_bpb_std']:.4f} "
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


VLM_METRICS = ("val_loss", "answer_accuracy", "digits_accuracy", "sum_accuracy", "max_accuracy",
           "compression", "compression_image", "compression_text")


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def build_vlm_report(cc, models: list[tuple[str, TrainConfig]]) -> dict[str, Any]:
    rows = []
    for label, tc in models:
        mc = model_config(tc)
        evals = [json.loads((Path(cc.out) / label / f"seed{s}" / "eval.json").read_text()) for s in cc.seeds_for(label)]
        metrics = [ck.read_metrics(Path(cc.out) / label / f"seed{s}") for s in cc.seeds_for(label)]
        row = {"label": label, "name": mc.name, "ratio": tc.ratio if mc.is_concept else 1.0}
        for m in VLM_METRICS:
            row[m], row[f"{m}_std"] = _mean_sd([e[m] for e in evals])
            row[f"{m}_seeds"] = [e[m] for e in evals]
        fl = count_flops(mc, cc.seq_len)
        row.update(activated_flops_per_token=fl["activated_flops_per_token"], total_params=fl["total_params"],
                   train_tokens_per_s=statistics.fmean(statistics.fmean(r["tokens_per_s"] for r in ms[5:] or ms)
                                                       for ms in metrics),
                   config=mc.to_dict())
        rows.append(row)
    return {"settings": cc.to_dict(), "models": rows, "held_out_examples": evals[0]["examples"]}


def render_vlm_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    head = (f"# MoE vs ConceptMoE on vlm-digits ({s['preset']} preset)\n\n"
            f"{s['tokens']:,} training positions per model (images and text, packed rows of {s['seq_len']}); "
            f"batch {s['batch_size']}; {lr_text(s['lr'])}; seeds {', '.join(map(str, s['seeds']))}. Evaluation: "
            f"{report['held_out_examples']} examples built from held-out images only. Text loss: mean "
            f"cross-entropy over the text positions after the images; answer accuracy: greedy cached "
            f"generation after \"the digits are\" reproduces the whole answer. Compression: realised "
            f"tokens per concept (a concept counts in its boundary token's modality).\n\n")
    table = ["| run | model | held-out text loss | answer acc. | digits | sum | larger | compression all "
             "| image | text | activated MFLOPs/token | params |", "|---|" * 12]
    table[1] = "|---" * 12 + "|"
    for r in report["models"]:
        table.append(f"| {r['label']} | {r['name']} | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} "
                      f"| {r['answer_accuracy']:.3f} ± {r['answer_accuracy_std']:.3f} | {r['digits_accuracy']:.3f} "
                      f"| {r['sum_accuracy']:.3f} | {r['max_accuracy']:.3f} | {r['compression']:.2f} "
                      f"| {r['compression_image']:.2f} | {r['compression_text']:.2f} "
                      f"| {r['activated_flops_per_token'] / 1e6:.3f} | {r['total_params'] / 1e6:.2f}M |")
    return head + "\n".join(table) + "\n"
