"""Continual-training comparison: converted ConceptMoEs vs continuing the MoE (issue 10 C, CONCEPTMOE.md §5).

``continual_compare(CTConfig) -> Path`` takes a trained or imported MoE run and, on the same data,
tokenizer (the MoE's), token budget and seed, trains from its weights (``train --init``):

- ``moe``: the MoE itself, continued (the fair CT baseline: it sees the same extra tokens);
- for every R in ``ratios``: ``R<r>-topk``, the conversion compute-matched by more activated
  experts in the concept layers (``convert --strategy topk``), and ``R<r>-loop2``, the conversion
  whose concept layers run twice (``convert --loops 2``, the source's top-k: at R = 2 about the
  MoE's FLOPs, at R = 1.5 more; the table says how much).

Before the first CT step every model is validated on the same held-out slice as the periodic
validations (``val_bpb_start``: what the switch costs); the curve then follows CT from there.
Layout: ``out/converted/<label>`` (the converted runs), ``out/<label>`` (the CT runs),
``report.json``, ``report.md``, ``curves.png``. Rerunning with the same settings reuses finished
runs and resumes interrupted ones, also when ratios or variants are added or left out (the runs of
the models both have are kept); other settings need ``force``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import replacing, write_text
from ..model.flops import count_flops
from ..training import checkpoint as ck
from ..training.config import TrainConfig
from ..training.recipe import render
from ..data.corpus import DOC_SEP, load_corpus
from ..training.validation import evaluate_tokens
from ..lock import RunLock, holds_only_lock
from ..data.tokenizer import byte_lengths, encode_documents, load_tokenizer
from ..training.jobs import TrainJob, check_jobs, train_runs
from ..interop.convert import convert_run, parse_split
from .compare_report import precision_line

VARIANTS = {"topk": dict(strategy="topk"), "loop2": dict(loops=2)}


@dataclass
class CTConfig:
    init: str  # the MoE run to start from
    ratios: list[float] = field(default_factory=lambda: [1.5, 2.0])
    variants: list[str] = field(default_factory=lambda: ["topk", "loop2"])
    tokens: int = 262_144  # CT tokens per model
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    chunk_lr_mult: float = 1.0
    eval_every: int | None = None  # None: 4 validations per run
    val_tokens: int = 32_768  # held-out tokens of every validation (start, curve, final)
    device: str = "auto"
    dtype: str | None = None  # None: each run's default (train.py); recorded per run in config.json
    overrides: dict[str, Any] = field(default_factory=dict)  # --set for the converted models
    split: str | None = None  # "E+C+D" of the conversions (convert --split); None: convert's default
    out: str | None = None  # None: runs/ct-<init run name>
    force: bool = False
    progress: bool = True
    jobs: int = 1  # runs trained at once (training/jobs.py)
    log: str | None = None  # --log of every run (training/config.py LOG_MODES)

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise UserError(f"CT variants must be some of {', '.join(VARIANTS)} (got {self.variants})")
        if not self.ratios or any(not r > 1 for r in self.ratios):
            raise UserError(f"--ratios must be values > 1 (got {self.ratios})")
        if self.tokens < 1:
            raise UserError("--tokens must be positive")
        check_jobs(self.jobs)
        self.init = str(Path(self.init).resolve())
        source = ck.model_config_of(ck.read_run_config(self.init))
        if source.is_concept:
            raise UserError(f"{self.init} is a ConceptMoE; the CT comparison starts from a MoE run")
        # checked and canonical; the default written out, so that a changed default cannot make a
        # resumed comparison mix layouts (before 2026-12 the default was 1 + (n-2) + 1)
        self.split = "+".join(map(str, parse_split(self.split, source.n_layers)))
        self.out = self.out or f"runs/ct-{Path(self.init).name}"
        if self.eval_every is None:
            self.eval_every = max(1, -(-self.tokens // (self.batch_size * self.seq_len)) // 4)

    def recipe(self) -> dict[str, Any]:
        """The comparison as `compare --config` reads it (flag names; [set] for the overrides)."""
        strategies = {"topk": "topk", "loop2": "loop"}
        d = {"init": self.init, "strategies": [strategies[v] for v in self.variants], "seeds": [self.seed],
             "ratios": self.ratios, "tokens": self.tokens, "batch_size": self.batch_size, "seq_len": self.seq_len,
             "lr": self.lr, "chunk_lr_mult": self.chunk_lr_mult, "split": self.split, "device": self.device}
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.overrides:
            d["set"] = dict(self.overrides)
        return d

    def recipe_text(self) -> str:
        return render(self.recipe(), ["conceptmoe compare --init recipe; rerun: conceptmoe compare --config FILE "
                                      "--out NEW"])

    def settings(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for transient in ("force", "progress", "device", "dtype", "out", "jobs", "log"):
            d.pop(transient)
        return d


def plan(cc: CTConfig) -> list[tuple[str, dict[str, Any] | None]]:
    """(label, convert kwargs; None for the continued MoE), baseline first."""
    models: list[tuple[str, dict[str, Any] | None]] = [("moe", None)]
    for r in cc.ratios:
        for v in cc.variants:
            models.append((f"R{r:g}-{v}", {"ratio": float(r), "split": cc.split, "overrides": cc.overrides,
                                           **VARIANTS[v]}))
    return models


def _per_run(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings every run of a CT comparison is trained with (not which models it has)."""
    return {k: v for k, v in settings.items() if k not in ("ratios", "variants")}


