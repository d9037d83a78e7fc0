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

import torch

from ..model.scan import ema_scan


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

    def reset(self, row: int) -> None:
        for t in (self.last_key, self.z, self.pool_sum, self.pool_count, self.concepts):
            t[row] = 0


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
    ``mean``: a concept is the mean of its tokens (else the boundary token's state)."""
    raws, cpos, cps, counts, firsts = [], [], [], [], []
    for s, e, row in zip(batch.starts, batch.ends, batch.rows):
        idx = b[s:e].nonzero().flatten()  # boundaries, positions within the chunk
        c0, k = int(states.concepts[row]), idx.numel()
        counts.append(k)
        firsts.append(c0)
        raws.append(mean_pool(h[s:e], idx, states, row) if mean else h[s:e][idx])
        cpos.append(torch.arange(c0, c0 + k, device=h.device))
        cps.append(p[s:e][idx])
    cat = lambda xs, like: torch.cat(xs) if xs else like  # noqa: E731
    return (cat(raws, h[:0]), cat(cpos, h.new_zeros(0, dtype=torch.long)), cat(cps, p[:0]), counts, firsts)


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
    (N, D) in place and advances each request's state."""
    R, D, width = len(counts), z_tok.shape[1], 1 + max(counts, default=0)
    cs = z_tok.new_zeros(R, width, D)
    ps = torch.zeros(R, width, device=z_tok.device)
    rows = torch.tensor(batch.rows, device=z_tok.device)
    cs[:, 0], ps[:, 0] = states.z[rows], 1.0
    off = 0
    for r, k in enumerate(counts):
        cs[r, 1:1 + k] = src[off:off + k]
        ps[r, 1:1 + k] = c_p[off:off + k].float()
        off += k
    zs = ema_scan(ps, cs)  # (R, 1 + max new concepts, D)
    for r, (s, e) in enumerate(zip(batch.starts, batch.ends)):
        j = b[s:e].long().cumsum(0)  # concept each token reads (0: the kept z)
        z_tok[s:e] = zs[r, j]
        states.z[batch.rows[r]] = zs[r, counts[r]]
    states.concepts[rows] += torch.tensor(counts, device=rows.device)
