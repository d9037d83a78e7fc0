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
(``ConceptCache``): nothing is written outside a request's blocks, whatever a report says.
``max_memory_usage_bytes`` (what vLLM's "KV cache size: N tokens" line and its concurrency
estimate use) counts max_model_len / R concepts.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from .feedback import BROKEN, ESTIMATED, HANDLED, OVERFLOW, FeedbackTable, shared_table
from .state import Batch, RequestStates, host, on

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
    (``safe``). Each allocation grants the request its capacity (``feedback.py``)."""

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

    def _report(self, request_id: str) -> tuple[int, int] | None:
        """(T, C) of the request's last report under its epoch (None: none yet)."""
        blocks = self.req_to_blocks.get(request_id)
        got = self._table.report(blocks[0].block_id, self.epochs.get(request_id, 0)) if blocks else None
        return None if got is None else got[:2]

    def flag(self, request_id: str) -> int:
        return self.flags([request_id])[0]

    def flags(self, request_ids) -> list[int]:
        """The flag of each request's last report (0: none, or not this life's), read at once."""
        ids = list(request_ids)
        held = [i for i, r in enumerate(ids) if self.req_to_blocks.get(r)]
        out = [0] * len(ids)
        if held:
            keys = np.array([self.req_to_blocks[ids[i]][0].block_id for i in held])
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

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens)[0], *args,
                                                  **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        slots, bound = self._slots(request_id, num_tokens)
        new = super().allocate_new_blocks(request_id, slots, min(slots, num_tokens_main_model))
        held = self.req_to_blocks.get(request_id)
        if not held:
            return new
        if request_id not in self.epochs:
            self.epochs[request_id] = next(_EPOCHS)
        capacity = len(held) * self.block_size
        mode = (ESTIMATED if capacity < bound else 0) | (HANDLED if self.estimates else 0)
        grant = (held[0].block_id, self.epochs[request_id], capacity, mode)
        if self._granted.get(request_id) != grant:  # most steps change nothing: no write
            self._table.grant(*grant)
            self._granted[request_id] = grant
        return new

    def pop_blocks_for_free(self, request_id: str):
        blocks = super().pop_blocks_for_free(request_id)
        self.epochs.pop(request_id, None)
        self._granted.pop(request_id, None)
        if blocks:
            self._table.clear(blocks[0].block_id)
        return blocks

    def forget(self, request_id: str) -> None:
        """The request has finished: drop what the scheduler told about it."""
        self.rates.pop(request_id, None)
        self.safe.discard(request_id)
        self.boost.pop(request_id, None)


