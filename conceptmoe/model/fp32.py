"""fp32 islands under bf16 autocast (CONCEPTMOE.md §2: the routers, the ratio loss, the dechunk scan).

The parts of the method that hinge on small differences (the MoE router's logits and z-loss, the
chunk router's angles and logits, the ratio loss, the EMA scan, the ratio embedding's
interpolation) compute in fp32 whatever autocast says. Autocast would cast even an upcast matmul
back to bf16, so an island needs both: autocast off and every operand in fp32. ``fp32_island`` is
the one way the model does it; a layout test holds that no other module turns autocast off.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)


def _up(a):
    return a.float() if torch.is_tensor(a) and a.is_floating_point() else a


def fp32_island(fn: Fn) -> Fn:
    """``fn`` with autocast off on its tensors' device and every floating-point tensor argument
    (positional or keyword; None and non-tensors pass as they are) cast to fp32."""

    @functools.wraps(fn)
    def run(*args, **kw):
        dev = next((a.device.type for a in (*args, *kw.values()) if torch.is_tensor(a)), "cpu")
        with torch.autocast(dev, enabled=False):
            return fn(*map(_up, args), **{k: _up(v) for k, v in kw.items()})

    return run  # type: ignore[return-value]
