"""MoE versus compute-matched ConceptMoE on the same data (CONCEPTMOE.md §3 and §5).

``compare(CompareConfig) -> Path`` trains, with one shared tokenizer, data, token budget and
seed list: the preset's MoE baseline; for every (strategy, R) the ConceptMoE that
``match_config`` matches to it in activated FLOPs/token and total parameters; and, with
``ablations``, variants of the first matched model (linear router, fixed-size chunking, no
joint decoding, no boundary noise). Each model and seed is an ordinary run directory under
``out/<label>/seed<k>``; rerunning the same comparison skips finished runs and resumes
interrupted ones. It then writes ``report.json``, ``report.md`` and ``curves.png``
(validation BPB against training tokens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..files import replacing, write_text
from ..model.config import ModelConfig
from ..model.flops import count_flops
from ..training import checkpoint as ck
from ..training.config import MAX_RATIO, MOE_IGNORED, STRATEGIES, TrainConfig, model_config, resolve_data, trained_as
from ..data.corpus import load_corpus
from ..lock import RunLock, holds_only_lock
from ..data.shards import is_prepared, open_prepared
from ..data.tokenizer import save_tokenizer, train_tokenizer
from ..training.jobs import TrainJob, check_jobs, train_runs
from ..training.recipe import render_compare
from .compare_report import (build_vlm_report, data_epochs, plot_curves, plot_p_histograms,  # noqa: F401 (re-exported)
                             render_markdown, render_vlm_markdown, verdict)
from ..data.digits import VLM_DATA

DEFAULT_COMPARE_TOKENS = 300_000  # x 3 seeds x 2 models: ~20-30 min on 2 CPU cores (docs/study)
DEFAULT_COMPARE_SEEDS = (0, 1, 2)  # a gap counts only beyond the spread over seeds
ABLATIONS = {  # label suffix -> ModelConfig overrides
    "linear-router": {"chunk_router": "linear"},
    "fixed-chunks": {"chunk_router": "fixed"},
    "no-joint": {"joint_decoding": False},
    "no-noise": {"boundary_noise": False},
}


@dataclass
class CompareConfig:
    preset: str = "small"
    strategies: list[str] = field(default_factory=lambda: ["topk"])
    ratios: list[float] = field(default_factory=lambda: [2.0])
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_COMPARE_SEEDS))
    tokens: int = DEFAULT_COMPARE_TOKENS
    ablations: bool = False
    data: str | None = None
    out: str | None = None  # None: runs/compare-<preset>
    batch_size: int = 8
    seq_len: int = 256
    lr: float | None = None  # None: each model's default (training/config.py DEFAULT_LR)
    device: str = "auto"
    dtype: str | None = None  # None: each run's default (train.py: bf16 on CUDA / AMX CPUs, else fp32)
    overrides: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> VARIANT_KEYS (--variants FILE)
    force: bool = False
    jobs: int = 1  # runs trained at once (training/jobs.py); not a setting of the comparison
    log: str | None = None  # --log of every run (training/config.py LOG_MODES); not a setting either
    experts_multiple_of: int = 1  # the ConceptMoEs' concept experts a multiple of this (model/match.py)

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise UserError(f"--strategies must list some of {', '.join(STRATEGIES)} (got {self.strategies})")
        if not self.ratios or any(not r > 1 for r in self.ratios):
            raise UserError(f"--ratios must be values > 1 (got {self.ratios})")
        if len(set(self.ratios)) != len(self.ratios):  # each would be trained twice
            raise UserError(f"--ratios: each ratio once (got {', '.join(f'{r:g}' for r in self.ratios)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"--seeds must be distinct integers (got {self.seeds})")
        if self.tokens < 1:
            raise UserError("--tokens must be positive")
        check_jobs(self.jobs)
        if self.dtype not in (None, "fp32", "bf16"):
            raise UserError(f"--dtype must be fp32 or bf16 (got {self.dtype})")
        self.out = self.out or f"runs/compare-{self.preset}"
        self.data = resolve_data(self.data)
        for label, spec in self.variants.items():
            _check_variant(label, spec, self.seeds)

    def seeds_for(self, label: str) -> list[int]:
        """The seeds ``label`` is trained with: a variant may name a subset of ``seeds``."""
        return list(self.variants.get(label, {}).get("seeds", self.seeds))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("force")
        d.pop("jobs")
        d.pop("log")
        if d["experts_multiple_of"] == 1:  # a comparison's record stays as it was before the flag
            del d["experts_multiple_of"]
        return d


VARIANT_KEYS = ("strategy", "ratio", "set", "lr", "chunk_lr_mult", "seeds")


def _no_duplicate_labels(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last one silently)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise KeyError(twice[0])
    return dict(pairs)


def load_variants(path: str) -> dict[str, dict[str, Any]]:
    """Read a ``--variants`` file: a JSON object ``{label: {strategy, ratio, set, lr, chunk_lr_mult, seeds}}``."""
    try:
        variants = json.loads(Path(path).read_text(), object_pairs_hook=_no_duplicate_labels)
    except OSError as e:
        raise UserError(f"--variants {path}: cannot read ({e.strerror})") from None
    except KeyError as e:  # json.loads would keep the last of the two silently
        raise UserError(f"--variants {path}: the label (or key) {e.args[0]!r} is given twice; give each once") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--variants {path}: not valid JSON ({e})") from None
    if not isinstance(variants, dict) or not variants:
        raise UserError(f"--variants {path}: expected a non-empty JSON object of label -> settings")
    return variants


def _check_variant(label: str, spec: Any, seeds: list[int]) -> None:
    where = f"variant {label!r}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", label) or label == "moe":
        raise UserError(f"{where}: a label is letters, digits, '.', '_', '+', '-' (and not 'moe')")
    if not isinstance(spec, dict):
        raise UserError(f"{where}: expected an object with keys among {', '.join(VARIANT_KEYS)}")
    unknown = sorted(set(spec) - set(VARIANT_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(VARIANT_KEYS)}")
    if spec.get("strategy", "topk") not in STRATEGIES:
        raise UserError(f"{where}: strategy must be one of {', '.join(STRATEGIES)}")
    ratio = spec.get("ratio", 2.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 < ratio <= MAX_RATIO:
        raise UserError(f"{where}: ratio must be a number in (1, {MAX_RATIO}]")
    if not isinstance(spec.get("set", {}), dict):
        raise UserError(f"{where}: set must be an object of ModelConfig fields")
    lr = spec.get("lr", 1.0)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise UserError(f"{where}: lr must be a number > 0")
    mult = spec.get("chunk_lr_mult", 1.0)
    if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not 0 <= mult < float("inf"):
        raise UserError(f"{where}: chunk_lr_mult must be a number >= 0")
    sub = spec.get("seeds", seeds)
    if not isinstance(sub, list) or not sub or any(s not in seeds for s in sub):
        raise UserError(f"{where}: seeds must be a non-empty subset of --seeds {seeds}")


def plan(cc: CompareConfig) -> list[tuple[str, TrainConfig]]:
    """(label, TrainConfig for seed 0) of every model in the comparison, baseline first."""
    common = dict(preset=cc.preset, overrides=cc.overrides, data=cc.data, tokens=cc.tokens,
                  batch_size=cc.batch_size, seq_len=cc.seq_len, lr=cc.lr, device=cc.device, dtype=cc.dtype)
    # ConceptMoE-only knobs (ratio_loss_weight, the stage split, ablations) leave the baseline alone.
    moe_over = {k: v for k, v in cc.overrides.items() if k not in MOE_IGNORED}
    matched = {"experts_multiple_of": cc.experts_multiple_of}  # the ConceptMoEs' constraint (not the MoE's)
    models = [("moe", TrainConfig(model="moe", **{**common, "overrides": moe_over}))]
    for r in cc.ratios:
        for s in cc.strategies:
            models.append((f"{s}-R{r:g}", TrainConfig(strategy=s, ratio=r, **common, **matched)))
    if cc.ablations:
        label, first = models[1]
        for suffix, over in ABLATIONS.items():
            tc = dataclasses.replace(first, overrides={**cc.overrides, **over})
            models.append((f"{label}-{suffix}", tc))
    for label, spec in cc.variants.items():
        if label in dict(models):
            raise UserError(f"variant {label!r}: the comparison already has a model with that label")
        tc = TrainConfig(strategy=spec.get("strategy", "topk"), ratio=float(spec.get("ratio", 2.0)),
                         chunk_lr_mult=float(spec.get("chunk_lr_mult", 1.0)), **matched,
                         **{**common, "lr": spec.get("lr", cc.lr),
                            "overrides": {**cc.overrides, **spec.get("set", {})}})
        models.append((label, tc))
    return models


def compare(cc: CompareConfig) -> Path:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("compare runs in one process; under torchrun, train each model with `conceptmoe train` "
                        "(the same --seed, --data and --tokens) and compare the runs' eval.json")
    out = Path(cc.out)
    models = plan(cc)
    if cc.data == VLM_DATA:  # the image-text digits task: its own metrics and report
        return _compare_vlm(cc, models)
    for _, tc in models:
        model_config(tc)  # every model must build (and match) before anything is trained
    prep = open_prepared(cc.data) if is_prepared(cc.data) else None  # token shards bring their tokenizer
    corpus = None if prep else load_corpus(cc.data)
    with RunLock(out):
        tok_path = _claim(out, cc, models)
        write_text(out / "recipe.toml", render_compare(cc.to_dict(), models))  # compare --config reruns it
        if not tok_path.is_file() and prep:
            save_tokenizer(prep.tokenizer(), tok_path)
        elif not tok_path.is_file():
            vocab = ModelConfig.from_preset(cc.preset, **{**cc.overrides, "kind": "moe"}).vocab_size
            save_tokenizer(train_tokenizer([d.text for d in corpus.train], vocab), tok_path)
        todo = []
        for label, tc in models:
            for seed in cc.seeds_for(label):
                run = out / label / f"seed{seed}"
                if (run / "eval.json").is_file():
                    continue  # finished earlier with the same settings (checked by _claim)
                resume = ck.latest_checkpoint(run) is not None  # else: (re)start, ours to replace
                todo.append(TrainJob(f"{label} seed {seed}", _run_config(tc, seed, run, tok_path, resume,
                                                                         force=not resume, log=cc.log),
                                     out / "logs" / f"{label}-seed{seed}.log"))
        train_runs(todo, cc.jobs)
        report = build_report(cc, models)
        with replacing(out / "curves.png") as curves, replacing(out / "p_hist.png") as hist:
            plot_curves(report, curves)
            plot_p_histograms(report, hist)
        write_text(out / "report.md", render_markdown(report))
        ck.write_json(out / "report.json", report)  # each file replaced whole; report.json last
    return out


def _vlm_done(run: Path, tc: TrainConfig) -> bool:
    """The run finished with exactly these model and training settings."""
    if not (run / "eval.json").is_file():
        return False
    return trained_as(ck.read_run_config(run), tc)


def _compare_vlm(cc, models: list[tuple[str, TrainConfig]]) -> Path:
    """The digits task: the same plan and seeds; a finished run with the same settings is reused."""
    out = Path(cc.out)
    if not model_config(models[0][1]).image_size:
        raise UserError("--data vlm-digits needs an image model: --preset vlm")
    for _, tc in models:
        model_config(tc)  # every model must build (and match) before anything is trained
    with RunLock(out):
        write_text(out / "recipe.toml", render_compare(cc.to_dict(), models))
        todo = []
        for label, tc in models:
            for seed in cc.seeds_for(label):
                run = out / label / f"seed{seed}"
                want = dataclasses.replace(tc, seed=seed, out=str(run), force=True)
                if not _vlm_done(run, want):
                    todo.append(TrainJob(f"{label} seed {seed}", want, out / "logs" / f"{label}-seed{seed}.log"))
        train_runs(todo, cc.jobs)
        report = build_vlm_report(cc, models)
        write_text(out / "report.md", render_vlm_markdown(report))
        ck.write_json(out / "report.json", report)
    return out


def _run_config(tc: TrainConfig, seed: int, run: Path, tok_path: Path, resume: bool = False,
                force: bool = False, log: str | None = None) -> TrainConfig:
    return dataclasses.replace(tc, seed=seed, out=str(run), tokenizer=str(tok_path), resume=resume, force=force,
                               log=log)


def _claim(out: Path, cc: CompareConfig, models: list[tuple[str, TrainConfig]]) -> Path:
    """Check what ``out`` already holds; returns the shared tokenizer path.

    Runs trained with exactly the settings asked for are reused (finished) or resumed; runs with
    other settings are an error unless ``force``, which retrains just those. A different corpus
    or vocabulary invalidates the shared tokenizer, hence every run.
    """
    meta_path, tok_path = out / "compare.json", out / "tokenizer.json"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if not meta_path.is_file() and out.is_dir() and not holds_only_lock(out) and not cc.force:
        raise UserError(f"{out} is not empty and holds no comparison; choose another --out or pass --force")
    vocab = ModelConfig.from_preset(cc.preset, **{**cc.overrides, "kind": "moe"}).vocab_size
    tok_key = {"data": cc.data, "vocab_size": vocab}
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    stale_tok = old.get("tokenizer") not in (None, tok_key)
    conflicts = []
    for label, tc in models:
        for seed in cc.seeds_for(label):
            run = out / label / f"seed{seed}"
            if not ck.is_run(run):
                continue
            stored = ck.read_run_config(run)
            if stale_tok or not trained_as(stored, _run_config(tc, seed, run, tok_path)):
                conflicts.append(run)
            elif cc.dtype and stored.get("precision") not in (None, cc.dtype):  # None: recorded before precision was
                conflicts.append(run)
    if conflicts and not cc.force:
        names = ", ".join(str(r.relative_to(out)) for r in conflicts[:4])
        was = (f"; it was made with --lr {old['lr']:g}, the default learning rate now depends on the "
               f"model: pass --lr {old['lr']:g} to continue it" if cc.lr is None and old.get("lr") else "")
        raise UserError(f"{out} holds runs trained with different settings ({names}); "
                        f"use another --out, or --force to retrain them{was}")
    for run in conflicts:
        ck.remove_run(run)
    if stale_tok:
        tok_path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ck.write_json(meta_path, {**cc.to_dict(), "tokenizer": tok_key})
    return tok_path


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def build_report(cc: CompareConfig, models: list[tuple[str, TrainConfig]]) -> dict[str, Any]:
    rows, datas = [], []
    for label, tc in models:
        mc = model_config(tc)
        runs = [Path(cc.out) / label / f"seed{s}" for s in cc.seeds_for(label)]
        evals = [json.loads((r / "eval.json").read_text()) for r in runs]
        metrics = [ck.read_metrics(r) for r in runs]
        bpb, bpb_sd = _mean_std([e["val_bpb"] for e in evals])
        comp = statistics.fmean(e["compression"] for e in evals)
        tps = statistics.fmean(statistics.fmean(m["tokens_per_s"] for m in ms[min(10, len(ms) - 1):])
                               for ms in metrics)
        fl = count_flops(mc, cc.seq_len)
        fl_real = count_flops(mc, cc.seq_len, compression=max(comp, 1.0))  # concept layers at L/realised
        curve = _mean_curve(metrics)
        curve_time = _mean_time_curve(metrics)
        p_hist = _p_histogram(runs[0], evals[0]) if mc.is_concept else None
        stored = [ck.read_run_config(r) for r in runs]
        data = data_epochs(stored[0].get("data") or {}, metrics)
        datas.append(data)
        rows.append({"label": label, "name": mc.name, "strategy": tc.strategy, "ratio": tc.ratio if mc.is_concept else 1.0,
                     "val_bpb": bpb, "val_bpb_std": bpb_sd, "val_bpb_seeds": [e["val_bpb"] for e in evals],
                     "val_loss": statistics.fmean(e["val_loss"] for e in evals), "compression": comp,
                     "activated_flops_per_token": fl["activated_flops_per_token"],
                     "activated_flops_per_token_realised": fl_real["activated_flops_per_token"],
                     "total_params": fl["total_params"],
                     "attention_map_flops_per_token": fl["attention_map_flops_per_token"],
                     "train_tokens_per_s": tps, "curve": curve, "curve_seconds": curve_time,
                     "seeds": cc.seeds_for(label), "lr": tc.lr, "chunk_lr_mult": tc.chunk_lr_mult, "config": mc.to_dict(),
                     "epochs": data["epochs"], "precision": [c.get("precision") for c in stored],
                     **(decisiveness(p_hist) if p_hist else {})})
    return {"settings": cc.to_dict(), "seq_len": cc.seq_len, "data": datas[0], "models": rows,  # the baseline's
            "verdict": verdict(rows)}


HIST_TOKENS = 65_536  # held-out tokens for the boundary-probability histogram of runs that lack one


def _p_histogram(run: Path, ev: dict[str, Any]) -> list[int]:
    """The first seed's boundary-probability histogram on held-out text (from eval.json, or
    computed on the first HIST_TOKENS held-out tokens for runs trained before it was recorded)."""
    if "p_histogram" in ev:
        return ev["p_histogram"]
    from .evaluate import evaluate

    return evaluate(run, max_tokens=HIST_TOKENS)["p_histogram"]


def decisiveness(hist: list[int]) -> dict[str, Any]:
    """How far the router's p stays from the 0.5 threshold (bins of width 1/len(hist))."""
    n, k = sum(hist), len(hist)
    share = lambda lo, hi: sum(c for i, c in enumerate(hist) if lo <= i / k and (i + 1) / k <= hi) / max(n, 1)
    return {"p_histogram": hist, "p_near_half": share(0.4, 0.6), "p_decisive": share(0.0, 0.1) + share(0.9, 1.0),
            "p_above_half": share(0.5, 1.0)}


