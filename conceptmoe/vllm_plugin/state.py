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
    """Per-request chunk and dechunk state, one row per concept block. The concept counts are
    bookkeeping, kept on the host (numpy reads them without a device op or sync); the vectors
    live where the model does."""

    last_key: torch.Tensor  # (blocks, D) fp32: W_k ĥ of the request's last token
    z: torch.Tensor  # (blocks, D) the dechunk EMA after the request's last concept
    pool_sum: torch.Tensor  # (blocks, D) mean pooling: tokens since the last boundary, summed
    pool_count: torch.Tensor  # (blocks,) long
    concepts: torch.Tensor  # (blocks,) long, on the CPU: the request's concepts so far
    lives: torch.Tensor  # (blocks,) long, on the CPU: the life (grant epoch) a row's state belongs to

    @classmethod
    def empty(cls, blocks: int, d: int, dtype: torch.dtype, device: torch.device) -> "RequestStates":
        zeros = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        return cls(zeros(blocks, d, dt=torch.float32), zeros(blocks, d), zeros(blocks, d),
                   zeros(blocks, dt=torch.long), torch.zeros(blocks, dtype=torch.long),
                   torch.zeros(blocks, dtype=torch.long))

    def reset(self, rows: list[int]) -> None:
        for t in (self.last_key, self.z, self.pool_sum, self.pool_count, self.concepts):
            t[rows] = 0

    def copy_rows(self, rows: np.ndarray, src: "RequestStates", src_rows: np.ndarray) -> None:
        """Rows ``rows`` := ``src``'s rows ``src_rows`` (every field but the lives)."""
        dst_t, src_t = on(rows, self.z.device), on(src_rows, self.z.device)
        for a, b in ((self.last_key, src.last_key), (self.z, src.z), (self.pool_sum, src.pool_sum),
                     (self.pool_count, src.pool_count)):
            a[dst_t] = b[src_t]
        self.concepts.numpy()[rows] = src.concepts.numpy()[src_rows]


@dataclass
class Batch:
    """The flat batch's requests: token ranges, tokens already processed, state rows."""

    starts: list[int]
    ends: list[int]
    done: list[int]  # tokens each request had processed before this step
    rows: list[int]  # state row (first concept block, worker units) of each request

    @classmethod
    def of(cls, tok_md, concept_table: torch.Tensor) -> "Batch":
        """The batch of vLLM's token-rate metadata ``tok_md``, its rows from the concept group's table."""
        qsl, seq = tok_md.query_start_loc.tolist(), tok_md.seq_lens.tolist()
        n = len(qsl) - 1
        ends, starts = qsl[1:], qsl[:-1]
        done = [seq[r] - (ends[r] - starts[r]) for r in range(n)]
        return cls(starts, ends, done, concept_table[:n, 0].tolist())


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array: a view on the CPU, a copy from another device.

    The concept step's indices (which token starts a concept, of which request, at which slot)
    are worked out here, on the host: a torch call costs more to dispatch than these few
    integers cost to compute, and a step needs its counts on the host anyway."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (shared memory on the CPU)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def gather_concepts(h: torch.Tensor, b: torch.Tensor, p: torch.Tensor, batch: Batch, states: RequestStates,
                    mean: bool):
    """Each request's new concepts, in batch order: raw inputs (M, D), concept positions (M,),
    their p (M,); new concepts per request and each request's concept count before the step.
    ``mean``: a concept is the mean of its tokens (else the boundary token's state). h, b, p: the
    batch's N real tokens."""
    at, c_pos, counts, firsts = locate_concepts(host(b), batch, states)
    return (*concept_inputs(h, b, p, at, c_pos, batch, states, mean), counts.tolist(), firsts.tolist())


def concept_inputs(h: torch.Tensor, b: torch.Tensor, p: torch.Tensor, at: np.ndarray, c_pos: np.ndarray,
                   batch: Batch, states: RequestStates, mean: bool):
    """The new concepts where ``locate_concepts`` found them: raw inputs (M, D), positions (M,), p (M,)."""
    dev = h.device
    at_t = on(at, dev)
    if mean:
        raw = torch.cat([mean_pool(h[s:e], b[s:e].nonzero().flatten(), states, row)
                         for s, e, row in zip(batch.starts, batch.ends, batch.rows)]) if batch.rows else h[:0]
    else:
        raw = h[at_t]
    return raw, on(c_pos, dev), p[at_t]


def locate_concepts(bn: np.ndarray, batch: Batch, states: RequestStates):
    """Where the step's new concepts are, on the host: their boundary tokens (M,) grouped by
    request in batch order, their concept positions (M,), new concepts per request (R,) and each
    request's concept count before the step (R,). ``bn`` (N,): the boundaries."""
    at = np.flatnonzero(bn)
    firsts = states.concepts.numpy()[batch.rows]
    if decoding(batch):  # one token a request: token r is request r's, at most one concept each
        crid, counts, rank = at, bn.astype(np.int64), 0
    else:
        crid = request_of_token(batch)[at]
        counts = np.bincount(crid, minlength=len(batch.rows))
        rank = np.arange(at.size) - (counts.cumsum() - counts)[crid]  # within its request
    return at, firsts[crid] + rank, counts, firsts


def decoding(batch: Batch) -> bool:
    """Every request of the batch brings exactly one token (a decode step)."""
    return len(batch.starts) == (batch.ends[-1] if batch.ends else 0)


def request_of_token(batch: Batch) -> np.ndarray:
    """(N,) the request (batch index) each real token belongs to."""
    lens = np.asarray(batch.ends, dtype=np.int64) - np.asarray(batch.starts, dtype=np.int64)
    return np.repeat(np.arange(len(lens)), lens)


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


