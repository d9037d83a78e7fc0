"""The model's side of the concept cache in vLLM (CONCEPTMOE.md §4; the scheduler's side is ``kv.py``):
concept-rate attention metadata for the concept layers, every concept checked against its
request's granted capacity, each request's (tokens, concepts, flag) reported to the concept
groups' managers, and, with prefix caching, the snapshots a prefix hit starts from (``prefix.py``).
"""

from __future__ import annotations

import copy
import logging
import os

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from .feedback import BROKEN, ESTIMATED, HANDLED, OVERFLOW, FeedbackTable
from .state import Batch, RequestStates, block_ends, host, inner_states, on

logger = logging.getLogger("vllm.conceptmoe")  # under vLLM's logger: its handler and level


class ConceptCache:
    """The model's side of the concept cache: concept-rate attention metadata for the concept
    layers, every concept checked against its request's granted capacity, and each request's
    (tokens, concepts, flag) reported to the concept groups' managers."""

    def __init__(self, vllm_config, layers) -> None:
        self.vllm_config, self.layers = vllm_config, layers
        self._builder = None
        self._feedback: FeedbackTable | None = None
        caching = vllm_config is not None and vllm_config.cache_config.enable_prefix_caching
        self.lead = 1 if caching else 0  # blocks before a row's concepts (kv.py)
        self._states: RequestStates | None = None  # per request, a row per block
        self._snaps: RequestStates | None = None  # per token prefix, a row per block (its last token block)

    def states(self, h: torch.Tensor) -> RequestStates:
        """The requests' state rows (made at the first step)."""
        if self._states is None:
            blocks, device = self.layers[0].kv_cache.shape[0], self.layers[0].kv_cache.device
            self._states = RequestStates.empty(blocks, h.shape[1], h.dtype, device)
            if self.lead:
                self._snaps = RequestStates.empty(blocks // self._per_block(), h.shape[1], h.dtype, device)
        return self._states

    def _per_block(self) -> int:
        """Kernel blocks per block (vLLM may split a block for its kernels)."""
        kbs = self.layers[0].kv_cache.shape[2]  # kernel block size (CPU: [blocks, G, kbs, 2 Dh])
        return max(1, self.vllm_config.cache_config.block_size // kbs)

    def _token_blocks(self, token_table: torch.Tensor, req: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The ids (in blocks) of the token blocks ``index`` of batch rows ``req``: a snapshot's row and key."""
        per = self._per_block()
        return host(token_table)[req, index * per].astype(np.int64) // per

    def begin(self, groups, batch: Batch, states: RequestStates) -> tuple:
        """The step's feedback keys and grants per concept group, read once; each request's state row
        reset where it starts from its first token, or, where a new life starts after a prefix hit,
        copied from the hit's snapshot (``prefix.py``). The third item: the requests whose snapshot
        is not there (``admit`` flags them BROKEN)."""
        keys, grants = self.grants(groups, len(batch.rows))
        rows, done = np.asarray(batch.rows, dtype=np.int64), np.asarray(batch.done, dtype=np.int64)
        fresh = rows[done == 0]
        if fresh.size:
            states.reset(fresh.tolist())
        lives, known = grants[0][:, 0], states.lives.numpy()
        broken = np.zeros(len(rows), dtype=bool)
        hit = np.flatnonzero((lives > 0) & (known[rows] != lives) & (done > 0))
        if hit.size:  # a new life after a prefix hit: its snapshot's row and writer from the grant
            at, writer = grants[0][hit, 3], grants[0][hit, 4]
            snap, whole = self.feedback_table().snapshots(at)
            good = whole & (snap[:, 0] == writer) & (snap[:, 1] == done[hit]) & (self._snaps is not None)
            broken[hit[~good]] = True
            for r in hit[~good].tolist():
                logger.error("ConceptMoE in vLLM: batch row %d resumes after a prefix hit of %d tokens whose "
                             "snapshot is not there; the request is ended", r, done[r])
            if good.any():
                states.copy_rows(rows[hit[good]], self._snaps, at[good])
        known[rows[lives > 0]] = lives[lives > 0]
        return keys, grants, broken

    def save(self, batch: Batch, bn: np.ndarray, flags: np.ndarray, grants, firsts, keys, z_tok, h, pool0,
             states: RequestStates, token_table: torch.Tensor) -> None:
        """With prefix caching, the snapshot at every token-block end the step's unflagged requests
        reached, in the row of the token block that ends there, and (epoch, T, C) for the scheduler."""
        if self._snaps is None:
            return
        lives, block = grants[0][:, 0], self.vllm_config.cache_config.block_size
        req, t = block_ends(batch, block, (flags != 0) | (lives <= 0))
        if not req.size:
            return
        at = self._token_blocks(token_table, req, t // block - 1)
        rows = np.asarray(batch.rows, dtype=np.int64)
        last = t == (np.asarray(batch.done) + np.asarray(batch.ends) - np.asarray(batch.starts))[req]
        snaps = self._snaps
        snaps.copy_rows(at[last], states, rows[req[last]])  # where the step ends: its own state
        inner = ~last
        if inner.any():
            c, key, z, pool = inner_states(req[inner], t[inner], batch, bn, np.asarray(firsts, dtype=np.int64),
                                           keys, z_tok, h, pool0)
            dst = on(at[inner], snaps.z.device)
            snaps.concepts.numpy()[at[inner]] = c
            snaps.z[dst] = z.to(snaps.z.dtype)
            if key is not None:
                snaps.last_key[dst] = key
            if pool is not None:
                snaps.pool_sum[dst], snaps.pool_count[dst] = pool[0].to(snaps.pool_sum.dtype), pool[1]
        self.feedback_table().snapshot_many(at, lives[req], t, snaps.concepts.numpy()[at])

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
        lead = self.lead * self._per_block()  # kernel blocks before a row's concepts
        cmd = None
        for names, table in groups:
            slots = self._slots(table, req, cpos + lead * kbs, kbs, dev)  # (M,)
            table = table[:, lead:].contiguous() if lead else table  # the attention reads concepts only
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
        return host(table[:n, 0]) // self._per_block()

    def grants(self, groups, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per concept group, the first ``n`` requests' feedback keys (n,) and grants (n, 5: epoch,
        capacity, mode, a prefix hit's snapshot row and writer); the keys are the report's too."""
        table = self.feedback_table()
        keys = [self._keys(bt, n) for _, bt in groups]
        return keys, [table.grants(k) for k in keys]

    def admit(self, grants: list[np.ndarray], firsts: list[int], counts: list[int], broken: np.ndarray) -> np.ndarray:
        """(n,) the step's flag per request: 0, or the requests whose concepts would pass their
        capacity in some group (OVERFLOW under an estimated grant, BROKEN under a bound one or no
        grant), and ``broken`` ones (a prefix hit without its snapshot: BROKEN). A flagged request's
        concepts are not written (the caller drops them). Where the scheduler does not handle flags,
        a short grant raises: vLLM stops rather than serve it."""
        need = np.asarray(firsts, dtype=np.int64) + np.asarray(counts, dtype=np.int64)
        flags = np.where(broken, BROKEN, 0).astype(np.int64)
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
