"""The concept step's per-request state in vLLM, and the two steps that read and write it:
gathering each request's new concepts from a flat batch, and dechunking them back to its tokens.

vLLM runs one flat batch of many requests, each at its own point (``model.py``); what a request
carries from one step to the next (the chunk router's last key, the dechunk z, the mean-pooling
sum and count, its concept count) lives here, one row per concept-group block, indexed by the
request's first concept block.

Shape legend: N tokens in the flat batch, M new concepts in it, R requests, D d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RequestStates:
    """Per-request chunk and dechunk state, one row per concept block."""

    last_key: torch.Tensor  # (blocks, D) fp32: W_k ĥ of the request's last token
    z: torch.Tensor  # (blocks, D) the dechunk EMA after the request's last concept
    pool_sum: torch.Tensor  # (blocks, D) mean pooling: tokens since the last boundary, summed
    pool_count: torch.Tensor  # (blocks,) long
    concepts: torch.Tensor  # (blocks,) long: the request's concepts so far

    @classmethod
    def empty(cls, blocks: int, d: int, dtype: torch.dtype, device: torch.device) -> "RequestStates":
        zeros = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        return cls(zeros(blocks, d, dt=torch.float32), zeros(blocks, d), zeros(blocks, d),
                   zeros(blocks, dt=torch.long), zeros(blocks, dt=torch.long))

    def reset(self, rows: list[int]) -> None:
        for t in (self.last_key, self.z, self.pool_sum, self.pool_count, self.concepts):
            t[rows] = 0


@dataclass
class Batch:
    """The flat batch's requests: token ranges, tokens already processed, state rows."""

    starts: list[int]
    ends: list[int]
    done: list[int]  # tokens each request had processed before this step
    rows: list[int]  # state row (first concept block, worker units) of each request


def gather_concepts(h: torch.Tensor, b: torch.Tensor, p: torch.Tensor, batch: Batch, states: RequestStates,
                    mean: bool):
    """Each request's new concepts, in batch order: raw inputs (M, D), concept positions (M,),
    their p (M,); new concepts per request and each request's concept count before the step.
    ``mean``: a concept is the mean of its tokens (else the boundary token's state). h, b, p: the
    batch's N real tokens."""
    dev = h.device
    rows = torch.tensor(batch.rows, device=dev, dtype=torch.long)
    at = b.nonzero().flatten()  # (M,) boundary tokens, grouped by request in batch order
    firsts = states.concepts[rows]  # (R,)
    if decoding(batch):  # one token a request: token r is request r's, at most one concept each
        crid, counts, rank = at, b.long(), 0
    else:
        crid = _request_of_token(batch, dev)[at]
        counts = torch.bincount(crid, minlength=len(batch.rows))  # (R,)
        rank = torch.arange(at.numel(), device=dev) - (counts.cumsum(0) - counts)[crid]  # within its request
    if mean:
        raw = torch.cat([mean_pool(h[s:e], b[s:e].nonzero().flatten(), states, row)
                         for s, e, row in zip(batch.starts, batch.ends, batch.rows)]) if batch.rows else h[:0]
    else:
        raw = h[at]
    return raw, firsts[crid] + rank, p[at], counts.tolist(), firsts.tolist()


def decoding(batch: Batch) -> bool:
    """Every request of the batch brings exactly one token (a decode step)."""
    return len(batch.starts) == (batch.ends[-1] if batch.ends else 0)


