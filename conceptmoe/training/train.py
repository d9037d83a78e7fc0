"""Training: ``train(TrainConfig) -> Path`` (the pipeline behind CONCEPTMOE.md §5's comparison).

AdamW (no weight decay on norms, embeddings and the chunk router), linear warmup then cosine
decay to ``min_lr_ratio * lr``, gradient clipping, a tqdm bar with loss, bits per byte,
realized compression and tokens/s, one ``metrics.jsonl`` row per step, periodic validation on
a fixed slice of the held-out text, and crash-safe checkpoints (checkpoint.py). With the same
seed on CPU a run killed at any moment and resumed equals an uninterrupted one step for step:
the checkpoint holds weights, optimizer, RNG (boundary noise draws from the global torch RNG)
and the data position, and rows logged after the checkpoint are dropped on resume.

What is trained (and where) is a ``TrainConfig`` (``config.py``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import Interrupted, UserError
from ..model.config import ModelConfig
from ..model.lm import build_model
from . import checkpoint as ck
from .config import RUN_IDENTITY, TrainConfig, default_out, model_config, resolve_data
from .data import DOC_SEP, BatchSampler, check_record, load_corpus
from .evaluate import evaluate_tokens
from .lock import RunLock, holds_only_lock
from .signals import StopOnSignal
from .init_run import load_init_weights
from .tokenizer import byte_lengths, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer


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


def check_out_dir(tc: TrainConfig, mc: ModelConfig, out: Path) -> dict | None:
    """Check --out against --resume/--force; writes nothing. Returns the stored run config."""
    if tc.resume:
        stored = ck.read_run_config(out) if ck.is_run(out) else None
        if stored is None:
            raise UserError(f"--resume: {out} holds no run to resume")
        diff = _diff(stored["model"], mc.to_dict())
        if diff:
            raise UserError(f"--resume: {out} holds a run with a different model config (differs in: {', '.join(diff)})")
        old = stored.get("train", {})
        old = {**old, "data": resolve_data(old.get("data"))}
        diff = [k for k in RUN_IDENTITY if old.get(k) != getattr(tc, k)]
        if diff:
            raise UserError(f"--resume: {out} was trained with different {', '.join(diff)}")
        # A run stopped before its first checkpoint has nothing to lose and starts over.
        trained = any((out / f).exists() for f in ("model.safetensors", "eval.json"))
        if ck.latest_checkpoint(out) is None and trained:
            raise UserError(f"--resume: {out} holds trained weights but no checkpoint to resume from "
                            f"({ck.CKPT_DIR}/ is missing or damaged); nothing was changed")
        return stored
    if ck.is_run(out):
        if not tc.force:
            raise UserError(f"{out} already holds a run; use --resume to continue it or --force to replace it")
    elif not holds_only_lock(out) and not tc.force:
        raise UserError(f"{out} is not empty and holds no run; choose another --out or pass --force")
    return None


def train(tc: TrainConfig) -> Path:
    """Train (or resume) one run; returns its directory. Holds the run's lock throughout."""
    device = ck.resolve_device(tc.device)
    mc = model_config(tc)
    out = Path(tc.out) if tc.out else default_out(tc, mc)
    with RunLock(out):
        stored = check_out_dir(tc, mc, out)
        corpus = load_corpus(tc.data, legacy_split=stored is not None and "data" not in stored)
        if stored is not None:
            check_record(stored.get("data"), corpus)
        tok = _tokenizer(tc, mc, out, [d.text for d in corpus.train])
        train_ids = encode_documents(tok, [d.text for d in corpus.train], DOC_SEP)
        val_ids = encode_documents(tok, [d.text for d in corpus.val], DOC_SEP)
        sampler = BatchSampler(train_ids, tc.seq_len, tc.batch_size, tc.seed)
        data = {**corpus.record(), "train_tokens": len(train_ids), "val_tokens": len(val_ids)}
        if tc.progress:
            cap = min(len(val_ids), tc.val_tokens or len(val_ids))
            print(f"data {data['source']}: {data['train_documents']} training / {data['val_documents']} "
                  f"held-out pieces, {len(train_ids):,} / {len(val_ids):,} tokens "
                  f"({100 * len(val_ids) / max(len(train_ids) + len(val_ids), 1):.1f}% held out); "
                  f"final validation on {cap:,} tokens", file=sys.stderr)
        # All input is valid: only now is the output folder touched.
        if tc.force and not tc.resume:
            ck.remove_run(out)
        save_tokenizer(tok, out / "tokenizer.json")
        ck.write_json(out / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION, "name": mc.name,
                                            "model": mc.to_dict(), "train": tc.to_dict(), "data": data})
        torch.manual_seed(tc.seed)
        model = build_model(mc).to(device)
        if tc.init and (stored is None or ck.latest_checkpoint(out) is None):  # not resuming: start from --init
            load_init_weights(model, tc.init, device)
        opt = make_optimizer(model, tc)
        step = 0
        ckpt = ck.latest_checkpoint(out) if stored is not None else None
        if ckpt is not None:
            state = ck.load_checkpoint(ckpt, model, opt, device)
            step = int(state["step"])
            sampler.set_position(state["data_position"])
            ck.link_latest_weights(out, ckpt)
        ck.truncate_metrics(out, step)
        (out / "eval.json").unlink(missing_ok=True)  # present again only once this run completes
        byte_len = byte_lengths(tok, mc.vocab_size)
        with StopOnSignal() as stop:
            _loop(tc, model, opt, sampler, step, out, val_ids, byte_len, device, stop)
        final = evaluate_tokens(model, val_ids, byte_len, tc.seq_len, max_tokens=tc.val_tokens,
                                progress=tc.progress)
        if not math.isfinite(final["val_loss"]):
            raise UserError(f"final validation loss is {final['val_loss']}; the run diverged (checkpoint kept)")
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


