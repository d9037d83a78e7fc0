"""Argument types shared by the command modules."""

from __future__ import annotations

import argparse
import math

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


def seed(text: str) -> int:
    """A seed flag: an integer in [0, MAX_SEED], refused at parse time otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}], got {text}")
    return value
