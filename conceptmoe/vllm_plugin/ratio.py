"""Per-request R for an elastic ConceptMoE in vLLM: ``"vllm_xargs": {"concept_ratio": 3}``.

vLLM passes a request's ``vllm_xargs`` to its ``SamplingParams.extra_args`` and hands those to
logits processors, not to the model. So the ratio travels through one: ``ConceptRatio`` is a
logits processor that changes no logits (argmax-invariant; ``apply`` returns them as they are). Its
parts:

- ``validate_params`` runs in the API server at admission: a bad ``concept_ratio`` gets HTTP 400
  with the message every other entry point gives (``model/elastic.py``'s ``check_ratio``). The
  served model's config is read from ``CONCEPTMOE_VLLM_MODEL`` (the export folder), which
  ``conceptmoe serve --engine vllm`` sets; without it every ``concept_ratio`` is refused, since it
  cannot be checked.
- ``update_state`` runs in the worker before each forward with the persistent batch's changes;
  it keeps each batch row's R (None: the export's R). The model reads ``row_ratios(n)``: vLLM lays
  the flat batch out in the persistent batch's row order.

Load it with ``--logits-processors conceptmoe.vllm_plugin.ratio:ConceptRatio`` (``serve --engine
vllm`` adds it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ..model.config import ModelConfig
from ..model.elastic import check_ratio
from . import MODEL_ENV

FIELD = "concept_ratio"

_ACTIVE: list["ConceptRatio"] = []  # this worker's instance (one per process)


@lru_cache(maxsize=4)
def _served_config(folder: str) -> ModelConfig | None:
    """The run config of the export in ``folder`` (None: not a ConceptMoE export, e.g. a MoE's)."""
    hf = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    return ModelConfig.from_dict(hf["conceptmoe"]) if "conceptmoe" in hf else None


def check_request_ratio(value, folder: str | None) -> str | None:
    """Why a request's ``concept_ratio`` cannot be served (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"'{FIELD}' must be a number (got {value!r})"
    if not math.isfinite(value):
        return f"'{FIELD}' must be finite (got {value!r})"
    if not folder:
        return f"'{FIELD}' cannot be checked: {MODEL_ENV} does not name the served export"
    cfg = _served_config(folder)
    if cfg is None:
        return f"'{FIELD}' applies to ConceptMoE runs only (this run is a plain MoE)"
    why = check_ratio(cfg, [float(value)], flag=f"'{FIELD}'")
    return why.split("; pass ")[0] if why else None


def request_ratio(params) -> float | None:
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(FIELD)
    return None if value is None else float(value)


class ConceptRatio(LogitsProcessor):
    """Carries each request's ``concept_ratio`` from its ``vllm_xargs`` to the model."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        if extra.get(FIELD) is None:
            return
        why = check_request_ratio(extra[FIELD], os.environ.get(MODEL_ENV))
        if why:
            raise ValueError(why)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.ratios: list[float | None] = []
        _ACTIVE[:] = [self]

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def _put(self, index: int, value: float | None) -> None:
        if index >= len(self.ratios):
            self.ratios.extend([None] * (index + 1 - len(self.ratios)))
        self.ratios[index] = value

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._put(index, None)
        for index, params, _, _ in batch_update.added:
            self._put(index, request_ratio(params))
        for a, b, how in batch_update.moved:
            ra = self.ratios[a] if a < len(self.ratios) else None
            rb = self.ratios[b] if b < len(self.ratios) else None
            self._put(b, ra)
            self._put(a, rb if how == MoveDirectionality.SWAP else None)
        del self.ratios[batch_update.batch_size:]


def row_ratios(n: int) -> list[float | None]:
    """The R of each of the first ``n`` rows of this step's batch (None: the export's R)."""
    if not _ACTIVE:
        return [None] * n
    got = _ACTIVE[0].ratios[:n]
    return got + [None] * (n - len(got))


def repeat_terms(terms, sizes: list[int]):
    """Per-request ratio terms repeated ``sizes[i]`` times for request i (its tokens, or its new concepts)."""
    if terms is None:
        return None
    n = torch.tensor(sizes, dtype=torch.long, device=terms.ratio.device)
    return replace(terms, **{f.name: None if getattr(terms, f.name) is None
                             else getattr(terms, f.name).repeat_interleave(n, 0) for f in fields(terms)})
