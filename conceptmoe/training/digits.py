"""Training and evaluation on the vision-language digits task (``--data vlm-digits``, data/digits.py).

``vlm_data(tc, mc, stored)`` is what ``train`` uses for ``data="vlm-digits"``: the tokenizer,
a resumable sampler (global batch k is a pure function of (seed, k)), the periodic and final
evaluation below, and the data record. Training itself is the ordinary loop (``loop.py``), so
checkpoints, ``--resume``, signals, divergence checks, torchrun and grad-accum all apply.

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


import torch
import torch.nn.functional as F

from ..errors import UserError
from ..model.config import ModelConfig
from ..model.vision import image_mask
from .config import TrainConfig
from ..data.corpus import check_record
from .loop import TaskData
from ..data.tokenizer import byte_lengths
from ..data.digits import (
    EOS,
    IMAGE,
    PAD,
    SEMI,
    VLM_DATA,
    Digits,
    Example,
    build_tokenizer,
    collate,
    eval_examples,
    load_digits,
    training_batch,
)

N_EVAL = 400  # held-out examples in the final evaluation
N_EVAL_DURING = 100  # ... in the periodic validations
EVAL_BATCH = 50


class DigitsSampler:
    """Global batch ``k`` of the digits task, a pure function of (seed, k): resumable anywhere."""

    def __init__(self, digits: Digits, seed: int, batch_size: int, seq_len: int, n_patches: int) -> None:
        self.digits, self.seed, self.batch_size, self.seq_len, self.n_patches = \
            digits, seed, batch_size, seq_len, n_patches
        self.step = 0

    @property
    def position(self) -> dict[str, int]:
        return {"step": self.step}

    def set_position(self, pos: dict[str, int]) -> None:
        self.step = int(pos["step"])

    def next(self) -> dict[str, torch.Tensor]:
        b = training_batch(self.digits, self.seed, self.step, self.batch_size, self.seq_len, self.n_patches)
        self.step += 1
        real = torch.arange(b.ids.shape[1])[None] < b.lengths[:, None]  # (B, T): not padding
        # labels: the predicted (text) tokens only, so that the loop can weight micro-batches by them
        return {"input_ids": b.ids, "labels": b.labels.masked_fill(b.ids == IMAGE, -100), "pixel_values": b.pixel_values,
                "attention_mask": real.long()}


def vlm_data(tc: TrainConfig, mc: ModelConfig, stored: dict | None) -> TaskData:
    """The digits task for ``train`` (its ordinary loop: checkpoints, resume, signals, torchrun)."""
    if not mc.image_size:
        raise UserError(f"--data {VLM_DATA} needs a model with images: --preset vlm (or --set image_size=8)")
    digits = load_digits()
    if stored is not None:
        check_record(stored.get("data"), digits.record())
    tok = build_tokenizer()
    if tok.get_vocab_size() > mc.vocab_size:
        raise UserError(f"the digits vocabulary ({tok.get_vocab_size()}) exceeds the model's vocab_size")
    held_out = eval_examples(digits, N_EVAL, mc.n_patches)

    def validate(model) -> dict[str, float]:
        v = evaluate_vlm(model, digits, held_out[:N_EVAL_DURING], generate=False)
        return {k if k.startswith("val_") else f"val_{k}": x for k, x in v.items()}

    note = (f"data {VLM_DATA}: {len(digits.train_idx)} training / {len(digits.val_idx)} held-out images; "
            f"final evaluation on {N_EVAL} held-out examples")
    return TaskData(tok, DigitsSampler(digits, tc.seed, tc.batch_size, tc.seq_len, mc.n_patches), digits.record(),
                    byte_lengths(tok, mc.vocab_size), validate, lambda model: evaluate_vlm(model, digits, held_out),
                    note)


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