def _mean_curve(metrics: list[list[dict]]) -> list[tuple[int, float]]:
    """(tokens, mean val BPB over seeds) at each validation step all seeds share."""
    per_seed = [{m["tokens"]: m["val_bpb"] for m in ms if "val_bpb" in m} for ms in metrics]
    common = sorted(set.intersection(*(set(d) for d in per_seed))) if per_seed else []
    return [(t, statistics.fmean(d[t] for d in per_seed)) for t in common]


def _train_seconds(ms: list[dict]) -> dict[int, float]:
    """Training wall-clock (validation excluded) at each logged step: the sum of step times."""
    seconds, total, prev = {}, 0.0, 0
    for m in ms:
        if "tokens_per_s" in m and m["tokens_per_s"] > 0:
            total += (m["tokens"] - prev) / m["tokens_per_s"]
            prev = m["tokens"]
        if "val_bpb" in m:
            seconds[m["tokens"]] = total
    return seconds


def _mean_time_curve(metrics: list[list[dict]]) -> list[tuple[float, float]]:
    """(mean training seconds, mean val BPB over seeds) at each validation step all seeds share."""
    times = [_train_seconds(ms) for ms in metrics]
    return [(statistics.fmean(ts.get(t, 0.0) for ts in times), b) for t, b in _mean_curve(metrics)]
