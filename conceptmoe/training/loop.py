"""The training loop: one optimizer step per global batch, on 1 or N processes alike.

Every process draws the same *global* batch (B sequences) from the deterministic sampler and
takes its slice: rows ``[rank·B/W, (rank+1)·B/W)``, cut into ``grad_accum`` micro-batches (whose
ratio/balance/z statistics are summed first, without gradients, so accumulation is exact).
Boundary noise comes from uniforms drawn per global batch from a generator seeded by (seed,
the batch's index among the batches drawn), sliced like the rows, so each sequence gets the same
samples whatever the world size and however it is resumed; an elastic run's target R is keyed by
the sample index (``elastic.py``). A skipped step (``--skip-bad-steps``) has drawn its batch: the
next batch draws its own noise and R, and the count of skipped steps is kept in the checkpoint.
The cross-entropy is weighted by each micro-batch's predicted tokens (padding, as in
vlm-digits, counts nothing), and the ratio, balance and z-loss statistics are
global (``model/stats.py``): the logged loss of a W-process run, with or without ``grad_accum``,
equals the 1-process run's (``tests/test_distributed_modes.py``).

A step: lr schedule -> forward/backward per micro-batch (gradient sync only on the last) ->
clip -> finiteness check (a non-finite loss or gradient norm stops the run before the update,
or is skipped up to ``skip_bad_steps``) -> optimizer step -> metrics row (rank 0) -> periodic
validation (every rank, same numbers) -> checkpoint when due or when a signal asked to stop.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import Interrupted, UserError
from ..parallel import distributed, expert_parallel
from . import parallel_checkpoint
from .config import TrainConfig, default_eval_every, default_warmup
from .elastic import sample_ratios
from .health import Watch
from ..data.corpus import BatchSampler
from ..model.chunking import confidence_weight_at, sharpness_at
from ..parallel.distributed import Dist
from .signals import StopOnSignal


@dataclass
class TaskData:
    """What a training task brings to a run: data, its validation, its record (``train.py``)."""

    tokenizer: Any  # tokenizers.Tokenizer, saved into the run
    sampler: Any  # BatchSampler-like: next(), position, set_position
    record: dict  # stored in config.json["data"]; a resumed run must match it
    byte_len: np.ndarray  # UTF-8 bytes per token id (bits per byte)
    validate: Callable[[nn.Module], dict[str, float]]  # periodic validation -> metrics fields
    final: Callable[[nn.Module], dict[str, float]]  # final validation -> eval.json
    note: str  # one line describing the data split (printed at the start)


@dataclass
class Loop:
    """What the loop works on (built by ``train.train``)."""

    tc: TrainConfig
    model: nn.Module  # what to call: the model, FSDP-sharded in place, or a DDP wrapper
    opt: torch.optim.Optimizer
    sampler: BatchSampler  # next() -> the global batch: (B, T) token ids, or a dict of batch-first tensors
    out: Path
    validate: Callable[[nn.Module], dict[str, float]]  # periodic validation: fields for the metrics row
    byte_len: np.ndarray
    dist: Dist
    plain: Callable[[], nn.Module]  # a fresh unparallelized model (for gathering FSDP checkpoints)
    dtype: str = "fp32"

    @property
    def raw(self) -> nn.Module:
        return distributed.unwrap(self.model)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def boundary_uniforms(seed: int, batch: int, shape: tuple[int, int]) -> torch.Tensor:
    """Uniforms (B, T) for the boundary samples of the ``batch``-th global batch drawn (optimizer
    steps plus skipped steps before it; without skips, the step): the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * (batch + 1))
    return torch.rand(shape, generator=g)


def _not_finite(loss: float, gnorm: float) -> str | None:
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(gnorm):
        return f"gradient norm is {gnorm}"
    return None


def _kept(saved: int) -> str:
    return f"the last good checkpoint (step {saved}) kept" if saved else "no checkpoint written yet"


def _sync(model: nn.Module, on: bool):
    """Gradient synchronisation on or off for this backward (DDP / FSDP2); a no-op context."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(on)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not on:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def as_batch(batch) -> dict[str, torch.Tensor]:
    """The model's inputs of a global batch: token ids (B, T) train on themselves (shifted inside)."""
    return {"input_ids": batch, "labels": batch} if torch.is_tensor(batch) else batch


