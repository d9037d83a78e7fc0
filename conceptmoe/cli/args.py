"""Argument types shared by the command modules."""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A float flag: nan and inf are refused at parse time, with argparse's one-line error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