def _claim(out: Path, cc: CTConfig) -> None:
    meta = out / "ct.json"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if meta.is_file():
        old = json.loads(meta.read_text())
        if "split" not in old:  # made before --split existed: convert's default then
            old["split"] = f"1+{ck.model_config_of(ck.read_run_config(cc.init)).n_layers - 2}+1"
        # Which models run (ratios, variants) does not change how any one of them is trained: a
        # label both comparisons have keeps its finished or interrupted run; anything else is new.
        if _per_run(old) != _per_run(cc.settings()):
            if not cc.force:
                raise UserError(f"{out} holds a CT comparison with other settings; use another --out or --force")
            for label, _ in plan(cc):
                for run in (out / label, out / "converted" / label):
                    if ck.is_run(run):
                        ck.remove_run(run)
    elif out.is_dir() and not holds_only_lock(out) and not cc.force:
        raise UserError(f"{out} is not empty and holds no CT comparison; choose another --out or pass --force")
    out.mkdir(parents=True, exist_ok=True)
    ck.write_json(meta, cc.settings())


def continual_compare(cc: CTConfig) -> Path:
    out = Path(cc.out)
    src_cfg = ck.read_run_config(cc.init)
    data = (src_cfg.get("train") or {}).get("data")
    with RunLock(out):
        _claim(out, cc)
        write_text(out / "recipe.toml", cc.recipe_text())  # compare --config reruns it
        inits, todo = {}, []
        for label, conv in plan(cc):
            init = Path(cc.init)
            if conv is not None:
                init = out / "converted" / label
                if not ck.is_run(init):
                    convert_run(cc.init, init, seed=cc.seed, **conv)
            inits[label] = init
            run = out / label
            if not (run / "eval.json").is_file():
                resume = ck.latest_checkpoint(run) is not None
                tc = TrainConfig(init=str(init), data=data, out=str(run), tokens=cc.tokens, seed=cc.seed,
                                 batch_size=cc.batch_size, seq_len=cc.seq_len, lr=cc.lr,
                                 chunk_lr_mult=cc.chunk_lr_mult, eval_every=cc.eval_every, device=cc.device,
                                 dtype=cc.dtype, eval_tokens=cc.val_tokens, val_tokens=cc.val_tokens,
                                 resume=resume, force=not resume, progress=cc.progress, log=cc.log)
                todo.append(TrainJob(f"CT {label}", tc, out / "logs" / f"{label}.log"))
        train_runs(todo, cc.jobs)
        starts = {label: _start_bpb(init, out / label) for label, init in inits.items()}
        report = build_report(cc, starts)
        with replacing(out / "curves.png") as curves:
            plot_curves(report, curves)
        write_text(out / "report.md", render_markdown(report))
        ck.write_json(out / "report.json", report)  # each file replaced whole; report.json last
    return out


def _start_bpb(init: Path, run: Path) -> dict[str, float]:
    """Validation of the starting weights on the slice the CT run validates on (before step 1)."""
    model, cfg, tok, _ = ck.load_run(init, "cpu")
    tc = ck.read_run_config(run)["train"]
    corpus = load_corpus(tc.get("data"))
    val_ids = encode_documents(load_tokenizer(run / "tokenizer.json"), [d.text for d in corpus.val], DOC_SEP)
    res = evaluate_tokens(model, val_ids, byte_lengths(tok, cfg.vocab_size), tc["seq_len"],
                          max_tokens=tc["eval_tokens"])
    return {"val_bpb": res["val_bpb"], "compression": res["compression"]}