def forward_backward(lp: Loop, batch: dict[str, torch.Tensor], u: torch.Tensor | None) -> tuple[float, dict[str, float]]:
    """Gradients of this rank's slice of the global batch (model inputs, batch-first); (global loss,
    mean aux terms). Every tensor of the batch is sliced by rows alike."""
    d, K, dev = lp.dist, lp.tc.grad_accum, lp.dist.device
    x = batch["input_ids"]
    rows = x.shape[0] // d.world
    mine = slice(d.rank * rows, (d.rank + 1) * rows)
    micro = rows // K
    concept = lp.raw.cfg.is_concept
    # bf16: autocast over fp32 weights in every mode (FSDP gathers fp32 parameters too), so DDP,
    # FSDP and one process share one numerics; the model keeps its fp32 islands (router, scan).
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=lp.dtype == "bf16")
    parts = [slice(mine.start + k * micro, mine.start + (k + 1) * micro) for k in range(K)]

    def inputs(part: slice) -> dict[str, torch.Tensor]:
        noise = {"boundary_noise": u[part].to(dev)} if concept and u is not None else {}
        return {**{name: t[part].to(dev) for name, t in batch.items()}, **noise}

    if K > 1:
        # The ratio, balance and z-losses are means over the whole batch: sum every micro-batch's
        # statistics first (a forward without gradients), so that accumulation equals one batch.
        with autocast:
            totals = sum(lp.raw.collect_stats(**{k: v for k, v in inputs(s).items() if k != "labels"})
                         for s in parts)
        lp.raw.stats_totals = d.sum(totals)
    # The cross-entropy is a mean over the predicted tokens of the whole global batch: micro-batch
    # k's own mean weighs n_k / N (times the world: data parallelism averages the gradients). With
    # equal counts (text) that is 1/K exactly; padded rows (vlm-digits) count their real tokens.
    targets = lambda rows: int((batch["labels"][rows, 1:] != -100).sum())  # noqa: E731
    n_all = max(targets(slice(None)), 1)
    loss_sum, ce_mean, ce_sum, aux_sum = 0.0, 0.0, 0.0, {}
    for k, part in enumerate(parts):
        with _sync(lp.model, k == K - 1), autocast:
            res = lp.model(**inputs(part))
        weight = targets(part) * d.world / n_all
        ce = res.aux["ce_loss"]
        (res.loss / K + ce * (weight - 1 / K)).backward()
        loss_sum += float(res.loss.detach()) / K
        ce_mean += float(ce.detach()) / K
        ce_sum += float(ce.detach()) * weight / d.world
        for name, v in res.aux.items():
            aux_sum[name] = aux_sum.get(name, 0.0) + (float(v.detach()) if torch.is_tensor(v) else float(v)) / K
    if getattr(lp.raw, "expert_parallel", None) is not None:
        expert_parallel.sync_grads(lp.raw, d.world)
    lp.raw.stats_totals = None
    if "ratio" in batch:  # elastic: the per-sequence ratio loss is each rank's mean over its rows
        aux_sum["ratio_loss"] = d.mean(aux_sum["ratio_loss"])
    aux_sum["ce_loss"] = d.mean(ce_sum) * d.world  # token-weighted over every micro-batch and process
    loss = d.mean(loss_sum - ce_mean) + aux_sum["ce_loss"]  # the other terms are global already
    return loss, aux_sum


