"""Inference state for cached decoding: KV caches, chunk state, dechunk state (CONCEPTMOE.md §4).

Layout (one object per stack of layers that advance together):

- ``KVCache`` — K and V buffers of shape (B, G, cap, Dh) per layer, plus ``lengths``: the
  number of entries each row holds (a host-side list; rows differ). Rows are *right-aligned
  at zero*: row b uses entries ``[0, lengths[b])``, so caches are ragged, not padded on the
  left. Capacity grows in blocks of ``block`` entries (never per step).
  - token cache: encoder + decoder layers of ConceptMoE (all layers of the MoE); every row
    gains one entry per decoded token, so ``lengths`` = tokens seen per row.
  - concept cache: one layer entry per concept layer *and* loop iteration
    (index ``loop * n_concept_layers + i``); a row gains one entry only when it hits a
    boundary, so ``lengths`` = concepts (boundaries) seen per row.
- ``ChunkState`` — the chunk module's memory: ``last_key`` = W_k ĥ_{t-1} (cosine router), and
  for ``concept_pooling="mean"`` the running sum and count of encoder states since the last
  boundary (the tokens the next concept will merge); for an elastic model, each row's ratio
  embedding (rows of one batch may ask for different R).
- ``DechunkState`` — ``z`` = EMA of the latest concept output, z_{j(t)} (B, D).

Shape legend: B batch rows, G key/value heads, Dh head dim, D d_model, n rows taking part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 256  # cache capacity grows in multiples of this many entries


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


@dataclass
class KVCache:
    """Ragged K/V cache of a stack of attention layers that share per-row lengths."""

    k: list[torch.Tensor]  # per layer (B, G, cap, Dh)
    v: list[torch.Tensor]  # per layer (B, G, cap, Dh)
    lengths: list[int]  # entries used per row
    block: int = BLOCK

    @classmethod
    def empty(cls, n_layers: int, batch: int, n_kv: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device | str, block: int = BLOCK) -> "KVCache":
        cap = _round_up(capacity, block)
        shape = (batch, n_kv, cap, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
                   [0] * batch, block)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def reserve(self, need: int) -> None:
        """Make room for ``need`` entries per row, growing by whole blocks (copying once)."""
        if need <= self.capacity:
            return
        extra = _round_up(need, self.block) - self.capacity
        self.k = [F.pad(t, (0, 0, 0, extra)) for t in self.k]
        self.v = [F.pad(t, (0, 0, 0, extra)) for t in self.v]

    def put_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: write k/v (B, G, T, Dh) at entries [0, T) of every row."""
        T = k.shape[2]
        self.reserve(T)
        self.k[layer][:, :, :T] = k
        self.v[layer][:, :, :T] = v

    def _row_index(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.k[0].device
        if rows is None:
            return torch.arange(len(self.lengths), device=dev), torch.tensor(self.lengths, device=dev)
        lens = torch.tensor([self.lengths[r] for r in rows.tolist()], device=dev)
        return rows.to(dev), lens

    def put_step(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        """Decode: write one entry k/v (n, G, 1, Dh) at position lengths[r] of each row r."""
        self.reserve(max(self.lengths) + 1)
        idx, pos = self._row_index(rows)
        self.k[layer][idx, :, pos] = k[:, :, 0]
        self.v[layer][idx, :, pos] = v[:, :, 0]

    def attend(self, layer: int, attn, q: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the just-written entry's query q (n, H, 1, Dh) over lengths + 1 keys.

        All rows: one batched SDPA over (B, G, Lmax, Dh) views with a key mask when rows differ.
        A subset of rows (the concept step): one SDPA per row on a view of that row, so no
        cache row is copied and each row reads only its own entries. Returns (n, 1, D).
        """
        if rows is None or rows.numel() == len(self.lengths):
            L = max(self.lengths) + 1
            k, v = self.k[layer][:, :, :L], self.v[layer][:, :, :L]
            mask = None
            if min(self.lengths) != max(self.lengths):
                n_keys = torch.tensor(self.lengths, device=k.device) + 1
                mask = (torch.arange(L, device=k.device)[None] < n_keys[:, None])[:, None, None]
            return attn.attend(q, k, v, mask, causal=False)
        outs = []
        for i, r in enumerate(rows.tolist()):
            n = self.lengths[r] + 1
            outs.append(attn.attend(q[i:i + 1], self.k[layer][r:r + 1, :, :n],
                                    self.v[layer][r:r + 1, :, :n], causal=False))
        return torch.cat(outs)

    def _chunk_index(self, n: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, chunk position, cache position) of the first n[b] chunk positions of every row b."""
        T = max(n)
        valid = torch.arange(T, device=device)[None] < torch.tensor(n, device=device)[:, None]
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        return b_idx, t_idx, torch.tensor(self.lengths, device=device)[b_idx] + t_idx

    def put_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, n: list[int]) -> None:
        """Chunked prefill: write the first n[b] positions of k/v (B, G, T, Dh) after row b's entries."""
        self.reserve(max(a + c for a, c in zip(self.lengths, n)))
        b_idx, t_idx, c_idx = self._chunk_index(n, k.device)
        self.k[layer][b_idx, :, c_idx] = k[b_idx, :, t_idx]
        self.v[layer][b_idx, :, c_idx] = v[b_idx, :, t_idx]

    def attend_chunk(self, layer: int, attn, q: torch.Tensor) -> torch.Tensor:
        """Attention of a chunk's queries q (B, H, T, Dh), query t of row b over the row's entries
        and chunk positions up to t (causal; ``lengths`` not yet advanced). Returns (B, T, D)."""
        T = q.shape[2]
        L = max(self.lengths) + T
        return attn.attend(q, self.k[layer][:, :, :L], self.v[layer][:, :, :L],
                           chunk_mask(self.lengths, T, L, q.device), causal=False)

    def advance(self, rows: torch.Tensor | None = None) -> None:
        """Commit the entry written this step (for all rows, or for ``rows`` only)."""
        for r in (range(len(self.lengths)) if rows is None else rows.tolist()):
            self.lengths[r] += 1

    def truncate(self, lengths: list[int]) -> None:
        """Forget entries past ``lengths`` (entries before them are untouched)."""
        self.lengths = list(lengths)

    def bytes_used(self) -> int:
        """Bytes of the K/V entries in use (what an exactly-sized cache would hold)."""
        if not self.k:
            return 0
        t = self.k[0]
        per_entry = 2 * t.shape[1] * t.shape[3] * t.element_size() * len(self.k)
        return per_entry * sum(self.lengths)

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def chunk_mask(lengths: list[int], T: int, L: int, device) -> torch.Tensor:
    """(B, 1, T, L) bool: chunk query t of row b sees keys 0 .. lengths[b] + t."""
    keys = torch.arange(L, device=device)[None, None]  # (1, 1, L)
    last = torch.tensor(lengths, device=device)[:, None, None] + torch.arange(T, device=device)[None, :, None]
    return (keys <= last)[:, None]


@dataclass
class ChunkState:
    """Chunk-module memory between decode steps (rows are independent)."""

    last_key: torch.Tensor | None = None  # (B, D) W_k ĥ_{t-1}, cosine router only
    pool_sum: torch.Tensor | None = None  # (B, D) sum of ĥ since the last boundary ("mean")
    pool_count: torch.Tensor | None = None  # (B,) number of tokens in pool_sum
    ratio: Any = None  # the rows' RatioTerms (model/elastic.py) of an elastic model, else None


@dataclass
class DechunkState:
    z: torch.Tensor  # (B, D) EMA state of the latest concept, z_{j(t)}


@dataclass
class InferenceState:
    """Everything a model needs to decode the next token of each row."""

    tokens: KVCache  # token-rate layers (MoE: all layers; ConceptMoE: encoder then decoder)
    concepts: KVCache | None = None  # concept layers x loops (ConceptMoE only)
    chunk: ChunkState | None = None
    dechunk: DechunkState | None = None
    boundaries: list[list[int]] = field(default_factory=list)  # per row: token positions of concepts

    @property
    def batch(self) -> int:
        return len(self.tokens.lengths)

    def kv_bytes(self) -> int:
        """K/V bytes in use over all caches."""
        return self.tokens.bytes_used() + (self.concepts.bytes_used() if self.concepts else 0)

    def concept_counts(self) -> list[int]:
        return list(self.concepts.lengths) if self.concepts else []
