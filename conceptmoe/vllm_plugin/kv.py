"""The concept layers' KV cache in vLLM's paged memory, at concept rate (CONCEPTMOE.md §4).

vLLM groups attention layers by their KV-cache spec; each group gets one block table per request
from its manager, and all groups draw blocks from one pool. ConceptMoE's token-rate layers
(encoder, decoder) keep vLLM's ``FullAttentionSpec``. Its concept layers (times their loops)
declare ``ConceptAttentionSpec``, a spec of its own type, so they form their own group(s), and
``ConceptAttentionManager`` gives that group slots for the request's *concepts*, not its tokens.

Concepts are decided by the model (the router's p >= 0.5) after the scheduler has allocated the
step, so the manager allocates from what it knows: the worker's last report (T tokens processed, C
concepts made; ``feedback.py``) and the request's R. Two rules:

- the safe bound, C + (new tokens): every new token might start a concept. Never short; a prefill
  chunk holds its tokens' worth of slots until decoding uses them up (rows never shrink).
- the estimate (with ``sched.ConceptScheduler``, which ``conceptmoe serve --engine vllm`` loads):
  C + the new tokens at the request's rate, with a margin. A prefill chunk of any size then holds
  about its concepts, admission counts a prompt at concept rate, and the rare step whose concepts
  outrun the estimate is flagged by the model, its output dropped and the request recomputed at
  the safe bound: exact either way.

The model checks every concept it writes against the capacity its request was granted
(``cache.ConceptCache``): nothing is written outside a request's blocks, whatever a report says.

With prefix caching (``prefix.py``) a request's concept row starts with a **lead block** of its
own: its state row and feedback key (the blocks after it may be shared with other requests), its
concepts in the blocks after it. Without, the first concept block is both.
``max_memory_usage_bytes`` (what vLLM's "KV cache size: N tokens" line and its concurrency
estimate use) counts max_model_len / R concepts.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import AttentionSpec

from .feedback import ESTIMATED, HANDLED, shared_table
from .prefix import Hit

logger = logging.getLogger("vllm.conceptmoe")  # under vLLM's logger: its handler and level

# The estimate of a step's concepts (``estimated_slots``): the new tokens at the request's rate,
# times the margin, plus the pad. Short estimates cost a recompute; long ones, memory held.
ESTIMATE_MARGIN, ESTIMATE_PAD = 1.25, 16
RATE_MIN_TOKENS = 64  # a request's own rate counts once it has processed this many tokens
_EPOCHS = itertools.count(1)


@dataclass(frozen=True, kw_only=True)
class ConceptAttentionSpec(AttentionSpec):
    """A concept layer's KV cache: pages like full attention, slots counted in concepts.

    Not a ``FullAttentionSpec`` subclass: ``FullAttentionSpec.merge`` accepts subclasses and would
    fold the concept layers back into the token group."""

    compression: float = 1.0  # the run's R: the expected tokens per concept

    def max_memory_usage_bytes(self, vllm_config) -> int:
        concepts = math.ceil(vllm_config.model_config.max_model_len / self.compression)
        return cdiv(concepts, self.block_size) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        """The worker's block-table row: every token a concept at worst, after the lead block a row
        starts with under prefix caching (``ConceptAttentionManager.lead``)."""
        return cdiv(max_len, self.block_size) + 1


class TableOnly:
    """What vLLM's runner builds for a concept group each step: the group's block table (kernel
    blocks), nothing else. Its token-rate metadata would be thrown away: the model builds the
    concept-rate metadata itself (``ConceptCache.install_metadata``)."""

    __slots__ = ("block_table",)

    def __init__(self, block_table: torch.Tensor) -> None:
        self.block_table = block_table


@functools.cache
def concept_backend(backend: type) -> type:
    """``backend`` (vLLM's attention backend class) with a metadata builder that only passes the
    block table on (``TableOnly``): the runner's per-step build for a concept group costs nothing.
    The layers' kernels (``get_impl_cls``) and KV layout are the backend's own."""
    real = backend.get_builder_cls()

    class ConceptGroupBuilder(real):
        supports_update_block_table = True  # the runner then hands the other concept groups their tables

        def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kwargs):
            return TableOnly(common_attn_metadata.block_table_tensor)

        def update_block_table(self, metadata, blk_table, slot_mapping):
            return TableOnly(blk_table)

    return type(f"Concept{backend.__name__}", (backend,),
                {"get_builder_cls": staticmethod(lambda: ConceptGroupBuilder), "__module__": __name__})


class ConceptAttention(Attention):
    """A concept layer's attention: vLLM's, with a KV spec counted in concepts."""

    def __init__(self, *args, compression: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compression = compression

    def get_attn_backend(self):
        """What vLLM's runner builds the group's metadata with (``concept_backend``); the layer
        itself runs on ``attn_backend``, vLLM's."""
        return concept_backend(self.attn_backend)

    def get_kv_cache_spec(self, vllm_config):
        full = super().get_kv_cache_spec(vllm_config)
        return ConceptAttentionSpec(block_size=full.block_size, num_kv_heads=full.num_kv_heads,
                                    head_size=full.head_size, head_size_v=full.head_size_v, dtype=full.dtype,
                                    kv_quant_mode=full.kv_quant_mode, compression=self.compression)


def concept_slots(num_tokens: int, reported: tuple[int, int] | None) -> int:
    """The safe bound: concept slots a request needs to hold ``num_tokens`` tokens, given its last
    report (T, C): C + (num_tokens - T), at most num_tokens; num_tokens without a usable report."""
    if reported is None:
        return num_tokens
    t, c = reported
    if t <= 0 or c <= 0 or c > t or t > num_tokens:
        return num_tokens
    return min(num_tokens, c + num_tokens - t)


def _estimate_terms() -> tuple[float, int]:
    """(margin factor, pad) of the estimate; ``CONCEPTMOE_VLLM_ESTIMATE="1.25,16"`` sets them."""
    text = os.environ.get("CONCEPTMOE_VLLM_ESTIMATE", "")
    if not text:
        return ESTIMATE_MARGIN, ESTIMATE_PAD
    try:
        margin, pad = text.split(",")
        return float(margin), int(pad)
    except ValueError:
        raise ValueError(f"CONCEPTMOE_VLLM_ESTIMATE must be 'margin,pad' (e.g. '1.25,16'), got {text!r}") from None


def estimated_slots(num_tokens: int, reported: tuple[int, int] | None, rate: float,
                    margin: float = ESTIMATE_MARGIN, pad: int = ESTIMATE_PAD) -> int:
    """Concept slots from an estimate: the reported C, plus the new tokens at the request's rate
    (1/R, or the rate its own tokens so far show, whichever is higher) times ``margin``, plus
    ``pad``; never more than the safe bound."""
    t, c = reported if reported is not None and 0 <= reported[1] <= reported[0] <= num_tokens else (0, 0)
    new = num_tokens - t
    seen = c / t if t >= RATE_MIN_TOKENS else 0.0
    guess = max(1, math.ceil(new * max(rate, seen) * margin) + pad)  # at least one: a step may start one
    return min(concept_slots(num_tokens, reported), c + min(new, guess))


class ConceptAttentionManager(FullAttentionManager):
    """Full attention's manager, its slot counts turned from tokens into concepts.

    By itself it allocates at the safe bound (``concept_slots``): never short. With a scheduler that
    handles the model's flags (``sched.ConceptScheduler`` sets ``estimates``), a step's slots come
    from the estimate (``estimated_slots``), so a prefill chunk holds about its concepts, not its
    tokens; a request whose concepts outrun its estimate is recomputed at the safe bound
    (``safe``). Each allocation grants the request its capacity (``feedback.py``).

    With prefix caching its rows start with the lead block (``lead``), and its hits, shared blocks
    and copies are the concept side's (``prefix.py``); vLLM's token-rate caching of its blocks is off."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # made at start-up, before any request is scheduled; an error here stops vLLM with one line
        self._table = shared_table(self.block_pool.num_gpu_blocks)
        self.estimates = False
        self.rates: dict[str, float] = {}  # request id -> 1/R (the scheduler's, per request)
        self.safe: set[str] = set()  # requests recomputed at the safe bound
        self.boost: dict[str, float] = {}  # requests recomputed at a larger margin (the bound would not fit)
        self.epochs: dict[str, int] = {}
        self._granted: dict[str, tuple[int, int, int, int]] = {}  # the last grant written, per request
        self.margin, self.pad = _estimate_terms()
        self.lead = 1 if self.enable_caching else 0  # blocks before a row's concepts
        self.hits: dict[str, tuple[int, int, int, int]] = {}  # request id -> its prefix hit's T, C, snapshot
        self.chains: dict[str, list] = {}  # request id -> its concept blocks registered so far (prefix.py)

    def _key_block(self, request_id: str):
        """The request's first block (its feedback key), None before it has one."""
        blocks = self.req_to_blocks.get(request_id)
        return blocks[0] if blocks and not blocks[0].is_null else None

    def _report(self, request_id: str) -> tuple[int, int] | None:
        """(T, C) of the request's last report under its epoch, else of its prefix hit (None: neither)."""
        first = self._key_block(request_id)
        got = self._table.report(first.block_id, self.epochs.get(request_id, 0)) if first else None
        hit = self.hits.get(request_id)
        return (hit[:2] if hit else None) if got is None else got[:2]

    def flag(self, request_id: str) -> int:
        return self.flags([request_id])[0]

    def flags(self, request_ids) -> list[int]:
        """The flag of each request's last report (0: none, or not this life's), read at once."""
        ids = list(request_ids)
        firsts = [self._key_block(r) for r in ids]
        held = [i for i, f in enumerate(firsts) if f is not None]
        out = [0] * len(ids)
        if held:
            keys = np.array([firsts[i].block_id for i in held])
            vals, ok = self._table.reports(keys, [self.epochs.get(ids[i], 0) for i in held])
            for i, f, good in zip(held, vals[:, 2].tolist(), ok.tolist()):
                out[i] = f if good else 0
        return out

    def _slots(self, request_id: str, num_tokens: int) -> tuple[int, int]:
        """(slots to hold, the safe bound) for ``num_tokens`` tokens."""
        reported = self._report(request_id)
        bound = concept_slots(num_tokens, reported)
        if not self.estimates or request_id in self.safe:
            return bound, bound
        margin = self.margin * self.boost.get(request_id, 1.0)
        return estimated_slots(num_tokens, reported, self.rate(request_id), margin, self.pad), bound

    def rate(self, request_id: str) -> float:
        """The request's expected concepts a token: 1/R (its own R, else the run's)."""
        return self.rates.get(request_id, 1.0 / self.kv_cache_spec.compression)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks=(), *args,
                                   **kwargs) -> int:
        if not self.req_to_blocks.get(request_id):  # a new life: its hit, if any, is where its concepts start
            self.hits.pop(request_id, None)
            if isinstance(new_computed_blocks, Hit) and new_computed_blocks:
                hit = new_computed_blocks
                self.hits[request_id] = (hit.tokens, hit.concepts, *hit.snapshot)
        slots = self.lead * self.block_size + self._slots(request_id, num_tokens)[0]
        return super().get_num_blocks_to_allocate(request_id, slots, new_computed_blocks, *args, **kwargs)

    def _has_partial_local_hit(self, new_computed_blocks, num_local_computed_tokens: int) -> bool:
        """A hit whose last concept block is partly filled: the request appends there, so it gets a copy."""
        return isinstance(new_computed_blocks, Hit) and bool(new_computed_blocks) and \
            new_computed_blocks.concepts % self.block_size != 0

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks, num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """A hit's concept blocks after a placeholder for the lead block (taken in
        ``allocate_new_blocks``: here it could evict another group's hit, not yet touched)."""
        if not new_computed_blocks:
            return super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                                     num_external_computed_tokens)
        self.block_pool.touch(new_computed_blocks)
        row = self.req_to_blocks[request_id]
        row.extend([self._null_block] * self.lead + list(new_computed_blocks))
        self.num_cached_block[request_id] = len(row)
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            at = self.lead + new_computed_blocks.concepts // self.block_size
            self._partial_hit_reqs[request_id] = (at, new_computed_blocks[-1])

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        slots, bound = self._slots(request_id, num_tokens)
        row = self.req_to_blocks.get(request_id)
        lead = []
        if row and row[0].is_null:  # a hit's lead block
            lead = self.block_pool.get_new_blocks(1)
            row[0] = lead[0]
        held_slots = self.lead * self.block_size + slots
        new = lead + super().allocate_new_blocks(request_id, held_slots, held_slots)
        held = self.req_to_blocks.get(request_id)
        if not held:
            return new
        if request_id not in self.epochs:  # a new life
            self.epochs[request_id] = next(_EPOCHS)
            self.chains.pop(request_id, None)
        capacity = (len(held) - self.lead) * self.block_size
        mode = (ESTIMATED if capacity < bound else 0) | (HANDLED if self.estimates else 0)
        grant = (held[0].block_id, self.epochs[request_id], capacity, mode, self.hits.get(request_id, (0,) * 4)[2:])
        if self._granted.get(request_id) != grant:  # most steps change nothing: no write
            self._table.grant(*grant)
            self._granted[request_id] = grant
        return new

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        """Nothing at allocation: a concept block's prefix is known after the step (``prefix.py``)."""
        self.num_cached_block.setdefault(request.request_id, 0)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids: list[int], block_pool,
                               kv_cache_spec, drop_eagle_block: bool, alignment_tokens: int, *args, **kwargs):
        index = getattr(block_pool, "conceptmoe_prefix", None)
        if index is None:
            return tuple(Hit() for _ in kv_cache_group_ids), 0
        return index.longest(block_hashes, max_length, kv_cache_group_ids, alignment_tokens)

    def pop_blocks_for_free(self, request_id: str):
        first = self._key_block(request_id)
        blocks = super().pop_blocks_for_free(request_id)
        self.epochs.pop(request_id, None)
        self._granted.pop(request_id, None)
        self.hits.pop(request_id, None)
        self.chains.pop(request_id, None)
        if first is not None:
            self._table.clear(first.block_id)
        return blocks

    def forget(self, request_id: str) -> None:
        """The request has finished: drop what the scheduler told about it."""
        self.rates.pop(request_id, None)
        self.safe.discard(request_id)
        self.boost.pop(request_id, None)


def register_spec() -> None:
    """Register the spec and its manager with vLLM (idempotent). The built-in specs first: the
    registry skips them once it is non-empty."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ConceptAttentionSpec, ConceptAttentionManager,
                                 uniform_type_base_spec=ConceptAttentionSpec)