def _grad_norm(model: nn.Module, clip: float) -> float:
    """The global gradient norm (the same on every rank), after clipping every gradient by it."""
    if getattr(model, "expert_parallel", None) is not None:  # experts sharded: a collective norm
        return float(expert_parallel.clip_grad_norm(model, clip))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def run(lp: Loop, step: int, stop: StopOnSignal, skipped: int = 0, schedule: int | None = None) -> None:
    """Train from ``step`` to the configured total, logging and checkpointing (rank 0 writes).
    ``skipped``: the steps skipped before ``step`` (a resumed run's checkpoint holds them);
    ``schedule``: the total the lr, sharpness and confidence schedules are laid out over (a
    resumed run's recorded one; beyond it, as at its end), default the configured total."""
    tc, d = lp.tc, lp.dist
    total = tc.total_steps
    plan = schedule or total
    warmup = tc.warmup_steps if tc.warmup_steps is not None else default_warmup(plan)
    eval_every = tc.eval_every if tc.eval_every is not None else default_eval_every(total)
    eval_model = lp.model if distributed.is_sharded(lp.model) else lp.raw
    lp.model.train()
    lp.raw.loss_only = True  # training forwards need the loss, not the logits (model/linear_ce.py)
    out = lp.out
    label = f"{out.parent.name}/{out.name}" if out.name.startswith("seed") else out.name
    bar = tqdm(total=total, initial=step, desc=label, unit="step", disable=not (tc.progress and d.main),
               dynamic_ncols=True, mininterval=1.0)
    saved = step
    cfg = lp.raw.cfg
    elastic = (tc.ratios or [[r, 1.0] for r in cfg.elastic_ratios]) if getattr(cfg, "elastic_ratios", None) else None
    log = open(out / "metrics.jsonl", "a") if d.main else None
    # --log: the router's and experts' health every validation interval (health.py)
    watch = Watch(lp.raw, tc.log, out, step, total, eval_every or default_eval_every(total), tc.seq_len, d,
                  lp.dtype) if tc.log else None
    try:
        while step < total:
            t0 = time.perf_counter()
            factor = lr_factor(step, plan, warmup, tc.min_lr_ratio)
            for g in lp.opt.param_groups:
                g["lr"] = tc.lr * g["lr_mult"] * factor
            batch = as_batch(lp.sampler.next())  # the global batch (the model shifts the labels)
            x = batch["input_ids"]
            drawn = step + skipped  # global batches drawn before this one: keys its samples' draws
            u = boundary_uniforms(tc.seed, drawn, tuple(x.shape)) if lp.raw.cfg.is_concept else None
            if cfg.is_concept and cfg.boundary_sharpness_final is not None:  # annealed boundary samples
                lp.raw.sharpness_now = sharpness_at(cfg, step, plan)
            if cfg.is_concept and cfg.router_confidence_start > 0:  # confidence term switched on late
                lp.raw.confidence_now = confidence_weight_at(cfg, step, plan)
            if elastic:  # each sequence's target R, sliced with the rows (training/elastic.py)
                batch = {**batch, "ratio": sample_ratios(tc.seed, drawn * x.shape[0], x.shape[0], elastic)}
            lp.opt.zero_grad(set_to_none=True)
            loss, aux = forward_backward(lp, batch, u)
            gnorm = _grad_norm(lp.model, tc.grad_clip)
            bad = _not_finite(loss, gnorm)
            if bad and skipped < tc.skip_bad_steps:  # drop this batch's update, keep going
                skipped += 1
                lp.opt.zero_grad(set_to_none=True)
                if d.main:
                    tqdm.write(f"warning: step {step + 1}: {bad}; update skipped ({skipped}/{tc.skip_bad_steps})",
                               file=sys.stderr)
                continue
            if bad:
                bar.close()
                raise UserError(f"training diverged at step {step + 1}: {bad}; stopped, {_kept(saved)}; "
                                f"lower --lr or pass --skip-bad-steps N")
            lp.opt.step()
            step += 1
            tokens_per_s = x.numel() / (time.perf_counter() - t0)  # training only, before validation
            ce = aux["ce_loss"]
            target = batch["labels"][:, 1:]
            target = target[target != -100]  # the predicted tokens
            n_bytes = int(lp.byte_len[target.numpy()].sum())
            row = {"step": step, "loss": loss, "ce_loss": ce,
                   "bpb": ce * target.numel() / math.log(2) / max(n_bytes, 1),
                   "lr": tc.lr * factor, "compression": aux["compression"],
                   "ratio_loss": aux["ratio_loss"], "balance_loss": aux["balance_loss"],
                   "grad_norm": gnorm, "tokens": step * x.numel()}
            if "boundary_prob" in aux:
                row["boundary_prob"] = aux["boundary_prob"]
            if eval_every and (step % eval_every == 0 or step == total):
                row.update(lp.validate(eval_model))
                lp.model.train()
            row["tokens_per_s"] = tokens_per_s
            bad = next((f"{k} is {v}" for k, v in row.items() if not math.isfinite(v)), None)
            if bad:
                bar.close()
                raise UserError(f"training diverged at step {step}: {bad}; stopped, {_kept(saved)}")
            if watch is not None:
                watch.add(row, aux, step)
            if log is not None:
                log.write(json.dumps(row, allow_nan=False) + "\n")
                log.flush()
            stopping = d.any(stop.signum is not None)
            if step % tc.save_every == 0 or step == total or stopping:
                parallel_checkpoint.save(out, lp.model, lp.opt, {"step": step, "data_position": lp.sampler.position,
                                                                 "skipped": skipped, "total_steps": plan}, d, lp.plain)
                saved = step
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", bpb=f"{row['bpb']:.3f}",
                            comp=f"{row['compression']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            if stopping and step < total:
                bar.close()
                signum = stop.signum or 15  # a rank that was not signalled itself stops with its peers
                raise Interrupted(f"stopped by {stop.name or 'a peer'} at step {step}/{total}: checkpoint saved "
                                  f"in {out}", 128 + signum, resume="continue with --resume")
    finally:
        if log is not None:
            log.close()
        if watch is not None:
            watch.close()
    bar.close()
