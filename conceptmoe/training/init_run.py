"""``train --init RUN``: start a run from another run's weights (continual training, CONCEPTMOE.md §5).

The new run takes the init run's model config (plus ``--set`` overrides that keep the weights'
shapes), its weights and its tokenizer, with a fresh optimizer and a new schedule. The model
config is stored in the new run's train config (``init_model``), so ``--resume`` continues from
the run's own checkpoint and never needs the init run again; the init weights are loaded only
when the run starts (not when it resumes from a checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from . import checkpoint as ck


def resolve_init(init: str, init_model: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """(absolute init path, the init run's model config as a dict); reads the run when not stored."""
    path = Path(init).resolve()
    if init_model is None:
        init_model = ck.model_config_of(ck.read_run_config(path)).to_dict()
        if not (path / "model.safetensors").is_file():
            raise UserError(f"--init {init}: the run holds no model.safetensors")
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"--init {init}: the run holds no tokenizer.json")
    return str(path), init_model


def load_init_weights(model: torch.nn.Module, init: str, device: torch.device | str) -> None:
    """Copy the init run's weights into a freshly built model (shapes must match). A fixed-R run
    may start an elastic one (``--ratios``): the new ratio embedding keeps its fresh init."""
    path = Path(init) / "model.safetensors"
    try:
        if getattr(model, "ratio_embed", None) is not None and path.is_file():
            from safetensors.torch import load_model

            missing, unexpected = load_model(model, str(path), strict=False, device=str(device))
            wrong = sorted(set(missing) - {n for n, _ in model.ratio_embed.named_parameters(prefix="ratio_embed")})
            if wrong or unexpected:
                raise UserError(f"{path} does not match the model (missing {wrong[:3]}, unexpected {sorted(unexpected)[:3]})")
            return
        ck.load_weights(model, path, device)
    except RuntimeError as e:  # shapes
        raise UserError(f"--init {init}: its weights do not fit this model: {str(e).splitlines()[0]}") from None
    except UserError as e:
        raise UserError(f"--init {init}: its weights do not fit this model (a --set that changes shapes?): {e}") from None
