"""The memory-budgeted KV pool of the server: token-layer and concept-layer blocks (CONCEPTMOE.md §4).

A served sequence holds two kinds of cache entries: one per *token* in the token-rate layers (a
MoE's every layer; a ConceptMoE's encoder and decoder) and one per *concept* in the concept layers
(times their loops). The pool accounts for both in fixed-size blocks of ``block`` entries, as
paged attention does: a sequence takes its n-th token block when its token count passes
(n - 1) x block, and its n-th concept block only when a boundary makes its concept count pass
(n - 1) x block. Both kinds draw on one byte budget (``--kv-cache-mb``), so a ConceptMoE, whose
concept blocks fill about R times slower, holds more sequences in the same memory.

The engine asks the pool before a sequence is admitted or grows, and frees a sequence's blocks
when it finishes, is cancelled or preempted. With a ``PageStore`` (``paged.py``; the engine always
gives one) the pool is the allocator of real memory: the budget is the store's pages, allocated
once, and each block a sequence holds is one page per layer of its kind (``pages``, the
sequence's block tables). Without one it is only a ledger (a unit test's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 16  # cache entries per block, token and concept layers alike


@dataclass(frozen=True)
class KVLayout:
    """Bytes of one cache entry of each kind, for one model in one dtype."""

    token_entry_bytes: int  # K and V of one token over all token-rate layers
    concept_entry_bytes: int  # K and V of one concept over all concept layers x loops (0: a MoE)
    block: int = BLOCK
    n_token_layers: int = 1
    n_concept_layers: int = 0

    @classmethod
    def of(cls, model, dtype: torch.dtype, block: int = BLOCK) -> "KVLayout":
        cfg = model.cfg
        per_layer = 2 * cfg.n_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
        if cfg.is_concept:
            n_tok = len(model.encoder) + len(model.decoder)
            n_con = len(model.concept) * cfg.concept_loops
        else:
            n_tok, n_con = len(model.layers), 0
        return cls(per_layer * n_tok, per_layer * n_con, block, n_tok, n_con)

    def layers(self, kind: int) -> int:
        """Layers of a kind (0 token-rate, 1 concept): pages per block of that kind."""
        return self.n_concept_layers if kind else self.n_token_layers

    def entry_bytes(self, kind: int) -> int:
        return self.concept_entry_bytes if kind else self.token_entry_bytes

    @property
    def page_bytes(self) -> int:
        """K and V of one block of one layer."""
        return self.token_entry_bytes // max(self.n_token_layers, 1) * self.block

    @property
    def token_block_bytes(self) -> int:
        return self.token_entry_bytes * self.block

    @property
    def concept_block_bytes(self) -> int:
        return self.concept_entry_bytes * self.block

    def blocks(self, entries: int) -> int:
        return -(-entries // self.block)

    def bytes_for(self, tokens: int, concepts: int) -> int:
        """Pool bytes of a sequence with this many token and concept entries."""
        return self.blocks(tokens) * self.token_block_bytes + self.blocks(concepts) * self.concept_block_bytes

    def per_token_cache_bytes(self, tokens: int) -> int:
        """What a plain per-token cache of the same layers would hold (every layer, every token)."""
        return tokens * (self.token_entry_bytes + self.concept_entry_bytes)


class KVPool:
    """Block ledger under a byte budget; sequences are keyed by any hashable id."""

    def __init__(self, layout: KVLayout, budget_bytes: int, store=None) -> None:
        if budget_bytes < layout.token_block_bytes + layout.concept_block_bytes:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no sequence: one token block and one "
                             f"concept block take {layout.token_block_bytes + layout.concept_block_bytes}")
        self.layout, self.budget = layout, int(budget_bytes)
        self.held: dict = {}  # id -> [token blocks, concept blocks]
        self.store = store  # a PageStore whose pages back the blocks (None: a ledger only)
        self.pages: dict = {}  # id -> ([token block: [page per layer]], [concept block: [...]])
        self.token_blocks = self.concept_blocks = 0
        self.peak_bytes = 0  # most bytes the ledger held at once

    @property
    def used_bytes(self) -> int:
        return self.token_blocks * self.layout.token_block_bytes + self.concept_blocks * self.layout.concept_block_bytes

    @property
    def free_bytes(self) -> int:
        return self.budget - self.used_bytes

    def fits(self, tokens: int, concepts: int) -> bool:
        """Would a new sequence of this size fit now?"""
        return self.layout.bytes_for(tokens, concepts) <= self.free_bytes

    def grow(self, seq, tokens: int, concepts: int) -> bool:
        """Hold enough blocks for ``tokens`` and ``concepts`` entries of ``seq`` (never shrinks);
        False, holding nothing more, when the budget cannot give them."""
        have = self.held.get(seq, [0, 0])
        dt = max(0, self.layout.blocks(tokens) - have[0])
        dc = max(0, self.layout.blocks(concepts) - have[1]) if self.layout.concept_entry_bytes else 0
        if dt * self.layout.token_block_bytes + dc * self.layout.concept_block_bytes > self.free_bytes:
            return False
        self._take(seq, 0, dt)
        self._take(seq, 1, dc)
        return True

    def reserve(self, seq, kind: int, entries: int) -> bool:
        """``grow`` for one kind of layer (0 token, 1 concept), the other kind as held."""
        have = self.held.get(seq, [0, 0])
        tokens = entries if kind == 0 else have[0] * self.layout.block
        concepts = entries if kind == 1 else have[1] * self.layout.block
        return self.grow(seq, tokens, concepts)

    def _take(self, seq, kind: int, n: int) -> None:
        held = self.held.setdefault(seq, [0, 0])
        held[kind] += n
        if kind:
            self.concept_blocks += n
        else:
            self.token_blocks += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if self.store is not None and n:
            blocks = self.pages.setdefault(seq, ([], []))[kind]
            for _ in range(n):
                blocks.append(self.store.take(self.layout.layers(kind)))

    def free(self, seq) -> None:
        t, c = self.held.pop(seq, (0, 0))
        self.token_blocks -= t
        self.concept_blocks -= c
        for blocks in self.pages.pop(seq, ([], [])):
            for b in blocks:
                self.store.give_back(b)

    def stats(self) -> dict[str, int]:
        """Blocks used, and blocks free if the rest of the budget went to that kind alone."""
        lay, free = self.layout, self.free_bytes
        return {"token_blocks_used": self.token_blocks, "concept_blocks_used": self.concept_blocks,
                "token_blocks_free": free // lay.token_block_bytes,
                "concept_blocks_free": free // lay.concept_block_bytes if lay.concept_block_bytes else 0,
                "bytes_used": self.used_bytes, "peak_bytes_used": self.peak_bytes, "bytes_budget": self.budget,
                "sequences": len(self.held)}


def expected_concepts(tokens: int, ratio: float | None) -> int:
    """Concepts a sequence of ``tokens`` is expected to hold at compression ``ratio`` (None: a MoE)."""
    return 0 if ratio is None else math.ceil(tokens / ratio)
