"""Training: ``train(TrainConfig) -> Path`` (the pipeline behind CONCEPTMOE.md §5's comparison).

AdamW (no weight decay on norms, embeddings and the chunk router), linear warmup then cosine
decay to ``min_lr_ratio * lr``, gradient clipping, a tqdm bar with loss, bits per byte,
realized compression and tokens/s, one ``metrics.jsonl`` row per step, periodic validation on
a fixed slice of the held-out text, and crash-safe checkpoints (checkpoint.py). With the same
seed on CPU a run killed at any moment and resumed equals an uninterrupted one step for step:
the checkpoint holds weights, optimizer, RNG and the data position (boundary noise is drawn per
step, ``loop.py``), and rows logged after the checkpoint are dropped on resume. Under torchrun
the same function runs on every process (``distributed.py``).

What is trained (and where) is a ``TrainConfig`` (``config.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..device import default_dtype, dtype_note
from ..errors import UserError
from ..model.config import ModelConfig
from ..model.lm import build_model
from . import checkpoint as ck
from ..parallel import distributed
from . import loop, parallel_checkpoint, ratio_calibration, reproducible, tblog
from .config import (RUN_IDENTITY, RUN_SCHEDULE, TrainConfig, comparable_model, default_out, model_config,
                     match_result, resolve_data, schedule_steps)
from ..data.corpus import DOC_SEP, BatchSampler, check_record, load_corpus
from ..parallel.distributed import Dist
from .validation import evaluate_tokens
from .recipe import render_train
from ..files import write_text
from .init_run import load_init_weights
from ..lock import RunLock, holds_only_lock
from .loop import Loop, TaskData, lr_factor  # noqa: F401  (lr_factor: part of this module's API)
from ..data.shards import ShardSampler, is_prepared, open_prepared
from .signals import StopOnSignal
from ..data.tokenizer import byte_lengths, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer
from ..data.digits import VLM_DATA


GROUPS = ("decay", "no_decay", "chunk")  # optimizer parameter groups, in this order in every mode
# With per-stage learning rates (--stage-lr-mults) the concept stage's parameters get groups of their own.
STAGE_GROUPS = GROUPS + ("concept_decay", "concept_no_decay")


def param_groups(model: torch.nn.Module, staged: bool = False) -> dict[str, list[torch.nn.Parameter]]:
    """The model's parameters by optimizer group, decided by parameter identity on the unwrapped
    model (``distributed.unwrap``): a DDP wrapper's ``module.`` names or FSDP's DTensor parameters
    change nothing. The chunk router and an elastic model's ratio embedding (its threshold shift
    and router vector are the router's; ``--chunk-lr-mult 0`` freezes them all): their own
    learning rate, no decay; embeddings, the image position table, norms and biases: no decay;
    every other matrix: decay. ``staged``: the concept stage (the concept blocks, run at every
    loop, and their output norm) in ``concept_decay`` / ``concept_no_decay``."""
    raw = distributed.unwrap(model)
    chunk = {id(p) for name in ("chunk", "ratio_embed") if getattr(raw, name, None) is not None
             for p in getattr(raw, name).parameters()}
    concept = {id(p) for name in ("concept", "concept_norm") if staged and getattr(raw, name, None) is not None
               for p in getattr(raw, name).parameters()}
    flat = {id(p) for p in raw.embed.parameters()}
    if getattr(raw, "vision", None) is not None:
        flat.add(id(raw.vision.pos))
    groups: dict[str, list] = {n: [] for n in (STAGE_GROUPS if staged else GROUPS)}
    for p in raw.parameters():
        name = "chunk" if id(p) in chunk else "decay" if p.dim() >= 2 and id(p) not in flat else "no_decay"
        groups[("concept_" + name) if id(p) in concept else name].append(p)
    return groups


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (the same groups, in the same order, in every parallel mode);
    each group's ``lr_mult`` is its stage's multiplier (``tc.stage_lr_mults``), times
    ``chunk_lr_mult`` for the router."""
    token, concept = tc.stage_lr_mults or (1.0, 1.0)
    spec = {"decay": (tc.weight_decay, token), "no_decay": (0.0, token), "chunk": (0.0, token * tc.chunk_lr_mult),
            "concept_decay": (tc.weight_decay, concept), "concept_no_decay": (0.0, concept)}
    groups = [{"params": ps, "name": n, "weight_decay": spec[n][0], "lr_mult": spec[n][1], "lr": tc.lr * spec[n][1]}
              for n, ps in param_groups(model, tc.stage_lr_mults is not None).items() if ps]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, fused=_fused_adamw(model) or None)


