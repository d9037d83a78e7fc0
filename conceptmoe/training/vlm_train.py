"""Training and evaluation on the vision-language digits task (``--data vlm-digits``, vlm_data.py).

``train_vlm(TrainConfig) -> Path`` is what ``train`` runs for ``data="vlm-digits"``: one
process, AdamW (the same groups and schedule as text training), boundary noise from per-step
uniforms, a run directory like any other (config.json with a ``data`` record, tokenizer.json,
metrics.jsonl, model.safetensors via a checkpoint, eval.json), so ``load_run``, ``generate``
and ``boundaries`` open it. Not supported yet: ``--resume`` from a killed run, torchrun,
grad-accum, bf16.

``evaluate_vlm(model, digits, examples)``: on held-out examples (held-out images only),
one example per row from position 0:
- ``val_loss``: mean next-token cross-entropy over the text positions after the images
  (prompt words and answer, <eos> included; image positions carry no loss);
- ``answer_accuracy``: greedy cached generation from the prompt ("... the digits are") matches
  the whole answer; ``digits_accuracy`` / ``sum_accuracy`` / ``max_accuracy``: each field;
- ``compression``, ``compression_image``, ``compression_text``: realised tokens per concept over
  all, image and text positions (a concept counts in its boundary token's modality).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import UserError
from ..model.lm import build_model
from ..model.vision import image_mask
from . import checkpoint as ck
from .config import TrainConfig, default_out, model_config
from .lock import RunLock, holds_only_lock
from .loop import boundary_uniforms, lr_factor
from .tokenizer import save_tokenizer
from .vlm_data import (EOS, PAD, SEMI, VLM_DATA, Digits, Example, build_tokenizer, collate, eval_examples,
                       load_digits, training_batch)

N_EVAL = 400  # held-out examples in the final evaluation
N_EVAL_DURING = 100  # ... in the periodic validations
EVAL_BATCH = 50


def _optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with train.make_optimizer's groups: decay on matrices (not embeddings), chunk lr mult."""
    groups = {"decay": [], "no_decay": [], "chunk": []}
    for name, p in model.named_parameters():
        key = "chunk" if name.startswith("chunk.") else \
            "decay" if p.dim() >= 2 and not name.startswith(("embed.", "vision.pos")) else "no_decay"
        groups[key].append(p)
    spec = [("decay", tc.weight_decay, 1.0), ("no_decay", 0.0, 1.0), ("chunk", 0.0, tc.chunk_lr_mult)]
    return torch.optim.AdamW([{"params": groups[n], "weight_decay": wd, "lr_mult": m, "lr": tc.lr * m}
                              for n, wd, m in spec if groups[n]], lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def _check_out(tc: TrainConfig, out: Path) -> None:
    if tc.resume:
        raise UserError(f"--resume is not supported for --data {VLM_DATA} yet; rerun with --force")
    if ck.is_run(out) and not tc.force:
        raise UserError(f"{out} already holds a run; use --force to replace it")
    if not ck.is_run(out) and not holds_only_lock(out) and not tc.force:
        raise UserError(f"{out} is not empty and holds no run; choose another --out or pass --force")


def train_vlm(tc: TrainConfig) -> Path:
    mc = model_config(tc)
    if not mc.image_size:
        raise UserError(f"--data {VLM_DATA} needs a model with images: --preset vlm (or --set image_size=8)")
    if tc.parallel or tc.grad_accum != 1 or tc.expert_parallel != 1 or tc.dtype == "bf16":
        raise UserError(f"--data {VLM_DATA} trains on one process in fp32 (no --parallel, --grad-accum, bf16)")
    out = Path(tc.out) if tc.out else default_out(tc, mc)
    dev = ck.resolve_device(tc.device)
    digits = load_digits()
    tok = build_tokenizer()
    if tok.get_vocab_size() > mc.vocab_size:
        raise UserError(f"the digits vocabulary ({tok.get_vocab_size()}) exceeds the model's vocab_size")
    with RunLock(out):
        _check_out(tc, out)
        if tc.force:
            ck.remove_run(out)
        save_tokenizer(tok, out / "tokenizer.json")
        ck.write_json(out / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION, "name": mc.name,
                                            "model": mc.to_dict(), "train": tc.to_dict(), "data": digits.record()})
        torch.manual_seed(tc.seed)
        model = build_model(mc).to(dev)
        opt = _optimizer(model, tc)
        held_out = eval_examples(digits, N_EVAL, mc.n_patches)
        _loop(tc, model, opt, digits, held_out[:N_EVAL_DURING], out, dev)
        final = evaluate_vlm(model, digits, held_out, dev)
        if not math.isfinite(final["val_loss"]):
            raise UserError(f"final validation loss is {final['val_loss']}; the run diverged")
        ck.write_json(out / "eval.json", {**final, "step": tc.total_steps})
    return out