class ConceptCache:
    """The model's side of the concept cache: concept-rate attention metadata for the concept
    layers, every concept checked against its request's granted capacity, and each request's
    (tokens, concepts, flag) reported to the concept groups' managers."""

    def __init__(self, vllm_config, layers) -> None:
        self.vllm_config, self.layers = vllm_config, layers
        self._builder = None
        self._feedback: FeedbackTable | None = None

    def groups(self, md: dict) -> list[tuple[list[str], torch.Tensor]]:
        """The concept layers grouped by block table (one per vLLM KV-cache group), from vLLM's metadata."""
        out: dict[int, tuple[list[str], torch.Tensor]] = {}
        for attn in self.layers:
            bt = md[attn.layer_name].block_table
            out.setdefault(id(bt), ([], bt))[0].append(attn.layer_name)
        return list(out.values())

    def install_metadata(self, md: dict, groups, counts: list[int], firsts: list[int], c_pos: torch.Tensor) -> None:
        """Concept-rate attention metadata for each concept group, put where vLLM's ``Attention``
        reads it: the requests with new concepts, queries = their new concepts, context = all
        their concepts, slots = the concept positions in the group's blocks (checked against the
        grants first: ``admit``)."""
        ctx = get_forward_context()
        counts = np.asarray(counts, dtype=np.int64)
        live = np.flatnonzero(counts)
        k = counts[live]
        dev, cpos = c_pos.device, host(c_pos)
        qsl = torch.from_numpy(np.concatenate([[0], k.cumsum()]).astype(np.int32))
        seq = torch.from_numpy((np.asarray(firsts, dtype=np.int64)[live] + k).astype(np.int32))
        req = np.repeat(live, k)  # (M,) the batch row of each concept
        kbs = self.layers[0].kv_cache.shape[2]  # kernel block size (CPU: [blocks, G, kbs, 2 Dh])
        cmd = None
        for names, table in groups:
            slots = self._slots(table, req, cpos, kbs, dev)  # (M,)
            bt = table[:live.size] if live.size == len(counts) else table[on(live, table.device)]
            if cmd is None:  # built once: the groups differ in their tables only
                common = CommonAttentionMetadata(
                    query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev),
                    num_reqs=int(live.size), num_actual_tokens=int(cpos.size), max_query_len=int(k.max()),
                    max_seq_len=int(seq.max()), block_table_tensor=bt, slot_mapping=slots, causal=True)
                cmd = self._metadata_builder().build(0, common)
            else:
                cmd = self._retable(cmd, bt, slots)
            for name in names:
                ctx.attn_metadata[name] = cmd
                ctx.slot_mapping[name] = slots

    @staticmethod
    def _slots(table: torch.Tensor, req: np.ndarray, cpos: np.ndarray, kbs: int, dev) -> torch.Tensor:
        """Each concept's slot: its block (a kernel block of ``kbs`` slots) from its request's row of
        ``table``, then its place in that block. On the CPU in numpy on a view of the table; on
        another device there, without copying the table to the host."""
        if table.device.type == "cpu":
            return on(table.numpy()[req, cpos // kbs].astype(np.int64) * kbs + cpos % kbs, dev)
        pos = on(cpos, table.device)
        return table[on(req, table.device), pos // kbs].long() * kbs + pos % kbs

    def _retable(self, cmd, table: torch.Tensor, slots: torch.Tensor):
        """``cmd`` for another concept group: its block table and slots. The backends the concept
        layers run on (``refuse.TESTED_BACKENDS``) keep nothing else that depends on them."""
        builder = self._metadata_builder()
        if builder.supports_update_block_table:
            return builder.update_block_table(cmd, table, slots)
        cmd = copy.copy(cmd)
        cmd.block_table, cmd.slot_mapping = table, slots
        return cmd

    def _metadata_builder(self):
        if self._builder is None:
            layer = self.layers[0]
            spec = layer.get_kv_cache_spec(self.vllm_config)
            names = [a.layer_name for a in self.layers]
            device = layer.kv_cache.device
            self._builder = layer.attn_backend.get_builder_cls()(spec, names, self.vllm_config, device)
        return self._builder

    def _keys(self, table: torch.Tensor, n: int) -> np.ndarray:
        """The feedback keys of the first ``n`` requests: their first block, in the scheduler's units."""
        kbs = self.layers[0].kv_cache.shape[2]
        per_block = max(1, self.vllm_config.cache_config.block_size // kbs)  # kernel blocks per block
        return host(table[:n, 0]) // per_block

    def grants(self, groups, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per concept group, the first ``n`` requests' feedback keys (n,) and grants (n, 3: epoch,
        capacity, mode); the keys are the report's too."""
        table = self.feedback_table()
        keys = [self._keys(bt, n) for _, bt in groups]
        return keys, [table.grants(k) for k in keys]

    def admit(self, grants: list[np.ndarray], firsts: list[int], counts: list[int]) -> np.ndarray:
        """(n,) the step's flag per request: 0, or the requests whose concepts would pass their
        capacity in some group (OVERFLOW under an estimated grant, BROKEN under a bound one or no
        grant). A flagged request's concepts are not written (the caller drops them). Where the
        scheduler does not handle flags, a short grant raises: vLLM stops rather than serve it."""
        need = np.asarray(firsts, dtype=np.int64) + np.asarray(counts, dtype=np.int64)
        flags = np.zeros(len(counts), dtype=np.int64)
        for g in grants:
            short = (g[:, 0] <= 0) | (need > g[:, 1])
            short &= np.asarray(counts) > 0
            flags[short] = np.maximum(flags[short], np.where(g[short, 2] & ESTIMATED, OVERFLOW, BROKEN))
            unhandled = short & ((g[:, 2] & HANDLED) == 0)
            if unhandled.any():
                r = int(np.nonzero(unhandled)[0][0])
                raise RuntimeError(f"ConceptMoE in vLLM: a request made {need[r]} concepts where its blocks hold "
                                   f"{g[r, 1]} slots (grant epoch {g[r, 0]}); refusing to write outside its blocks")
        for r in np.nonzero(flags == BROKEN)[0]:
            logger.error("ConceptMoE in vLLM: request in batch row %d needs %d concept slots but was granted %d; "
                         "nothing written, the request is ended", r, need[r], min(int(g[r, 1]) for g in grants))
        return flags

    def report(self, keys: list[np.ndarray], grants: list[np.ndarray], batch: Batch, states: RequestStates,
               flags) -> None:
        """(epoch, tokens, concepts, flag) of every request, for the concept groups' managers."""
        table = self.feedback_table()
        concepts = states.concepts.numpy()[batch.rows]
        tokens = np.array(batch.done) + np.array(batch.ends) - np.array(batch.starts)
        for k, g in zip(keys, grants):
            table.report_many(k, g[:, 0], tokens, concepts, flags)

    def feedback_table(self) -> FeedbackTable:
        """The table the engine's scheduler made (``feedback.py``); an error if it cannot be opened."""
        if self._feedback is None:
            backend = self.vllm_config.parallel_config.distributed_executor_backend
            engine = os.getppid() if backend == "mp" else os.getpid()
            self._feedback = FeedbackTable(engine, self.layers[0].kv_cache.shape[0])
        return self._feedback


def register_spec() -> None:
    """Register the spec and its manager with vLLM (idempotent). The built-in specs first: the
    registry skips them once it is non-empty."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ConceptAttentionSpec, ConceptAttentionManager,
                                 uniform_type_base_spec=ConceptAttentionSpec)