def _fused_adamw(model: torch.nn.Module) -> bool:
    """AdamW's fused kernel (one pass over each parameter) where it helps and is safe: plain CPU
    tensors, where torch's default is a loop of ~10 ops per parameter (the small preset, 2 threads:
    17 vs 50 ms per step). CUDA keeps torch's default (foreach), FSDP's DTensors too."""
    return all(type(p) is torch.nn.Parameter and p.device.type == "cpu" and p.dtype == torch.float32
               for p in model.parameters())


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_out_dir(tc: TrainConfig, mc: ModelConfig, out: Path) -> dict | None:
    """Check --out against --resume/--force; writes nothing. Returns the stored run config."""
    if tc.resume:
        stored = ck.read_run_config(out) if ck.is_run(out) else None
        if stored is None:
            raise UserError(f"--resume: {out} holds no run to resume")
        diff = _diff(comparable_model(stored["model"]), comparable_model(mc.to_dict()))
        if diff:
            raise UserError(f"--resume: {out} holds a run with a different model config (differs in: {', '.join(diff)})")
        old = stored.get("train", {})
        old = {**old, "data": resolve_data(old.get("data"))}
        diff = [k for k in RUN_IDENTITY if old.get(k) != getattr(tc, k)]
        if diff:
            raise UserError(f"--resume: {out} was trained with different {', '.join(diff)}")
        if old.get("init") != tc.init:  # provenance: what a run started from never changes
            raise UserError(f"--resume: {out} was started from {old.get('init') or 'scratch (no --init)'}; "
                            f"a resumed run keeps its recorded init: leave out --init")
        # A run stopped before its first checkpoint has nothing to lose and starts over.
        trained = any((out / f).exists() for f in ("model.safetensors", "eval.json"))
        latest = ck.latest_checkpoint(out)
        if latest is None and trained:
            raise UserError(f"--resume: {out} holds trained weights but no checkpoint to resume from "
                            f"({ck.CKPT_DIR}/ is missing or damaged); nothing was changed")
        if latest is not None:
            check_schedule(tc, old, json.loads((latest / "state.json").read_text()), out)
        return stored
    if ck.never_trained(out):  # a failed start kept nothing: its files are rewritten below
        return None
    if ck.is_run(out):
        if not tc.force:
            raise UserError(f"{out} already holds a run; use --resume to continue it or --force to replace it")
    elif not holds_only_lock(out) and not tc.force:
        raise UserError(f"{out} is not empty and holds no run; choose another --out or pass --force")
    return None


def check_schedule(tc: TrainConfig, old: dict, state: dict, out: Path) -> None:
    """A resumed run keeps its schedule (issue 41): the total it was laid out over (recorded in the
    checkpoint; config.json's before the record) and its optimizer settings (``RUN_SCHEDULE``).
    Another total mid-run would rescale the lr cosine, the sharpness anneal and the confidence
    term's start, other settings would rewrite the record of the steps already trained: refused,
    one line each. A finished run may be extended (a larger total): its schedule is kept, at its end."""
    for k in RUN_SCHEDULE:
        if (k in old or k == "stage_lr_mults") and old.get(k) != getattr(tc, k):
            flag = f"--{k.replace('_', '-')}"
            raise UserError(f"--resume: {out} was trained with {flag} {old[k]}; a resumed run keeps it "
                            f"({flag} {getattr(tc, k)} would rewrite the record of the steps already trained): "
                            f"leave out {flag}, or start a new run from this one with --init {out}")
    step, total, end = int(state["step"]), schedule_total(state, old), schedule_steps(old)
    want = tc.total_steps
    if want == end or (want > step >= end):  # as recorded, or extending a finished run
        return
    given = f"--max-steps {tc.max_steps}" if tc.max_steps is not None else f"--tokens {tc.tokens}"
    if want <= step:
        raise UserError(f"--resume: {given} asks for {want} steps but {out} is already at step {step} "
                        f"(of {end}): nothing would be trained; leave out --max-steps/--tokens")
    raise UserError(f"--resume: {out} is a {total}-step run (at step {step}); {given} ({want} steps) would "
                    f"rescale its lr cosine, boundary-sharpness anneal and confidence-term start mid-run: leave "
                    f"out --max-steps/--tokens (once finished it may be extended), or start anew with --init {out}")


def schedule_total(state: dict, train: dict) -> int:
    """The total a checkpointed run's schedule is laid out over (config.json's before the record)."""
    return int(state.get("total_steps") or schedule_steps(train))


def train(tc: TrainConfig) -> Path:
    """Train (or resume) one run on this process, or on every process of a torchrun job;
    returns its directory. Rank 0 holds the run's lock and writes; every rank computes."""
    d = distributed.setup(tc.device)
    try:
        return _train(tc, d)
    finally:
        distributed.teardown(d)