def _loop(tc: TrainConfig, model, opt, digits: Digits, val: list[Example], out: Path, dev) -> None:
    total, concept = tc.total_steps, model.cfg.is_concept
    warmup = tc.warmup_steps if tc.warmup_steps is not None else max(1, total // 20)
    eval_every = tc.eval_every if tc.eval_every is not None else max(1, total // 10)
    model.train()
    bar = tqdm(total=total, desc=out.name, unit="step", disable=not tc.progress, dynamic_ncols=True, mininterval=1.0)
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(total):
            t0 = time.perf_counter()
            factor = lr_factor(step, total, warmup, tc.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = tc.lr * g["lr_mult"] * factor
            b = training_batch(digits, tc.seed, step, tc.batch_size, tc.seq_len, model.cfg.n_patches)
            kw = {"boundary_noise": boundary_uniforms(tc.seed, step, tuple(b.ids.shape)).to(dev)} if concept else {}
            res = model(b.ids.to(dev), labels=b.labels.to(dev), pixel_values=b.pixel_values.to(dev), **kw)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
            loss = float(res.loss.detach())
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise UserError(f"training diverged at step {step + 1}; lower --lr")
            opt.step()
            row = {"step": step + 1, "loss": loss, "lr": tc.lr * factor, "grad_norm": gnorm,
                   "tokens": (step + 1) * b.ids.numel(),
                   **{k: float(v.detach()) if torch.is_tensor(v) else float(v)
                      for k, v in res.aux.items() if k != "boundary_prob"}}
            row["tokens_per_s"] = b.ids.numel() / (time.perf_counter() - t0)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == total):
                v = evaluate_vlm(model, digits, val, dev, generate=False)
                row.update({f"val_{k}" if not k.startswith("val_") else k: x for k, x in v.items()})
                model.train()
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", comp=f"{row['compression']:.2f}", refresh=False)
    bar.close()
    ck.save_checkpoint(out, model, opt, {"step": total, "data_position": {"step": total}})


@torch.no_grad()
def evaluate_vlm(model, digits: Digits, examples: list[Example], device=None,
                 generate: bool = True) -> dict[str, float]:
    """Held-out text loss, answer accuracy (greedy, cached) and compression per modality."""
    device = device or next(model.parameters()).device
    was = model.training
    model.eval()
    nll, n_text, n_b, n_pos = 0.0, 0, 0, 0
    counts = {"image": [0, 0], "text": [0, 0]}
    right = {"answer": 0, "digits": 0, "sum": 0, "max": 0}
    for i in range(0, len(examples), EVAL_BATCH):
        group = examples[i:i + EVAL_BATCH]
        b = collate([(ex.ids, ex.images) for ex in group], digits)
        ids, pix = b.ids.to(device), b.pixel_values.to(device)
        out = model(ids, pixel_values=pix)
        target = b.labels[:, 1:].to(device).masked_fill(image_mask(model.cfg, ids)[:, 1:], -100)
        nll += F.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), target, ignore_index=-100,
                               reduction="sum").item()
        n_text += int((target != -100).sum())
        valid = (torch.arange(ids.shape[1], device=device)[None] < b.lengths.to(device)[:, None])
        if out.boundaries is not None:
            bnd = out.boundaries & valid
            n_b, n_pos = n_b + int(bnd.sum()), n_pos + int(valid.sum())
            for k, (pos, conc) in _modality_counts(image_mask(model.cfg, ids), bnd, valid).items():
                counts[k][0] += pos
                counts[k][1] += conc
        if generate:
            for k, v in _answers(model, digits, group, device).items():
                right[k] += v
    model.train(was)
    res = {"val_loss": nll / max(n_text, 1), "text_tokens": n_text, "examples": len(examples),
           "compression": n_pos / n_b if n_b else 1.0}
    for k, (pos, conc) in counts.items():
        res[f"compression_{k}"] = pos / conc if conc else 1.0
    if generate:
        res.update({f"{k}_accuracy": v / len(examples) for k, v in right.items()})
    return res


def evaluate_vlm_run(run_dir: str | Path, device: str = "auto") -> dict[str, float]:
    """``evaluate_vlm`` of a trained vlm-digits run on the fixed held-out examples."""
    model, cfg, _, _ = ck.load_run(run_dir, device)
    digits = load_digits()
    return evaluate_vlm(model, digits, eval_examples(digits, N_EVAL, cfg.n_patches))


def _modality_counts(img: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> dict[str, tuple[int, int]]:
    """(positions, concepts) per modality; a concept counts in its boundary token's modality."""
    return {k: (int(where.sum()), int((b & where).sum()))
            for k, where in (("image", img & valid), ("text", ~img & valid))}


def _answers(model, digits: Digits, group: list[Example], device) -> dict[str, int]:
    """Greedy cached generation from each prompt; counts of right answers and fields."""
    lens = [len(ex.prompt) for ex in group]
    T = max(lens)
    ids = torch.full((len(group), T), PAD, dtype=torch.long)
    for r, ex in enumerate(group):
        ids[r, :lens[r]] = torch.tensor(ex.prompt)
    mask = (torch.arange(T)[None] < torch.tensor(lens)[:, None]).long()
    pix = collate([(ex.prompt, ex.images) for ex in group], digits).pixel_values
    n_new = max(len(ex.answer) for ex in group) + 2
    gen = model.generate(ids.to(device), n_new, temperature=0, eos_token_id=EOS,
                         attention_mask=mask.to(device), pixel_values=pix.to(device))[:, T:].tolist()
    right = {"answer": 0, "digits": 0, "sum": 0, "max": 0}
    for ex, g in zip(group, gen):
        got = g[:g.index(EOS) + 1] if EOS in g else g
        right["answer"] += got == ex.answer
        for k, w, h in zip(("digits", "sum", "max"), _fields(ex.answer), _fields(got)):
            right[k] += w == h
    return right


def _fields(ans: list[int]) -> list[tuple[int, ...]]:
    """The answer's three fields (listed digits; sum; max) as token tuples, split at ';'."""
    parts, cur = [], []
    for t in ans:
        if t in (SEMI, EOS):
            parts.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return (parts + [(), (), ()])[:3]


def log_line(res: dict) -> str:
    """One line of the final numbers (CLI)."""
    return (f"held-out text loss {res['val_loss']:.4f}, answer accuracy {res.get('answer_accuracy', float('nan')):.3f}, "
            f"compression image {res['compression_image']:.2f} / text {res['compression_text']:.2f}")
