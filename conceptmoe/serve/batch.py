"""Rows joining and leaving a running batch: concatenating and selecting inference states.

Continuous batching (``engine.py``) keeps one ``InferenceState`` (``inference/cache.py``) for all
running requests. A request joins by being prefilled on its own (or with the others admitted at
the same step) and concatenated to the running state; it leaves by the running state keeping
every row but its own. The server's caches are block storage (``paged.py``): joining and leaving
only concatenate or select the rows' ids and lengths, no K/V entry moves. Dense caches
(``inference/cache.py``) are ragged already, so joining pads their K/V buffers to a common
capacity and concatenates along the batch. Every per-row tensor of the chunk and dechunk states, and an elastic model's ratio terms, follow
the same rows.

Shape legend: B rows, G key/value heads, cap cache capacity, Dh head dim, D d_model.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.nn.functional as F

from ..inference.cache import ChunkState, DechunkState, InferenceState, KVCache
from .paged import PagedKVCache


def _pad_cap(t: torch.Tensor, cap: int) -> torch.Tensor:
    """(B, G, c, Dh) -> (B, G, cap, Dh), zero entries appended."""
    return t if t.shape[2] == cap else F.pad(t, (0, 0, 0, cap - t.shape[2]))


def cat_caches(caches: list) -> KVCache:
    if isinstance(caches[0], PagedKVCache):  # block storage: the rows' block tables, no entry copied
        return PagedKVCache.cat(caches)
    cap = max(c.capacity for c in caches)
    n = len(caches[0].k)
    k = [torch.cat([_pad_cap(c.k[i], cap) for c in caches]) for i in range(n)]
    v = [torch.cat([_pad_cap(c.v[i], cap) for c in caches]) for i in range(n)]
    return KVCache(k, v, [x for c in caches for x in c.lengths], caches[0].block)


def select_cache(cache: KVCache, rows: list[int]) -> KVCache:
    """Keep ``rows``; capacity shrinks to the whole blocks the kept rows need."""
    if isinstance(cache, PagedKVCache):
        return cache.select(rows)
    idx = torch.tensor(rows, device=cache.k[0].device)
    lengths = [cache.lengths[r] for r in rows]
    cap = min(cache.capacity, max(cache.block, -(-max(lengths, default=1) // cache.block) * cache.block))
    return KVCache([t[idx, :, :cap] for t in cache.k], [t[idx, :, :cap] for t in cache.v], lengths, cache.block)


def _cat_opt(ts: list) -> torch.Tensor | None:
    return None if ts[0] is None else torch.cat(ts)


def _cat_obj(objs: list):
    """Concatenate a dataclass of per-row tensors (ChunkState's ratio terms) field by field."""
    if objs[0] is None:
        return None
    return replace(objs[0], **{f.name: _cat_opt([getattr(o, f.name) for o in objs]) for f in fields(objs[0])})


def _sel_obj(obj, idx: torch.Tensor):
    if obj is None:
        return None
    return replace(obj, **{f.name: None if getattr(obj, f.name) is None else getattr(obj, f.name)[idx]
                           for f in fields(obj)})


def cat_states(states: list[InferenceState]) -> InferenceState:
    """One state whose rows are the rows of ``states`` in order."""
    if len(states) == 1:
        return states[0]
    s0 = states[0]
    chunk = dechunk = concepts = None
    if s0.concepts is not None:
        concepts = cat_caches([s.concepts for s in states])
        chunk = ChunkState(last_key=_cat_opt([s.chunk.last_key for s in states]),
                           pool_sum=_cat_opt([s.chunk.pool_sum for s in states]),
                           pool_count=_cat_opt([s.chunk.pool_count for s in states]),
                           ratio=_cat_obj([s.chunk.ratio for s in states]))
        dechunk = DechunkState(torch.cat([s.dechunk.z for s in states]))
    return InferenceState(tokens=cat_caches([s.tokens for s in states]), concepts=concepts, chunk=chunk,
                          dechunk=dechunk, boundaries=[b for s in states for b in s.boundaries])


def select_state(state: InferenceState, rows: list[int]) -> InferenceState:
    """The state of ``rows`` only (in that order)."""
    idx = torch.tensor(rows, dtype=torch.long, device=state.dechunk.z.device if state.dechunk else None)
    pick = lambda t: None if t is None else t[idx]  # noqa: E731
    chunk = dechunk = concepts = None
    if state.concepts is not None:
        concepts = select_cache(state.concepts, rows)
        c = state.chunk
        chunk = ChunkState(pick(c.last_key), pick(c.pool_sum), pick(c.pool_count), _sel_obj(c.ratio, idx))
        dechunk = DechunkState(state.dechunk.z[idx])
    return InferenceState(tokens=select_cache(state.tokens, rows), concepts=concepts, chunk=chunk,
                          dechunk=dechunk, boundaries=[state.boundaries[r] for r in rows] if state.boundaries else [])