def _text_data(tc: TrainConfig, mc: ModelConfig, out: Path, stored: dict | None, d: Dist) -> TaskData:
    """Plain text (file, folder, .jsonl, the default corpus) or `conceptmoe prepare` shards."""
    # Shard hashes: with --verify, and on --resume (the shards may have changed since the run began).
    prep = open_prepared(tc.data, verify=tc.verify or stored is not None) if is_prepared(tc.data) else None
    corpus = prep or load_corpus(tc.data, legacy_split=stored is not None and "data" not in stored)
    record = corpus.record()  # fingerprints all the text once
    if stored is not None:
        check_record(stored.get("data"), record)
    tok = Tokenizer.from_str(d.run_on_main(lambda: (
        prep.tokenizer(tc.tokenizer, mc.vocab_size) if prep
        else _tokenizer(tc, mc, out, [t.text for t in corpus.train])).to_str()))
    train_ids = prep.train_tokens if prep else encode_documents(tok, [t.text for t in corpus.train], DOC_SEP)
    val_ids = prep.val_tokens if prep else encode_documents(tok, [t.text for t in corpus.val], DOC_SEP)
    sampler = (ShardSampler if prep else BatchSampler)(train_ids, tc.seq_len, tc.batch_size, tc.seed)
    record = {**record, "train_tokens": len(train_ids), "val_tokens": len(val_ids)}
    byte_len = byte_lengths(tok, mc.vocab_size)

    def validate(model) -> dict[str, float]:
        v = evaluate_tokens(model, val_ids, byte_len, tc.seq_len, max_tokens=tc.eval_tokens)
        return {"val_loss": v["val_loss"], "val_bpb": v["val_bpb"], "val_compression": v["compression"]}

    def final(model) -> dict[str, float]:
        return evaluate_tokens(model, val_ids, byte_len, tc.seq_len, max_tokens=tc.val_tokens,
                               progress=tc.progress and d.main)

    cap = min(len(val_ids), tc.val_tokens or len(val_ids))
    note = (f"data {record['source']}: {record['train_documents']} training / {record['val_documents']} "
            f"held-out pieces, {len(train_ids):,} / {len(val_ids):,} tokens "
            f"({100 * len(val_ids) / max(len(train_ids) + len(val_ids), 1):.1f}% held out); "
            f"final validation on {cap:,} tokens")
    return TaskData(tok, sampler, record, byte_len, validate, final, note)


