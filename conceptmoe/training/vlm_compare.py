"""MoE vs compute-matched ConceptMoE on the vision-language digits task (CONCEPTMOE.md §3, §5).

``compare_vlm(cc, models)`` is what ``compare`` runs for ``data="vlm-digits"``: the same plan
(the preset's MoE baseline and each matched ConceptMoE, ``compare.plan``) and seeds, every run an
ordinary run directory ``out/<label>/seed<k>`` trained by ``train`` (vlm_train.py); a finished
run with the same model and training settings is reused. The report (``report.json``,
``report.md``) gives, per model, the held-out text loss and answer accuracy (mean ± sd over
seeds), the accuracy of each answer field, the realised compression over all, image and text
positions, and the analytic FLOPs (patch embedding included) and parameters.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..model.flops import count_flops
from . import checkpoint as ck
from .config import TrainConfig, model_config, trained_as
from .lock import RunLock
from .train import train

METRICS = ("val_loss", "answer_accuracy", "digits_accuracy", "sum_accuracy", "max_accuracy",
           "compression", "compression_image", "compression_text")


def _done(run: Path, tc: TrainConfig) -> bool:
    """The run finished with exactly these model and training settings."""
    if not (run / "eval.json").is_file():
        return False
    return trained_as(ck.read_run_config(run), tc)


def compare_vlm(cc, models: list[tuple[str, TrainConfig]]) -> Path:
    out = Path(cc.out)
    if not model_config(models[0][1]).image_size:
        raise UserError("--data vlm-digits needs an image model: --preset vlm")
    for _, tc in models:
        model_config(tc)  # every model must build (and match) before anything is trained
    with RunLock(out):
        for label, tc in models:
            for seed in cc.seeds_for(label):
                run = out / label / f"seed{seed}"
                want = dataclasses.replace(tc, seed=seed, out=str(run), force=True)
                if _done(run, want):
                    continue
                print(f"== {label} seed {seed} -> {run}", flush=True)
                train(want)
        report = build_vlm_report(cc, models)
        ck.write_json(out / "report.json", report)
        (out / "report.md").write_text(render_vlm_markdown(report))
    return out


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def build_vlm_report(cc, models: list[tuple[str, TrainConfig]]) -> dict[str, Any]:
    rows = []
    for label, tc in models:
        mc = model_config(tc)
        evals = [json.loads((Path(cc.out) / label / f"seed{s}" / "eval.json").read_text()) for s in cc.seeds_for(label)]
        metrics = [ck.read_metrics(Path(cc.out) / label / f"seed{s}") for s in cc.seeds_for(label)]
        row = {"label": label, "name": mc.name, "ratio": tc.ratio if mc.is_concept else 1.0}
        for m in METRICS:
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
            f"batch {s['batch_size']}; lr {s['lr']:g}; seeds {', '.join(map(str, s['seeds']))}. Evaluation: "
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
