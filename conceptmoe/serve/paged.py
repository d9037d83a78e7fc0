"""Block storage of the server's KV caches: one preallocated page store, block tables per request.

The whole ``--kv-cache-mb`` budget is allocated once, as pages (``PageStore``): a page holds the
K and V of ``block`` entries of *one* layer, (G, block, Dh) each. A token block of a request is
one page per token-rate layer, a concept block one page per concept layer (times loops), both
drawn from the same pages, so token and concept blocks share one budget and a ConceptMoE, whose
concept blocks fill about R times slower, holds more requests in the same bytes (vLLM's block
tables per KV-cache group; ``pool.py`` is the allocator and keeps each request's pages).

``PagedKVCache`` is the running batch's view of one layer group (``kind`` "token" or
"concept"): the requests' ids in row order and their entry counts. It has ``KVCache``'s
interface (``inference/cache.py``), so ``inference/steps.py`` runs on it unchanged: prefill
scatters each row's entries into its pages, a decode step writes one entry per row and attends
over the row's pages gathered in block-table order. Rows join and leave by their ids alone: no
K/V entry is copied when the batch changes. A concept block is taken inside the step whose token
starts a concept (the engine keeps one free per row that may need it); the one row that may lack
it (a lone row, never preempted for headroom) writes nothing, is marked ``overflowed`` and ends.

Shape legend: P pages, G key/value heads, blk entries per block, Dh head dim, n rows stepping,
nb blocks per row, Lk keys.
"""

from __future__ import annotations

import torch

from ..inference.cache import chunk_mask


class PoolExhausted(RuntimeError):
    """A prefill needed more blocks than the pool had free."""