def dechunk(src: torch.Tensor, c_p: torch.Tensor, b: torch.Tensor, batch: Batch, counts: list[int],
            states: RequestStates) -> torch.Tensor:
    """z_j = p_j src_j + (1 - p_j) z_{j-1} over each request's concepts, from its kept z; every
    token gets the z of its latest concept (its request's kept z before the first). Returns z_tok
    (N, D), the batch's N real tokens, and advances each request's state.

    The recurrence runs concept by concept, all requests at once, as ``inference/steps.py`` runs
    it token by token: a decode step (at most one new concept per request) is one update, and a
    request's z does not depend on what else is in the batch (a scan over the batch's widest
    request would round differently with the width)."""
    dev, R = states.z.device, len(counts)
    bn, k = host(b).astype(np.int64), np.asarray(counts, dtype=np.int64)
    rows = np.asarray(batch.rows, dtype=np.int64)
    rows_t = on(rows, dev)
    if decoding(batch):  # token r is request r's, at most one concept each: one update, the same arithmetic
        at = np.flatnonzero(bn)
        if at.size:
            some = on(rows[at], dev)
            states.z[some] = ema_update(c_p, src, states.z[some])
        states.concepts.numpy()[rows] += bn
        return states.z[rows_t]
    D, width = states.z.shape[1], 1 + int(k.max(initial=0))
    crid = np.repeat(np.arange(R), k)  # (M,) request of each concept
    slot = 1 + np.arange(crid.size) - (k.cumsum() - k)[crid]
    zs = states.z.new_zeros(width, R, D)  # slot-major: slot j of every request, one block of rows
    ps = states.z.new_zeros(width, R, 1)
    zs[0] = states.z[rows_t]
    cells = (on(slot, dev), on(crid, dev))
    zs[cells], ps[cells] = src.to(zs.dtype), c_p.to(zs.dtype)[:, None]
    ema_slots(zs, ps)
    rid = request_of_token(batch)  # (N,)
    seen = bn.cumsum()  # boundaries up to each token, over the batch
    before = (seen - bn)[np.asarray(batch.starts, dtype=np.int64)]  # (R,) boundaries before each request
    z_tok = zs[on(seen - before[rid], dev), on(rid, dev)]  # the concept each token reads (0: the kept z)
    states.z[rows_t] = zs[on(k, dev), on(np.arange(R), dev)]
    states.concepts.numpy()[rows] += k
    return z_tok


def ema_update(p: torch.Tensor, src: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """One dechunk step for M requests: p (M,) src (M, D) z (M, D) -> p src + (1 - p) z in z's
    dtype. Eager, each product, 1 - p and the sum are rounded to that dtype, as the reference
    rounds them. Inside a compiled graph (the decode step's, ``model.py``) inductor keeps a fused
    kernel's bf16 arithmetic in fp32 and rounds once, as it does for every fused op of the
    compiled stages: bf16 there is held to a tolerance, fp32 is exact."""
    ps = p.to(z.dtype)[:, None]
    return ps * src.to(z.dtype) + (1 - ps) * z


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


def block_ends(batch: Batch, block: int, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request (K,), position t (K,)) of every token-block end the step reaches: t a multiple of
    ``block`` with done < t <= done + new tokens, for the requests not in ``skip`` (R,) bool."""
    done = np.asarray(batch.done, dtype=np.int64)
    end = done + np.asarray(batch.ends, dtype=np.int64) - np.asarray(batch.starts, dtype=np.int64)
    first, last = done // block + 1, end // block  # the block ends each request reaches
    n = np.where(skip, 0, np.maximum(last - first + 1, 0))
    req = np.repeat(np.arange(len(n)), n)
    t = (first[req] + np.arange(req.size) - (n.cumsum() - n)[req]) * block
    return req, t


def inner_states(req: np.ndarray, t: np.ndarray, batch: Batch, bn: np.ndarray, firsts: np.ndarray, keys, z_tok,
                 h: torch.Tensor, pool0) -> tuple:
    """The state at positions ``t`` inside the step (each before its request's last token): what
    its request would carry on with from there, as the step's own state after its last token.
    (concepts (K,), last key (K, D) or None, z (K, D), pool sum (K, D) and count (K,) or None).
    ``pool0``: mean pooling's (sum (R, D), count (R,)) before the step, else None."""
    starts, done = np.asarray(batch.starts, dtype=np.int64), np.asarray(batch.done, dtype=np.int64)
    f = starts[req] + t - done[req] - 1  # the last token before each position, in the flat batch
    cs = bn.astype(np.int64).cumsum()
    before = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0)  # boundaries before each request
    concepts = firsts[req] + cs[f] - before[req]
    f_t = on(f, h.device)
    last_key = None if keys is None else keys[f_t]
    pool = None
    if pool0 is not None:
        last_b = np.maximum.accumulate(np.where(bn, np.arange(bn.size), -1))[f]  # the last boundary <= f
        sums, counts = [], []
        for r, j, b in zip(req.tolist(), f.tolist(), last_b.tolist()):
            if b >= starts[r]:  # tokens after the request's last boundary
                sums.append(h[b + 1:j + 1].sum(0))
                counts.append(j - b)
            else:  # its pool from before the step, and the step's tokens so far
                sums.append(pool0[0][r] + h[starts[r]:j + 1].sum(0))
                counts.append(int(pool0[1][r]) + j - int(starts[r]) + 1)
        pool = (torch.stack(sums), torch.tensor(counts, dtype=torch.long, device=h.device))
    return concepts, last_key, z_tok[f_t], pool