def build_report(cc: CTConfig, starts: dict[str, dict[str, float]]) -> dict[str, Any]:
    rows = []
    for label, _ in plan(cc):
        run = Path(cc.out) / label
        stored = ck.read_run_config(run)
        cfg = ck.model_config_of(stored)
        ev = json.loads((run / "eval.json").read_text())
        metrics = ck.read_metrics(run)
        curve = [(0, starts[label]["val_bpb"])] + [(m["tokens"], m["val_bpb"]) for m in metrics if "val_bpb" in m]
        fl = count_flops(cfg, cc.seq_len)
        fl_real = count_flops(cfg, cc.seq_len, compression=max(ev["compression"], 1.0))
        tps = statistics.fmean(m["tokens_per_s"] for m in metrics[min(5, len(metrics) - 1):])
        rows.append({"label": label, "name": cfg.name, "val_bpb": ev["val_bpb"], "val_loss": ev["val_loss"],
                     "compression": ev["compression"], "ratio": cfg.compression_ratio if cfg.is_concept else 1.0,
                     "val_bpb_start": starts[label]["val_bpb"], "compression_start": starts[label]["compression"],
                     "train_bpb_first_steps": [round(m["bpb"], 4) for m in metrics[:5]],
                     "train_curve": [(m["tokens"], m["bpb"]) for m in metrics],
                     "activated_flops_per_token": fl["activated_flops_per_token"],
                     "activated_flops_per_token_realised": fl_real["activated_flops_per_token"],
                     "total_params": fl["total_params"], "train_tokens_per_s": tps, "curve": curve,
                     "config": cfg.to_dict(), "seeds": [cc.seed], "precision": [stored.get("precision")]})
    base = rows[0]
    for r in rows:
        r["recovered_at_tokens"] = next((t for t, b in r["curve"] if b <= base["val_bpb_start"]), None)
    return {"settings": cc.settings(), "init": cc.init, "models": rows}


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    split = s.get("split") or "convert's default of the time"
    head = (f"# Continual training from {report['init']}\n\n"
            f"{s['tokens']:,} CT tokens per model; batch {s['batch_size']} x {s['seq_len']}; lr {s['lr']:g} "
            f"(fresh AdamW, warmup + cosine); chunk-lr-mult {s['chunk_lr_mult']:g}; seed {s['seed']}; "
            f"conversions split {split}. "
            f"'start' is the held-out BPB of the weights before the first CT step (the switch); "
            f"'back at' is the first CT token count whose held-out BPB is at or below the MoE's start.\n"
            + precision_line(report["models"]) + "\n")
    table = ["| run | model | val BPB | start BPB | back at (tokens) | compression (start -> end) | "
             "activated MFLOPs/token at R | at realised | total params | train tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        back = "-" if r["recovered_at_tokens"] is None else f"{r['recovered_at_tokens']:,}"
        table.append(f"| {r['label']} | {r['name']} | {r['val_bpb']:.4f} | {r['val_bpb_start']:.4f} | {back} "
                     f"| {r['compression_start']:.2f} -> {r['compression']:.2f} "
                     f"| {r['activated_flops_per_token'] / 1e6:.2f} | {r['activated_flops_per_token_realised'] / 1e6:.2f} "
                     f"| {r['total_params'] / 1e6:.2f}M | {r['train_tokens_per_s']:.0f} |")
    return head + "\n".join(table) + "\n\n![CT curves](curves.png)\n"


def plot_curves(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, tx) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for r in report["models"]:
        t, b = zip(*r["curve"])
        ax.plot([x / 1e6 for x in t], b, marker="o", ms=3, label=f"{r['label']} ({r['name']})")
        t, b = zip(*r["train_curve"])
        tx.plot([x / 1e6 for x in t], b, lw=1, label=r["label"])
    ax.set_xlabel("continual-training tokens (millions; 0 = the converted weights)")
    ax.set_ylabel("validation bits per byte (held-out slice)")
    ax.set_title("Continual training: converted ConceptMoE vs continued MoE")
    tx.set_xlabel("continual-training tokens (millions)")
    tx.set_ylabel("training bits per byte (each step's batch)")
    tx.set_title("Training loss from the first CT step")
    for a in (ax, tx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