class PageStore:
    """K and V pages (P, blk, G, Dh), allocated once; a free list of page ids. Entries lie before
    heads, so a row's pages gathered in table order are its keys (Lk, G, Dh) without a transpose."""

    def __init__(self, n_pages: int, n_kv: int, head_dim: int, block: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (n_pages, block, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block = block
        # Workspaces the gathered keys and values of one layer are copied into, reused step after
        # step (a fresh tensor each time costs more than the copy: new memory faults in page by page).
        self.work_k = torch.empty(0, dtype=dtype, device=device)
        self.work_v = torch.empty(0, dtype=dtype, device=device)
        self.free = list(range(n_pages - 1, -1, -1))  # a stack: pop() gives low ids first
        self.version = 0  # changes whenever a page is taken or given back (block tables are rebuilt)

    def take(self, n: int) -> list[int]:
        assert n <= len(self.free), "the ledger gave out pages the store does not have"
        self.version += 1
        return [self.free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self.version += 1
        self.free.extend(pages)

    def bytes_allocated(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def workspace_bytes(self) -> int:
        return self.work_k.untyped_storage().nbytes() + self.work_v.untyped_storage().nbytes()


class PagedKVCache:
    """The running rows' K/V of one layer group, stored in the pool's pages (see the module doc)."""

    def __init__(self, pool, kind: int, seqs: list[int], lengths: list[int] | None = None) -> None:
        self.pool, self.kind, self.seqs = pool, kind, list(seqs)  # kind: 0 token layers, 1 concept layers
        self.store: PageStore = pool.store
        self.lengths = list(lengths) if lengths is not None else [0] * len(seqs)
        self.block = self.store.block
        self.overflowed: set[int] = set()  # rows whose last entry had no block (written nowhere)
        self._table, self._version = None, -1

    # --- block tables ----------------------------------------------------------------------------
    def table(self) -> torch.Tensor:
        """(B, n_layers, nb) page ids of every row's blocks (padded with page 0, never read unmasked)."""
        if self._version != self.store.version or self._table is None:
            blocks = [self.pool.pages.get(s, ([], []))[self.kind] for s in self.seqs]
            nb = max(1, max((len(b) for b in blocks), default=1))
            n_layers = self.pool.layout.layers(self.kind)
            t = torch.zeros(len(blocks), nb, n_layers, dtype=torch.long)
            for i, b in enumerate(blocks):
                if b:
                    t[i, :len(b)] = torch.tensor(b, dtype=torch.long)
            self._table = t.transpose(1, 2).to(self.store.k.device)
            self._version = self.store.version
        return self._table

    def _ensure(self, rows: list[int], need: list[int], strict: bool) -> list[int]:
        """Blocks for ``need[i]`` entries of each row in ``rows``; the rows that could not get them
        (``strict``: raise ``PoolExhausted`` instead)."""
        short = []
        for r, n in zip(rows, need):
            if not self.pool.reserve(self.seqs[r], self.kind, n):
                if strict:
                    raise PoolExhausted(f"the KV pool has no free block for request {self.seqs[r]}")
                short.append(r)
        return short

    # --- KVCache's interface -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.table().shape[2] * self.block

    def put_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: write entries [0, lengths[b]) of each row b from k/v (B, G, T, Dh)."""
        B = len(self.seqs)
        if layer == 0:
            self._ensure(list(range(B)), self.lengths, strict=True)
        lens = torch.tensor(self.lengths, device=k.device)
        T = k.shape[2]
        valid = torch.arange(T, device=k.device)[None] < lens[:, None]  # (B, T)
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        pages = self.table()[b_idx, layer, t_idx // self.block]
        offs = t_idx % self.block
        self.store.k[pages, offs] = k[b_idx, :, t_idx].to(self.store.k.dtype)
        self.store.v[pages, offs] = v[b_idx, :, t_idx].to(self.store.v.dtype)

    def put_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, n: list[int]) -> None:
        """Chunked prefill: write the first n[b] positions of k/v (B, G, T, Dh) after row b's entries."""
        if layer == 0:
            self._ensure(list(range(len(self.seqs))), [a + c for a, c in zip(self.lengths, n)], strict=True)
        T = k.shape[2]
        valid = torch.arange(T, device=k.device)[None] < torch.tensor(n, device=k.device)[:, None]
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        c_idx = torch.tensor(self.lengths, device=k.device)[b_idx] + t_idx
        pages = self.table()[b_idx, layer, c_idx // self.block]
        self.store.k[pages, c_idx % self.block] = k[b_idx, :, t_idx].to(self.store.k.dtype)
        self.store.v[pages, c_idx % self.block] = v[b_idx, :, t_idx].to(self.store.v.dtype)

    def attend_chunk(self, layer: int, attn, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk's queries q (B, H, T, Dh) over each row's entries and the chunk."""
        T = q.shape[2]
        L = max(self.lengths) + T
        k, v = self.gather(layer, list(range(len(self.seqs))), L)
        return attn.attend(q, k.to(q.dtype), v.to(q.dtype), chunk_mask(self.lengths, T, L, q.device), causal=False)

    def _rows(self, rows: torch.Tensor | None) -> list[int]:
        return list(range(len(self.seqs))) if rows is None else rows.tolist()

    def put_step(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Decode: write one entry k/v (n, G, 1, Dh) at position lengths[r] of each row r."""
        rr = self._rows(rows)
        if layer == 0:
            short = self._ensure(rr, [self.lengths[r] + 1 for r in rr], strict=False)
            self.overflowed.update(self.seqs[r] for r in short)
        keep = [i for i, r in enumerate(rr) if self.seqs[r] not in self.overflowed]
        if not keep:
            return
        dev = k.device
        idx = torch.tensor([rr[i] for i in keep], device=dev)
        pos = torch.tensor([self.lengths[rr[i]] for i in keep], device=dev)
        pages = self.table()[idx, layer, pos // self.block]
        sel = torch.tensor(keep, device=dev)
        self.store.k[pages, pos % self.block] = k[sel, :, 0].to(self.store.k.dtype)
        self.store.v[pages, pos % self.block] = v[sel, :, 0].to(self.store.v.dtype)

    def gather(self, layer: int, rows: list[int], n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (n, G, Lk, Dh) of ``rows``' first ``n_keys`` entries, in block-table order."""
        pages = self.table()[torch.tensor(rows, device=self.store.k.device), layer]  # (n, nb)
        nb = -(-n_keys // self.block)
        if pages.shape[1] < nb:  # an overflowed row's entry has no block: page 0 stands in (it is never used)
            pages = torch.nn.functional.pad(pages, (0, nb - pages.shape[1]))
        flat = pages[:, :nb].reshape(-1)
        n, G, Dh = len(rows), self.store.k.shape[2], self.store.k.shape[3]
        st = self.store
        shape = (flat.numel(), self.block, G, Dh)
        k = torch.index_select(st.k, 0, flat, out=st.work_k.resize_(shape))
        v = torch.index_select(st.v, 0, flat, out=st.work_v.resize_(shape))
        k = k.view(n, nb * self.block, G, Dh)[:, :n_keys].transpose(1, 2)
        v = v.view(n, nb * self.block, G, Dh)[:, :n_keys].transpose(1, 2)
        return k, v

    def attend(self, layer: int, attn, q: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of each row's new query q (n, H, 1, Dh) over its lengths + 1 entries: (n, 1, D)."""
        rr = self._rows(rows)
        n_keys = [self.lengths[r] + 1 for r in rr]
        L = max(n_keys)
        k, v = self.gather(layer, rr, L)
        mask = None
        if min(n_keys) != L:
            keys = torch.tensor(n_keys, device=k.device)
            mask = (torch.arange(L, device=k.device)[None] < keys[:, None])[:, None, None]  # (n, 1, 1, Lk)
        return attn.attend(q, k.to(q.dtype), v.to(q.dtype), mask, causal=False)

    def advance(self, rows: torch.Tensor | None = None) -> None:
        for r in self._rows(rows):
            self.lengths[r] += 1

    def bytes_used(self) -> int:
        return self.pool.layout.entry_bytes(self.kind) * sum(self.lengths)

    def bytes_allocated(self) -> int:
        return self.store.bytes_allocated()  # shared by both groups: the whole budget

    # --- rows joining and leaving --------------------------------------------------------------------
    @staticmethod
    def cat(caches: list["PagedKVCache"]) -> "PagedKVCache":
        c0 = caches[0]
        out = PagedKVCache(c0.pool, c0.kind, [s for c in caches for s in c.seqs],
                           [n for c in caches for n in c.lengths])
        out.overflowed = set().union(*(c.overflowed for c in caches))
        return out

    def select(self, rows: list[int]) -> "PagedKVCache":
        out = PagedKVCache(self.pool, self.kind, [self.seqs[r] for r in rows], [self.lengths[r] for r in rows])
        out.overflowed = {s for s in self.overflowed if s in out.seqs}
        return out
