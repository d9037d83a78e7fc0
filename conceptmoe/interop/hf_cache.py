"""``ConceptMoECache``: our concept-level inference state as a transformers ``Cache`` (CONCEPTMOE.md §4).

transformers' ``generate()`` keeps whatever the model returns as ``output.cache`` and hands it
back on the next step. Its own caches (``DynamicCache``) hold one K/V tensor pair per layer,
padded on the left; ours is ragged (every row has its own token count and concept count, see
``inference/cache.py``) and also holds the chunk router's last key and the dechunk EMA state z.
So this class is a thin holder of our ``InferenceState`` (``state``) plus the number of input
columns consumed so far (``seen``, left padding included: what ``generate`` slices new tokens by).
The model (``hf_model.py``) declines transformers' default cache
(``_supports_default_dynamic_cache`` is False) and builds this one in its first forward.

Beam search works: ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
pick rows of every tensor, ragged length and per-row list. Rolling back (``crop``, used by
assisted decoding) is refused: a concept step cannot be undone cheaply.

Shape legend: B batch rows.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.cache_utils import Cache

from ..inference.cache import InferenceState, KVCache


def select_rows(obj, idx: torch.Tensor, batch: int):
    """``obj`` (inference state or a part of it) restricted to rows ``idx`` (new batch = len(idx))."""
    rows = idx.tolist()
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, idx.to(obj.device))
    if isinstance(obj, KVCache):  # k/v are lists over layers, lengths a list over rows
        return dataclasses.replace(obj, k=[t.index_select(0, idx.to(t.device)) for t in obj.k],
                                   v=[t.index_select(0, idx.to(t.device)) for t in obj.v],
                                   lengths=[obj.lengths[r] for r in rows])
    if dataclasses.is_dataclass(obj):  # every field, so fields added later are carried too
        return dataclasses.replace(obj, **{f.name: select_rows(getattr(obj, f.name), idx, batch)
                                           for f in dataclasses.fields(obj)})
    if isinstance(obj, list) and len(obj) == batch:  # per-row lists (boundaries)
        return [copy.deepcopy(obj[r]) for r in rows]
    return obj


class ConceptMoECache(Cache):
    """Holds an ``InferenceState`` between ``generate`` steps; see the module docstring."""

    def __init__(self, state: InferenceState | None = None, seen: int = 0) -> None:
        super().__init__(layers=[])
        self.state = state
        self.seen = seen  # input columns consumed (padding included)

    def __repr__(self) -> str:
        if self.state is None:
            return "ConceptMoECache(empty)"
        return (f"ConceptMoECache(seen={self.seen}, tokens={self.state.tokens.lengths}, "
                f"concepts={self.state.concept_counts()})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.batch

    # transformers asks these of every cache; ours is one non-linear, non-sliding, growing store
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def _select(self, idx: torch.Tensor) -> None:
        if self.state is not None:
            self.state = select_rows(self.state, idx.long(), self.state.batch)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i of the new state is row ``beam_idx[i]`` of the old one."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self._select(torch.arange(self.state.batch).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ConceptMoECache cannot roll back decoded tokens (concept steps and the "
                                  "dechunk EMA are not undone); assisted decoding is not supported")

    def update(self, *args, **kwargs):
        raise NotImplementedError("ConceptMoECache is filled by conceptmoe's prefill/decode_step, not per layer")
