"""Which device a command runs on (``--device auto|cpu|cuda[:N]``). Shared by every part of the
package, like ``errors``."""

from __future__ import annotations

import torch

from .errors import UserError


def resolve_device(name: str | None) -> torch.device:
    """``auto`` picks CUDA when available; asking for CUDA without it is a UserError."""
    name = name or "auto"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"--device must be auto, cpu or cuda (got {name!r})")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda requested but CUDA is not available")
    return torch.device(name)