def _request_of_token(batch: Batch, device: torch.device) -> torch.Tensor:
    """(N,) the request (batch index) each real token belongs to."""
    lens = torch.tensor([e - s for s, e in zip(batch.starts, batch.ends)], device=device, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def mean_pool(hs: torch.Tensor, idx: torch.Tensor, states: RequestStates, row: int) -> torch.Tensor:
    """Concept j = mean of the tokens since the previous boundary (the carried-over pool first)."""
    n = hs.shape[0]
    if idx.numel() == 0:
        states.pool_sum[row] += hs.sum(0)
        states.pool_count[row] += n
        return hs[:0]
    cs = hs.cumsum(0)  # (n, D)
    upto = cs[idx]
    before = torch.cat([torch.zeros_like(upto[:1]), upto[:-1]])
    prev_pos = torch.cat([idx.new_tensor([-1]), idx[:-1]])
    sums, cnt = upto - before, (idx - prev_pos).to(hs.dtype)
    sums[0] += states.pool_sum[row]
    cnt[0] += states.pool_count[row].to(hs.dtype)
    last = int(idx[-1])
    states.pool_sum[row] = hs[last + 1:].sum(0)
    states.pool_count[row] = n - last - 1
    return sums / cnt[:, None]


def dechunk(z_tok: torch.Tensor, src: torch.Tensor, c_p: torch.Tensor, b: torch.Tensor,
            batch: Batch, counts: list[int], states: RequestStates) -> None:
    """z_j = p_j src_j + (1 - p_j) z_{j-1} over each request's concepts, from its kept z; every
    token gets the z of its latest concept (its request's kept z before the first). Writes z_tok
    (N, D) in place and advances each request's state.

    The recurrence runs concept by concept, all requests at once, as ``inference/steps.py`` runs
    it token by token: a decode step (at most one new concept per request) is one update, and a
    request's z does not depend on what else is in the batch (a scan over the batch's widest
    request would round differently with the width)."""
    dev = z_tok.device
    R = len(counts)
    rows = torch.tensor(batch.rows, device=dev, dtype=torch.long)
    if decoding(batch):  # token r is request r's, at most one concept each: one update, the same arithmetic
        z, ps = states.z[rows], c_p.to(z_tok.dtype)[:, None]
        at = b.nonzero().flatten()
        z_new = z.clone()
        z_new[at] = ps * src.to(z.dtype) + (1 - ps) * z[at]
        z_tok[:R] = z_new
        states.z[rows] = z_new
        states.concepts[rows] += b.long()
        return
    D, width = z_tok.shape[1], 1 + max(counts, default=0)
    k = torch.tensor(counts, device=dev, dtype=torch.long)  # (R,)
    crid = torch.repeat_interleave(torch.arange(R, device=dev), k)  # (M,) request of each concept
    slot = 1 + torch.arange(crid.numel(), device=dev) - (k.cumsum(0) - k)[crid]
    zs = z_tok.new_zeros(width, R, D)  # slot-major: slot j of every request, one block of rows
    ps = z_tok.new_zeros(width, R, 1)
    zs[0] = states.z[rows]
    zs[slot, crid], ps[slot, crid, 0] = src.to(zs.dtype), c_p.to(zs.dtype)
    ema_slots(zs, ps)
    rid = _request_of_token(batch, dev)  # (N,)
    seen = b.long().cumsum(0)  # boundaries up to each token, over the batch
    starts = torch.tensor(batch.starts, device=dev, dtype=torch.long)
    before = (seen - b.long())[starts] if R else seen[:0]  # (R,) boundaries before each request
    z_tok[:rid.numel()] = zs[seen - before[rid], rid]  # the concept each token reads (0: the kept z)
    states.z[rows] = zs[k, torch.arange(R, device=dev)]
    states.concepts[rows] += k


def ema_slots(zs: torch.Tensor, ps: torch.Tensor) -> None:
    """In place, slot by slot: zs[j] = ps[j] zs[j] + (1 - ps[j]) zs[j - 1] for j >= 1; zs (W, R, D),
    ps (W, R, 1) (p = 0 leaves a slot's z as the one before).

    The arithmetic of ``inference/steps.py``: the products p s and (1 - p) z each rounded, then
    their sum. The p s of every slot and every 1 - p are computed at once; what must wait for the
    slot before is one multiply and one add. On the CPU, in float32 or float64, those two run in
    numpy: a torch call's dispatch costs more than its arithmetic at these sizes (a 2K-token chunk
    has about a thousand slots)."""
    if zs.shape[0] < 2:
        return
    a, q = ps * zs, 1 - ps
    if zs.device.type == "cpu" and zs.dtype in (torch.float32, torch.float64):
        a, q, z, lib = a.numpy(), q.numpy(), zs.numpy(), np  # views: z writes into zs
    else:
        a, q, z, lib = a.unbind(0), q.unbind(0), zs.unbind(0), torch
    tmp = lib.empty_like(z[0])
    for j in range(1, len(z)):
        lib.multiply(q[j], z[j - 1], out=tmp)
        lib.add(a[j], tmp, out=z[j])


def drop_requests(flagged: list[int], c_raw: torch.Tensor, c_pos: torch.Tensor, c_p: torch.Tensor,
                  counts: list[int], b: torch.Tensor, batch: Batch):
    """The step's concepts without those of the ``flagged`` requests (batch indices), their
    boundaries cleared too: nothing of theirs reaches the concept cache. (c_raw, c_pos, c_p,
    counts, b) as ``gather_concepts`` and the router gave them."""
    dev = c_raw.device
    keep_req = torch.ones(len(counts), dtype=torch.bool, device=dev)
    keep_req[flagged] = False
    crid = torch.repeat_interleave(torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev))
    keep = keep_req[crid]  # (M,)
    b = b.clone()
    dropped = set(flagged)
    for r in dropped:
        b[batch.starts[r]:batch.ends[r]] = False
    counts = [0 if r in dropped else k for r, k in enumerate(counts)]
    return c_raw[keep], c_pos[keep], c_p[keep], counts, b
