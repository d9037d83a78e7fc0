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
from ..model.elastic import RatioEmbedding, interp_weights
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


def load_init_weights(model: torch.nn.Module, init: str, device: torch.device | str) -> str | None:
    """Copy the init run's weights into a freshly built model (shapes must match); returns a line
    that says what changed on the way, if anything. An elastic model whose trained ratios differ
    from the init run's takes its ratio-embedding tables re-interpolated onto the new ratios
    (``reinterpolate``); one from a fixed-R run keeps its fresh tables."""
    path = Path(init) / "model.safetensors"
    new = getattr(model, "ratio_embed", None)
    old_ratios = ck.model_config_of(ck.read_run_config(Path(init))).elastic_ratios if new is not None else None
    try:
        if new is None or old_ratios == new.ratios:
            ck.load_weights(model, path, device)
            return None
        # The init run's own tables (or none) stand in while its weights load strictly.
        old = None if old_ratios is None else RatioEmbedding(old_ratios, *_table_shape(new)).to(device)
        model.ratio_embed = old
        try:
            ck.load_weights(model, path, device)
        finally:
            model.ratio_embed = new
        listed = ",".join(f"{r:g}" for r in new.ratios)
        if old is None:
            return f"--init {init}: a fixed-R run; the ratio embedding for --ratios {listed} starts fresh"
        reinterpolate(old, new)
        was = ",".join(f"{r:g}" for r in old_ratios)
        return (f"--init {init}: trained for ratios {was}; its ratio embedding is re-interpolated "
                f"(in log R) onto --ratios {listed}")
    except RuntimeError as e:  # shapes
        raise UserError(f"--init {init}: its weights do not fit this model: {str(e).splitlines()[0]}") from None
    except UserError as e:
        raise UserError(f"--init {init}: its weights do not fit this model (a --set that changes shapes?): {e}") from None


def _table_shape(emb: RatioEmbedding) -> tuple[int, str, float]:
    """(d, mode, design) of a ratio embedding, to build the init run's twin (its init is overwritten)."""
    return emb.router.shape[1] if emb.router is not None else 1, emb.mode, emb.ratios[0]


@torch.no_grad()
def reinterpolate(old: RatioEmbedding, new: RatioEmbedding) -> None:
    """Set ``new``'s tables (rows at its ratios) to what ``old`` serves at those ratios: the
    piecewise-linear interpolation in log R that inference uses, extended past the ends as
    ``--extrapolate`` would (``check_new_ratios`` keeps them within its reach)."""
    w = interp_weights(torch.tensor(new.ratios), torch.tensor(old.ratios)).to(new.shift.device)  # (K', K)
    for name in ("shift", "router", "concept"):
        src, dst = getattr(old, name), getattr(new, name)
        if src is not None and dst is not None:
            dst.copy_(w @ src.float())


def check_new_ratios(init: str, init_model: dict[str, Any], ratios: list[float]) -> None:
    """Refuse --ratios that an --init run cannot start: a plain MoE (no concepts: ``convert`` it
    first), or ratios beyond the reach of its trained ones (``model/elastic.py``: EXTRAPOLATE_FACTOR)."""
    from ..model.config import ModelConfig
    from ..model.elastic import check_ratio

    cfg = ModelConfig.from_dict(init_model)
    if not cfg.is_concept:
        raise UserError(f"--ratios: --init {init} is a plain MoE run (no concepts); convert it first "
                        f"(conceptmoe convert {init} --ratios ...) and start from that")
    if cfg.elastic_ratios is not None:
        why = check_ratio(cfg, ratios, extrapolate=True, flag="--ratios")
        if why:
            raise UserError(f"{why.split(': ', 1)[0]}: --init {init} cannot start them: {why.split(': ', 1)[1]}")
    if not min(ratios) <= cfg.compression_ratio <= max(ratios):
        raise UserError(f"--ratios: --init {init} has the design ratio R={cfg.compression_ratio:g}, which "
                        f"the new ratios must include in their range")
