"""The concept layers' KV cache in vLLM's paged memory, at concept rate (CONCEPTMOE.md §4).

vLLM groups attention layers by their KV-cache spec; each group gets one block table per request
from its manager, and all groups draw blocks from one pool. ConceptMoE's token-rate layers
(encoder, decoder) keep vLLM's ``FullAttentionSpec``. Its concept layers (times their loops)
declare ``ConceptAttentionSpec``, a spec of its own type, so they form their own group(s), and
``ConceptAttentionManager`` gives that group slots for the request's *concepts*, not its tokens.

Concepts are decided by the model (the router's p >= 0.5), so the scheduler cannot know them in
advance. The worker reports, per request, the tokens it has processed T and the concepts they
made C (``FeedbackTable``: a small shared-memory table, written by the model after each forward
and read by the manager before the next schedule; vLLM on CPU schedules synchronously). Before a
step that feeds ``num_tokens - T`` new tokens the manager makes room for
``C + (num_tokens - T)`` concepts (every new token might start one), never more than
``num_tokens``. Without a report (a new request, or a table that cannot be opened) it allocates at
token rate: always room enough, never wrong, only larger. Rows never shrink (the worker appends
block ids), so a request holds at most one prefill chunk of slack (its surplus over the concepts
the chunk made); ``long_prefill_token_threshold`` bounds that chunk (``conceptmoe serve --engine
vllm`` sets ``launch.CONCEPT_PREFILL_CHUNK`` for a ConceptMoE unless told otherwise).

The table is keyed by the request's first concept block (unique while the request holds it); the
manager clears a request's entry when its blocks are freed (finish, abort, preemption), so a
block's next owner starts at token rate. ``max_memory_usage_bytes`` (what vLLM's "KV cache size:
N tokens" line and its concurrency estimate use) counts max_model_len / R concepts.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from .state import Batch, RequestStates

FEEDBACK_DIR = Path(os.environ.get("CONCEPTMOE_VLLM_FEEDBACK_DIR", "/dev/shm" if Path("/dev/shm").is_dir()
                                   else tempfile.gettempdir()))


@dataclass(frozen=True, kw_only=True)
class ConceptAttentionSpec(AttentionSpec):
    """A concept layer's KV cache: pages like full attention, slots counted in concepts.

    Not a ``FullAttentionSpec`` subclass: ``FullAttentionSpec.merge`` accepts subclasses and would
    fold the concept layers back into the token group."""

    compression: float = 1.0  # the run's R: the expected tokens per concept

    def max_memory_usage_bytes(self, vllm_config) -> int:
        concepts = math.ceil(vllm_config.model_config.max_model_len / self.compression)
        return cdiv(concepts, self.block_size) * self.page_size_bytes


class ConceptAttention(Attention):
    """A concept layer's attention: vLLM's, with a KV spec counted in concepts."""

    def __init__(self, *args, compression: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compression = compression

    def get_kv_cache_spec(self, vllm_config):
        full = super().get_kv_cache_spec(vllm_config)
        return ConceptAttentionSpec(block_size=full.block_size, num_kv_heads=full.num_kv_heads,
                                    head_size=full.head_size, head_size_v=full.head_size_v, dtype=full.dtype,
                                    kv_quant_mode=full.kv_quant_mode, compression=self.compression)


class FeedbackTable:
    """(tokens processed T, concepts C) per key, in a file both engine processes map.

    The key is a block id (the request's first concept block, in the scheduler's block units).
    The file is named after the EngineCore process, which holds the scheduler and is the parent of
    the model's worker process (vLLM's "mp" executor; the "uni" executor runs it inside)."""

    def __init__(self, engine_pid: int, num_blocks: int, fresh: bool = False) -> None:
        """``fresh``: zero it (the scheduler's side, before any request runs: a file left by an
        earlier process of the same pid must not be read as reports)."""
        self.path = FEEDBACK_DIR / f"conceptmoe-vllm-{engine_pid}.feedback"
        self.num_blocks = num_blocks
        size = max(num_blocks, 1) * 2 * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if fresh:
                os.ftruncate(fd, 0)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.table = np.ndarray((max(num_blocks, 1), 2), dtype=np.int64, buffer=self._map)

    def write(self, key: int, tokens: int, concepts: int) -> None:
        self.table[key] = (tokens, concepts)

    def write_many(self, keys: np.ndarray, tokens: np.ndarray, concepts: np.ndarray) -> None:
        self.table[keys, 0], self.table[keys, 1] = tokens, concepts

    def read(self, key: int) -> tuple[int, int]:
        t, c = self.table[key]
        return int(t), int(c)

    def clear(self, key: int) -> None:
        self.table[key] = (0, 0)


def concept_slots(num_tokens: int, reported: tuple[int, int] | None) -> int:
    """Concept slots a request needs to hold ``num_tokens`` tokens, given its last report (T, C):
    C + (num_tokens - T), at most num_tokens; num_tokens without a usable report."""
    if reported is None:
        return num_tokens
    t, c = reported
    if t <= 0 or c <= 0 or c > t or t > num_tokens:
        return num_tokens
    return min(num_tokens, c + num_tokens - t)


class ConceptAttentionManager(FullAttentionManager):
    """Full attention's manager, its slot counts turned from tokens into concepts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._table: FeedbackTable | None = None
        try:  # created before any request is scheduled, so before the worker's first report
            self._table = _shared_table(self.block_pool.num_gpu_blocks)
        except OSError:
            pass

    def _feedback(self) -> FeedbackTable | None:
        return self._table

    def _slots(self, request_id: str, num_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id)
        table = self._feedback()
        if not blocks or table is None:
            return num_tokens
        return concept_slots(num_tokens, table.read(blocks[0].block_id))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        slots = self._slots(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, slots, min(slots, num_tokens_main_model))

    def pop_blocks_for_free(self, request_id: str):
        blocks = super().pop_blocks_for_free(request_id)
        table = self._feedback()
        if blocks and table is not None:
            table.clear(blocks[0].block_id)
        return blocks


