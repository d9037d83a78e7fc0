"""Training: ``train(TrainConfig) -> Path`` (the pipeline behind CONCEPTMOE.md §5's comparison).

AdamW (no weight decay on norms, embeddings and the chunk router), linear warmup then cosine
decay to ``min_lr_ratio * lr``, gradient clipping, a tqdm bar with loss, bits per byte,
realized compression and tokens/s, one ``metrics.jsonl`` row per step, periodic validation on
a fixed slice of the held-out text, and crash-safe checkpoints (checkpoint.py). With the same
seed on CPU a run killed at any moment and resumed equals an uninterrupted one step for step:
the checkpoint holds weights, optimizer, RNG (boundary noise draws from the global torch RNG)
and the data position, and rows logged after the checkpoint are dropped on resume.

The model is ``ModelConfig.from_preset(preset)`` of the requested kind; with ``strategy`` it is
the ConceptMoE that ``match_config`` compute-matches to the preset's MoE baseline (§3).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from . import checkpoint as ck
from .config import ModelConfig
from .data import DOC_SEP, BatchSampler, load_corpus
from .errors import UserError
from .evaluate import evaluate_tokens
from .model import build_model
from .tokenizer import byte_lengths, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer

DEFAULT_TOKENS = 1_600_000  # `conceptmoe train` with no flags: ~10-12 min on 2 CPU cores
STRATEGIES = ("topk", "layers", "loop")
# ConceptMoE fields that do not change the compute match: re-applied after matching.
CONCEPT_ONLY = ("chunk_router", "boundary_noise", "boundary_sharpness", "ratio_loss_weight",
                "concept_pooling", "joint_decoding")
# Fields a plain MoE ignores (its run config leaves them at the preset's values).
MOE_IGNORED = CONCEPT_ONLY + ("n_encoder_layers", "n_decoder_layers", "compression_ratio",
                              "concept_loops", "concept_n_experts", "concept_top_k")
# Changing these on --resume would make a different run.
_IDENTITY = ("data", "batch_size", "seq_len", "seed")


@dataclass
class TrainConfig:
    """Everything a training run needs besides the data itself (stored in config.json)."""

    model: str = "conceptmoe"  # "conceptmoe" or "moe"
    preset: str = "small"
    ratio: float = 2.0  # target compression R (ConceptMoE)
    strategy: str | None = None  # "topk" | "layers" | "loop": compute-matched to the MoE preset
    overrides: dict[str, Any] = field(default_factory=dict)  # --set key=value
    data: str | None = None  # None: the Shakespeare corpus
    out: str | None = None  # None: runs/<preset>-<model name>
    max_steps: int | None = None  # None: from tokens (default DEFAULT_TOKENS)
    tokens: int | None = None
    save_every: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup_steps: int | None = None  # None: 5% of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chunk_lr_mult: float = 1.0  # learning-rate multiplier of the chunk router
    seed: int = 0
    device: str = "auto"
    eval_every: int | None = None  # None: ~10 validations per run; 0: none
    eval_tokens: int = 32768  # size of the held-out slice validated during training
    tokenizer: str | None = None  # reuse this tokenizer.json instead of training one
    resume: bool = False
    force: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.model not in ("conceptmoe", "moe"):
            raise UserError(f"--model must be conceptmoe or moe (got {self.model!r})")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)} (got {self.strategy!r})")
        if self.strategy and self.model == "moe":
            raise UserError("--strategy builds a compute-matched ConceptMoE; it cannot be combined with --model moe")
        if self.max_steps is not None and self.tokens is not None:
            raise UserError("give --max-steps or --tokens, not both")
        for name in ("max_steps", "tokens", "save_every", "batch_size", "seq_len", "eval_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer (got {v!r})")
        if self.seq_len < 2:
            raise UserError("--seq-len must be at least 2")
        if not self.lr > 0 or self.grad_clip <= 0 or self.chunk_lr_mult < 0:
            raise UserError("--lr and grad_clip must be > 0 and chunk_lr_mult >= 0")
        if self.ratio <= 1:
            raise UserError(f"--ratio must be > 1 (got {self.ratio})")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for transient in ("resume", "force", "progress"):
            d.pop(transient)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil((self.tokens or DEFAULT_TOKENS) / (self.batch_size * self.seq_len)))


def model_config(tc: TrainConfig) -> ModelConfig:
    """The ModelConfig a TrainConfig asks for (preset, kind, R, matching strategy, --set)."""
    try:
        if tc.strategy:
            from .match import match_config

            # Ablation knobs change the ConceptMoE, not the baseline it is matched to.
            shared = {k: v for k, v in tc.overrides.items() if k not in CONCEPT_ONLY}
            base = ModelConfig.from_preset(tc.preset, **{**shared, "kind": "moe"})
            mc = match_config(base, tc.ratio, tc.strategy).config
            return mc.replace(**{k: v for k, v in tc.overrides.items() if k in CONCEPT_ONLY})
        kind = {"kind": tc.model}
        if tc.model == "conceptmoe":
            kind["compression_ratio"] = tc.ratio
        return ModelConfig.from_preset(tc.preset, **{**kind, **tc.overrides})
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


def default_out(tc: TrainConfig, mc: ModelConfig) -> Path:
    return Path("runs") / f"{tc.preset}-{mc.name}"


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    groups: dict[str, list] = {"decay": [], "no_decay": [], "chunk": []}
    for name, p in model.named_parameters():
        if name.startswith("chunk."):
            groups["chunk"].append(p)
        elif p.dim() >= 2 and not name.startswith("embed."):
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    spec = [("decay", tc.weight_decay, 1.0), ("no_decay", 0.0, 1.0), ("chunk", 0.0, tc.chunk_lr_mult)]
    param_groups = [{"params": groups[n], "weight_decay": wd, "lr_mult": mult, "lr": tc.lr * mult}
                    for n, wd, mult in spec if groups[n]]
    return torch.optim.AdamW(param_groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_out_dir(tc: TrainConfig, mc: ModelConfig) -> Path:
    """Check --out against --resume/--force; writes nothing (``--force`` deletes later)."""
    out = Path(tc.out) if tc.out else default_out(tc, mc)
    if tc.resume:
        stored = ck.read_run_config(out) if out.is_dir() else None
        if stored is None:
            raise UserError(f"--resume: {out} holds no run to resume")
        diff = _diff(stored["model"], mc.to_dict())
        if diff:
            raise UserError(f"--resume: {out} holds a run with a different model config (differs in: {', '.join(diff)})")
        old = stored.get("train", {})
        diff = [k for k in _IDENTITY if old.get(k) != getattr(tc, k)]
        if diff:
            raise UserError(f"--resume: {out} was trained with different {', '.join(diff)}")
        return out
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if ck.is_run(out):
        if not tc.force:
            raise UserError(f"{out} already holds a run; use --resume to continue it or --force to replace it")
    elif out.is_dir() and any(out.iterdir()) and not tc.force:
        raise UserError(f"{out} is not empty and holds no run; choose another --out or pass --force")
    return out


def train(tc: TrainConfig) -> Path:
    """Train (or resume) one run; returns its directory."""
    device = ck.resolve_device(tc.device)
    mc = model_config(tc)
    corpus = load_corpus(tc.data)
    out = check_out_dir(tc, mc)
    tok = _tokenizer(tc, mc, out, [d.text for d in corpus.train])
    train_ids = encode_documents(tok, [d.text for d in corpus.train], DOC_SEP)
    val_ids = encode_documents(tok, [d.text for d in corpus.val], DOC_SEP)
    sampler = BatchSampler(train_ids, tc.seq_len, tc.batch_size, tc.seed)
    # All input is valid: only now is the output folder touched.
    if tc.force and not tc.resume and ck.is_run(out):
        ck.remove_run(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out / "tokenizer.json")
    ck.write_json(out / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION,
                                        "name": mc.name, "model": mc.to_dict(), "train": tc.to_dict()})

    torch.manual_seed(tc.seed)
    model = build_model(mc).to(device)
    opt = make_optimizer(model, tc)
    step = 0
    ckpt = ck.latest_checkpoint(out) if tc.resume else None
    if ckpt is not None:
        state = ck.load_checkpoint(ckpt, model, opt, device)
        step = int(state["step"])
        sampler.set_position(state["data_position"])
        ck.link_latest_weights(out, ckpt)
    ck.truncate_metrics(out, step)
    (out / "eval.json").unlink(missing_ok=True)  # present again only once this run completes
    _loop(tc, model, opt, sampler, step, out, val_ids, byte_lengths(tok, mc.vocab_size), device)
    final = evaluate_tokens(model, val_ids, byte_lengths(tok, mc.vocab_size), tc.seq_len)
    ck.write_json(out / "eval.json", {**final, "step": tc.total_steps})
    return out


def _tokenizer(tc: TrainConfig, mc: ModelConfig, out: Path, texts: list[str]):
    if tc.resume and (out / "tokenizer.json").is_file():
        tok = load_tokenizer(out / "tokenizer.json")
    elif tc.tokenizer:
        tok = load_tokenizer(tc.tokenizer)
    else:
        tok = train_tokenizer(texts, mc.vocab_size)
    if tok.get_vocab_size() > mc.vocab_size:
        raise UserError(f"tokenizer has {tok.get_vocab_size()} entries but the model's vocab_size is {mc.vocab_size}")
    return tok


def _loop(tc: TrainConfig, model, opt, sampler: BatchSampler, step: int, out: Path,
          val_ids: np.ndarray, byte_len: np.ndarray, device: torch.device) -> None:
    total = tc.total_steps
    warmup = tc.warmup_steps if tc.warmup_steps is not None else max(1, total // 20)
    eval_every = tc.eval_every if tc.eval_every is not None else max(1, total // 10)
    byte_len_t = torch.from_numpy(byte_len).to(device)
    model.train()
    label = f"{out.parent.name}/{out.name}" if out.name.startswith("seed") else out.name
    bar = tqdm(total=total, initial=step, desc=label, unit="step", disable=not tc.progress,
               dynamic_ncols=True, mininterval=1.0)
    with open(out / "metrics.jsonl", "a") as log:
        while step < total:
            t0 = time.perf_counter()
            factor = lr_factor(step, total, warmup, tc.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = tc.lr * g["lr_mult"] * factor
            x = sampler.next().to(device)  # (B, T); labels = inputs (the model shifts)
            res = model(x, labels=x)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            tokens_per_s = x.numel() / (time.perf_counter() - t0)  # training only, before validation
            aux = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in res.aux.items()}
            ce = aux["ce_loss"]
            n_bytes = int(byte_len_t[x[:, 1:]].sum())
            row = {"step": step, "loss": float(res.loss.detach()), "ce_loss": ce,
                   "bpb": ce * x[:, 1:].numel() / math.log(2) / max(n_bytes, 1),
                   "lr": tc.lr * factor, "compression": aux["compression"],
                   "ratio_loss": aux["ratio_loss"], "balance_loss": aux["balance_loss"],
                   "grad_norm": float(gnorm), "tokens": step * x.numel()}
            if "boundary_prob" in aux:
                row["boundary_prob"] = aux["boundary_prob"]
            if eval_every and (step % eval_every == 0 or step == total):
                v = evaluate_tokens(model, val_ids, byte_len, tc.seq_len, max_tokens=tc.eval_tokens)
                row.update(val_loss=v["val_loss"], val_bpb=v["val_bpb"], val_compression=v["compression"])
            row["tokens_per_s"] = tokens_per_s
            log.write(json.dumps(row) + "\n")
            log.flush()
            if step % tc.save_every == 0 or step == total:
                ck.save_checkpoint(out, model, opt, {"step": step, "data_position": sampler.position})
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", bpb=f"{row['bpb']:.3f}",
                            comp=f"{row['compression']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
    bar.close()


