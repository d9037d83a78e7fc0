"""Prefix caching for the concept cache (CONCEPTMOE.md §4): which concept blocks and which state a
token prefix owns, registered from the worker's reports, found again for a new request's prefix.

vLLM caches a token group's full blocks under the chained hash of the token prefix they end, when
it allocates them. A concept group cannot do that: which concepts a token block makes is known only
after the model has run the router. So the concept side of a prefix is registered afterwards:

- the model writes a **snapshot** at the end of every token block a step completes: the state a
  request continues from there (its concept count C, the router's last key, the dechunk z, mean
  pooling's sum and count), in a row of its own keyed by that token block's id, and (epoch, T, C)
  into the feedback table for the scheduler (``cache.py``, ``feedback.py``);
- after the step the scheduler reads them (``PrefixIndex.register``): the token prefix's hash, the
  block that ends it, C, and the first ceil(C / block) concept blocks of the request. Each of those
  blocks is cached in vLLM's block pool under a key of its own (the first prefix that held it, its
  index, its group), so vLLM's LRU keeps and evicts it like any cached block;
- a new request's longest hit (``PrefixIndex.longest``, the concept managers' ``find_longest_cache_hit``)
  is the longest token prefix of its hashes whose token block still holds that hash and whose
  concept blocks all still hold their keys. It gives the concept blocks (``Hit``, with T and C); the
  manager shares the full ones and copies the last one when it is partly filled (the request appends
  its next concept there: vLLM's copy-on-write), and the model copies the snapshot into the
  request's state row before its first step.

A request's R is in its hashes: a request whose ``concept_ratio`` differs from the export's gets it
in its ``cache_salt`` (``salted``), so a prefix computed at another R never matches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id


class Hit(list):
    """A concept group's blocks of a prefix-cache hit, with the prefix's tokens and concepts and its
    snapshot (the row the model copies the state from, and its writer's epoch)."""

    tokens: int = 0
    concepts: int = 0
    snapshot: tuple[int, int] = (0, 0)


@dataclass
class Snapshot:
    """What a token prefix owns on the concept side, in one concept group."""

    token_block: object  # the token group's block that ends the prefix (its snapshot's row)
    token_key: bytes  # that block's hash in the token group, while it holds this prefix
    epoch: int  # the life of the request that wrote the snapshot
    concepts: int  # C at the prefix's end
    chain: list  # (block, key) of the writer's concept blocks, in order: the first ceil(C / block) are its


def concept_key(prefix: BlockHash, index: int, group: int) -> bytes:
    """The pool key of a concept block: the first token prefix it was registered under, its index
    in its request's concept row, its group."""
    h = hashlib.sha256(bytes(prefix) + b"conceptmoe-concept-block" + index.to_bytes(4, "little")).digest()
    return make_block_hash_with_group_id(BlockHash(h), group)


def salted(request, ratio: float | None, default: float) -> None:
    """A request at an R other than the export's: its R in its ``cache_salt``, its hashes again."""
    if ratio is None or ratio == default:
        return
    request.cache_salt = f"{request.cache_salt or ''}|conceptmoe-R={ratio!r}"
    request.block_hashes = []
    request.update_block_hashes()


class PrefixIndex:
    """Snapshots by (concept group, token prefix hash), for the concept managers of one block pool.

    vLLM caches a token block under its hash when it allocates it, before the step that computes
    it: a hit may be handed a block whose step has not run, or was flagged (its decoder's KV made
    with the request's concepts dropped). So a hit here also needs every token block vLLM would
    hand it to be **committed**: computed in a step whose snapshots were registered, and not
    given out again since (``get_new_blocks`` is watched)."""

    def __init__(self, pool, token_groups: list[int], token_managers: list, table, block_size: int) -> None:
        self.pool, self.token_groups, self.token_managers = pool, token_groups, token_managers
        self.table, self.block_size = table, block_size
        self.records: dict[tuple[int, bytes], Snapshot] = {}
        self.done: dict[str, tuple[int, int]] = {}  # request id -> (its life, token blocks registered in it)
        self.committed: set[int] = set()  # token block ids computed in registered steps
        new_blocks = pool.get_new_blocks

        def get_new_blocks(num_blocks: int):
            blocks = new_blocks(num_blocks)
            self.committed.difference_update(b.block_id for b in blocks)
            return blocks

        pool.get_new_blocks = get_new_blocks

    def forget(self, request_id: str) -> None:
        self.done.pop(request_id, None)

    def uncommitted(self, request_id: str) -> None:
        """A flagged request: its token blocks not committed leave the cache (their KV may be wrong)."""
        for m in self.token_managers:
            for blk in m.req_to_blocks.get(request_id, ()):
                if blk.block_hash is not None and blk.block_id not in self.committed and not blk.is_null:
                    self.pool._maybe_evict_cached_block(blk)

    def register(self, request, epoch: int, managers) -> None:
        """The snapshots the worker wrote for ``request`` (its life ``epoch``) at the ends of token
        blocks it has completed, and the concept blocks they own, into the index and the pool."""
        rid, block = request.request_id, self.block_size
        token_blocks = self.token_managers[0].req_to_blocks.get(rid, ())
        life, start = self.done.get(rid, (0, 0))
        if life != epoch:  # a new life starts after its prefix hit, if any
            start = managers[0].hits.get(rid, (0,))[0] // block
        upto = min(request.num_computed_tokens // block, len(request.block_hashes), len(token_blocks))
        if upto <= start:
            return
        got, whole = self.table.snapshots([b.block_id for b in token_blocks[start:upto]])
        for i, ((e, t, c), ok) in enumerate(zip(got.tolist(), whole.tolist())):
            at = start + i
            if not ok or e != epoch or t != (at + 1) * block:
                break  # not written in this life (a flagged step): nothing later either
            h = request.block_hashes[at]
            for m in managers:
                chain = m.chains.setdefault(rid, [])
                row = m.req_to_blocks[rid][m.lead:]
                for k in range(len(chain), min(-(-c // block), len(row))):
                    blk = row[k]
                    key = blk.block_hash
                    if key is None:
                        key = concept_key(h, k, m.kv_cache_group_id)
                        self.pool._insert_block_hash(key, blk, None)
                    chain.append((blk, key))
                if len(chain) * block < c:
                    return
                token_key = make_block_hash_with_group_id(h, self.token_groups[0])
                self.records[(m.kv_cache_group_id, h)] = Snapshot(token_blocks[at], token_key, epoch, c, chain)
            for tm in self.token_managers:
                self.committed.add(tm.req_to_blocks[rid][at].block_id)
            self.done[rid] = (epoch, at + 1)
        if len(self.records) > 4 * self.pool.num_gpu_blocks:
            self._sweep()

    def _valid(self, rec: Snapshot) -> bool:
        cached = self.pool.cached_block_hash_to_block
        if not cached.contain(rec.token_key, rec.token_block.block_id):
            return False
        n = -(-rec.concepts // self.block_size)
        return all(cached.contain(key, blk.block_id) for blk, key in rec.chain[:n])

    def _sweep(self) -> None:
        """Drop the records whose blocks have been evicted."""
        self.records = {k: r for k, r in self.records.items() if self._valid(r)}

    def _committed_prefix(self, block_hashes, n: int) -> int:
        """How many of the first ``n`` token blocks vLLM would hand a hit are committed, in every token group."""
        cached = self.pool.cached_block_hash_to_block
        for i in range(n):
            for g in self.token_groups:
                blk = cached.get_one_block(make_block_hash_with_group_id(block_hashes[i], g))
                if blk is None or blk.block_id not in self.committed:
                    return i
        return n

    def longest(self, block_hashes, max_length: int, groups: list[int], alignment: int) -> tuple[tuple, int]:
        """The concept blocks (a ``Hit`` per group) of the longest prefix of ``block_hashes``, at most
        ``max_length`` tokens and a multiple of ``alignment``, whose snapshot and blocks are all
        still cached and whose token blocks are committed; and its length in tokens."""
        block = self.block_size
        top = self._committed_prefix(block_hashes, min(len(block_hashes), max_length // block))
        for n in range(top, 0, -1):
            if (n * block) % alignment:
                continue
            h = block_hashes[n - 1]
            recs = [self.records.get((g, h)) for g in groups]
            if any(r is None for r in recs):
                continue
            if not all(self._valid(r) for r in recs):
                for g in groups:
                    self.records.pop((g, h), None)
                continue
            hits = []
            for r in recs:
                hit = Hit(blk for blk, _ in r.chain[:-(-r.concepts // block)])
                hit.tokens, hit.concepts, hit.snapshot = n * block, r.concepts, (r.token_block.block_id, r.epoch)
                hits.append(hit)
            return tuple(hits), n * block
        return tuple(Hit() for _ in groups), 0