class ConceptCache:
    """The model's side of the concept cache: concept-rate attention metadata for the concept
    layers, and each request's (tokens, concepts) reported to the concept groups' managers."""

    def __init__(self, vllm_config, layers) -> None:
        self.vllm_config, self.layers = vllm_config, layers
        self._builder = None
        self._feedback: FeedbackTable | None = None
        self._feedback_failed = False

    def install_metadata(self, md: dict, groups, counts: list[int], firsts: list[int], c_pos: torch.Tensor) -> None:
        """Concept-rate attention metadata for each concept group, put where vLLM's ``Attention``
        reads it: the requests with new concepts, queries = their new concepts, context = all
        their concepts, slots = the concept positions in the group's blocks."""
        ctx = get_forward_context()
        live = [r for r, k in enumerate(counts) if k]
        dev = c_pos.device
        qsl = torch.tensor([0] + [counts[r] for r in live], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq = torch.tensor([firsts[r] + counts[r] for r in live], dtype=torch.int32)
        req = torch.repeat_interleave(torch.tensor(live, device=dev), torch.tensor([counts[r] for r in live],
                                                                                  device=dev))  # (M,)
        for names, table in groups:
            kbs = self.layers[0].kv_cache.shape[2]  # kernel block size (CPU: [blocks, G, kbs, 2 Dh])
            bt = table[torch.tensor(live, device=table.device)]
            slots = table[req, c_pos // kbs].long() * kbs + c_pos % kbs  # (M,)
            common = CommonAttentionMetadata(
                query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), num_reqs=len(live),
                num_actual_tokens=int(c_pos.numel()), max_query_len=max(counts), max_seq_len=int(seq.max()),
                block_table_tensor=bt, slot_mapping=slots, causal=True)
            cmd = self._metadata_builder().build(0, common)
            for name in names:
                ctx.attn_metadata[name] = cmd
                ctx.slot_mapping[name] = slots

    def _metadata_builder(self):
        if self._builder is None:
            layer = self.layers[0]
            spec = layer.get_kv_cache_spec(self.vllm_config)
            names = [a.layer_name for a in self.layers]
            device = layer.kv_cache.device
            self._builder = layer.attn_backend.get_builder_cls()(spec, names, self.vllm_config, device)
        return self._builder

    def report(self, groups, batch: Batch, states: RequestStates) -> None:
        """(tokens, concepts) of every request, for the concept groups' managers (``ConceptAttentionManager``)."""
        table = self._feedback_table()
        if table is None:
            return
        kbs = self.layers[0].kv_cache.shape[2]
        per_block = max(1, self.vllm_config.cache_config.block_size // kbs)  # kernel blocks per block
        concepts = states.concepts[batch.rows].cpu().numpy()
        tokens = np.array(batch.done) + np.array(batch.ends) - np.array(batch.starts)
        for _, bt in groups:
            keys = bt[:len(batch.rows), 0].cpu().numpy() // per_block
            table.write_many(keys, tokens, concepts)

    def _feedback_table(self) -> FeedbackTable | None:
        if self._feedback is None and not self._feedback_failed:
            backend = self.vllm_config.parallel_config.distributed_executor_backend
            engine = os.getppid() if backend == "mp" else os.getpid()
            try:
                self._feedback = FeedbackTable(engine, self.layers[0].kv_cache.shape[0])
            except OSError:
                self._feedback_failed = True
        return self._feedback


_TABLES: dict[int, FeedbackTable] = {}


def _shared_table(num_blocks: int) -> FeedbackTable:
    """This scheduler process's table: zeroed once (several concept groups share it), removed at exit."""
    pid = os.getpid()
    if pid not in _TABLES:
        _TABLES[pid] = table = FeedbackTable(pid, num_blocks, fresh=True)
        atexit.register(lambda: table.path.unlink(missing_ok=True))
    return _TABLES[pid]


def register_spec() -> None:
    """Register the spec and its manager with vLLM (idempotent). The built-in specs first: the
    registry skips them once it is non-empty."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ConceptAttentionSpec, ConceptAttentionManager,
                                 uniform_type_base_spec=ConceptAttentionSpec)