def _train(tc: TrainConfig, d: Dist) -> Path:
    mc = model_config(tc)
    out = Path(tc.out) if tc.out else default_out(tc, mc)
    mode = tc.parallel or "ddp"
    if tc.log == "tensorboard":  # before anything is written
        tblog.require()
    if tc.batch_size % (d.world * tc.grad_accum):
        raise UserError(f"--batch-size {tc.batch_size} must be a multiple of processes x --grad-accum "
                        f"({d.world} x {tc.grad_accum})")
    distributed.check_layout(d.world, mode, tc.expert_parallel,  # before anything is written
                            [mc.n_experts] + ([mc.concept_experts] if mc.is_concept else []))
    with RunLock(out) if d.main else contextlib.nullcontext():
        stored = d.run_on_main(lambda: check_out_dir(tc, mc, out))
        ckpt = ck.latest_checkpoint(out) if stored is not None else None  # None: a fresh start
        dtype, used, dnote = _precision(tc, d.device, stored if ckpt is not None else None)
        if tc.data == VLM_DATA:  # the image-text digits task (digits.py)
            from .digits import vlm_data

            data = vlm_data(tc, mc, stored)
        else:
            data = _text_data(tc, mc, out, stored, d)
        if tc.progress and d.main:
            print(data.note + (f"; {d.world} processes ({mode}, {dtype})" if d.world > 1 else ""), file=sys.stderr)
            print(dnote, file=sys.stderr)
            if tc.strategy and (tc.experts_multiple_of or 1) > 1:
                print(_constraint_note(tc, mc), file=sys.stderr)
        reproducible.make_deterministic(d.device)
        env, env_note = reproducible.resumed_environment(stored if ckpt is not None else None,
                                                         reproducible.environment(d.world, d.device))
        if env_note and tc.progress and d.main:
            print(env_note, file=sys.stderr)
        torch.manual_seed(tc.seed)
        model = build_model(mc).to(d.device)
        if tc.init and ckpt is None:  # not resuming: start from --init
            note = load_init_weights(model, tc.init, d.device)
            if note and tc.progress and d.main:
                print(note, file=sys.stderr)
        if d.main:  # all input (--init weights too) is valid: only now is the output folder touched
            if tc.force and not tc.resume:
                ck.remove_run(out)
            save_tokenizer(data.tokenizer, out / "tokenizer.json")
            ck.write_json(out / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION, "name": mc.name,
                                                "model": mc.to_dict(), "train": tc.to_dict(), "data": data.record,
                                                "precision": used, "environment": env})
            write_text(out / "recipe.toml", render_train(tc, used.split(",")[-1]))  # rerun: train --config
        if tc.compile:
            for blk in distributed.blocks(model):
                blk.compile(dynamic=True)
        model = distributed.parallelize(model, d, mode, dtype, tc.expert_parallel)
        opt = make_optimizer(model, tc)
        step, skipped, schedule = 0, 0, None
        if ckpt is not None:
            state = parallel_checkpoint.load(ckpt, model, opt, d)
            step, skipped = int(state["step"]), int(state.get("skipped", 0))  # older checkpoints: none recorded
            schedule = schedule_total(state, stored.get("train", {}))
            data.sampler.set_position(state["data_position"])
            if tc.total_steps > step >= schedule and tc.progress and d.main:
                print(f"extending the finished run from step {step} to {tc.total_steps}: its {schedule}-step "
                      f"schedule is kept at its end (lr at its floor, final sharpness)", file=sys.stderr)
        if d.main:
            if ckpt is not None:
                ck.link_latest_weights(out, ckpt)
            ck.truncate_metrics(out, step)
            (out / "eval.json").unlink(missing_ok=True)  # present again only once this run completes
        d.barrier()
        lp = Loop(tc, model, opt, data.sampler, out, data.validate, data.byte_len, d, lambda: build_model(mc), dtype)
        with StopOnSignal() as stop:
            loop.run(lp, step, stop, skipped, schedule)
        # FSDP: the final evaluation (and the generation of vlm-digits) runs on full weights, as `eval` would
        done = parallel_checkpoint.full_model(model, lp.plain, d) if distributed.is_sharded(model) else lp.raw
        calibration = _calibrate(done, data.sampler, out, d, tc)
        final = data.final(done)
        if calibration is not None:
            final["calibration"] = calibration
        if not math.isfinite(final["val_loss"]):
            raise UserError(f"final validation loss is {final['val_loss']}; the run diverged (checkpoint kept)")
        if d.main:
            ck.write_json(out / "eval.json", {**final, "step": tc.total_steps})
        d.barrier()
    return out


def _calibrate(model: torch.nn.Module, sampler, out: Path, d: Dist, tc: TrainConfig) -> dict | None:
    """An elastic run's last step (ratio_calibration.py): each trained R realised by the inference
    rule on training text; model.safetensors gets the moved shifts, the checkpoint keeps its own."""
    if getattr(model, "ratio_embed", None) is None:
        return None
    ids = ratio_calibration.training_slice(sampler)
    if ids is None:
        return None
    record = ratio_calibration.calibrate(model, ids)
    if d.main:
        ratio_calibration.rewrite_weights(out / "model.safetensors", [r["shift_move"] for r in record["ratios"]])
        if tc.progress:
            print(ratio_calibration.note(record), file=sys.stderr)
    d.barrier()
    return record


def _constraint_note(tc: TrainConfig, mc: ModelConfig) -> str:
    """What --experts-multiple-of cost the compute match (model/match.py), one line."""
    k = match_result(tc).constraint
    return (f"compute match: {mc.concept_experts} concept experts, a multiple of {k['experts_multiple_of']} "
            f"(--experts-multiple-of): matching error {k['error']:.2%} (unconstrained {k['unconstrained_error']:.2%})")


def _precision(tc: TrainConfig, device, resumed: dict | None) -> tuple[str, str, str]:
    """(dtype of this session, the run's precision record, the note printed at the start).

    Without --dtype a resumed run keeps the precision it was trained in (recorded in config.json),
    so a run moved to a machine with another default is not silently switched mid-way. The record
    is the precisions in order of use, e.g. "bf16" or "bf16,fp32" when --dtype changed it."""
    before = (resumed or {}).get("precision")  # runs from before the record: unknown
    last = before.split(",")[-1] if before else None
    default = default_dtype(device)  # bf16 on CUDA and on AMX / AVX512-BF16 CPUs
    if tc.dtype is None and last:
        note = f"precision: {last} (kept from the run being resumed; --dtype fp32|bf16 to change it)"
        if last != default:
            note += f"; this machine's default would be {default}"
        return last, before, note
    dtype = tc.dtype or default
    note = dtype_note(device, dtype, tc.dtype if tc.dtype != default else None)  # a recipe freezes the default
    if last and last != dtype:
        note += f"; the run so far was trained in {before}"
        return dtype, f"{before},{dtype}", note
    return dtype, before or dtype, note


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