def _not_finite(loss: torch.Tensor, gnorm: torch.Tensor) -> str | None:
    """Which quantity of a step is not finite (None when both are)."""
    if not torch.isfinite(loss):
        return f"loss is {float(loss.detach())}"
    if not torch.isfinite(gnorm):
        return f"gradient norm is {float(gnorm)}"
    return None


def _kept(saved: int) -> str:
    return f"the last good checkpoint (step {saved}) kept" if saved else "no checkpoint written yet"


def _loop(tc: TrainConfig, model, opt, sampler: BatchSampler, step: int, out: Path,
          val_ids: np.ndarray, byte_len: np.ndarray, device: torch.device, stop: StopOnSignal) -> None:
    total = tc.total_steps
    warmup = tc.warmup_steps if tc.warmup_steps is not None else max(1, total // 20)
    eval_every = tc.eval_every if tc.eval_every is not None else max(1, total // 10)
    byte_len_t = torch.from_numpy(byte_len).to(device)
    model.train()
    label = f"{out.parent.name}/{out.name}" if out.name.startswith("seed") else out.name
    bar = tqdm(total=total, initial=step, desc=label, unit="step", disable=not tc.progress,
               dynamic_ncols=True, mininterval=1.0)
    saved, skipped = step, 0
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
            bad = _not_finite(res.loss, gnorm)
            if bad and skipped < tc.skip_bad_steps:  # drop this batch's update, keep going
                skipped += 1
                opt.zero_grad(set_to_none=True)
                tqdm.write(f"warning: step {step + 1}: {bad}; update skipped ({skipped}/{tc.skip_bad_steps})",
                           file=sys.stderr)
                continue
            if bad:
                bar.close()
                raise UserError(f"training diverged at step {step + 1}: {bad}; stopped, {_kept(saved)}; "
                                f"lower --lr or pass --skip-bad-steps N")
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
            bad = next((f"{k} is {v}" for k, v in row.items() if not math.isfinite(v)), None)
            if bad:
                bar.close()
                raise UserError(f"training diverged at step {step}: {bad}; stopped, {_kept(saved)}")
            log.write(json.dumps(row, allow_nan=False) + "\n")
            log.flush()
            if step % tc.save_every == 0 or step == total or stop.signum is not None:
                ck.save_checkpoint(out, model, opt, {"step": step, "data_position": sampler.position})
                saved = step
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", bpb=f"{row['bpb']:.3f}",
                            comp=f"{row['compression']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            if stop.signum is not None and step < total:
                bar.close()
                raise Interrupted(f"stopped by {stop.name} at step {step}/{total}: checkpoint saved in {out}; "
                                  f"continue with --resume", 128 + stop.signum)
    bar.close()
