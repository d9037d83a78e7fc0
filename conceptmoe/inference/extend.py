"""Chunked prefill: feed a chunk of several tokens per row to a cached state (CONCEPTMOE.md §4).

``extend(model, state, ids, n)`` continues ``state`` (from ``prefill`` or earlier chunks) by the
first ``n[b]`` tokens of each row b of the right-padded ``ids`` (B, T) and returns the logits
after each row's last new token. It is ``decode_step`` with T positions per row instead of one:
the token-rate layers attend over the cache plus the chunk causally; the router compares each
token with the one before it (the cached key for the chunk's first); the chunk's boundary
tokens, merged as the model merges them, step the concept layers together, ragged per row; the
dechunk EMA continues from the cached z; the decoder attends with the joint z per token. So a
long prompt can be prefilled a bounded number of tokens per engine step (``serve/engine.py``),
and ``prefill`` of the first chunk followed by ``extend`` of the rest equals ``prefill`` of the
whole (``tests/test_extend.py``). The router's p is computed one position at a time ((B, D)
matmuls, as ``decode_step``), so the boundaries are the step's, not the full pass's rounding.

Shape legend: B rows, T chunk tokens, M new concepts (most of any row), D d_model.
"""

from __future__ import annotations

import torch

from ..model.lm import ConceptMoELM
from .cache import InferenceState
from .steps import StepOutput, _last, _real_rows, _rope, _router_input


def _block_chunk(blk, x, cos, sin, cache, layer: int, n: list[int], rows, dispatch: str, z=None):
    """A block over a chunk x (B, T, D): K/V of the first n[b] positions of row b join its cache."""
    q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin, z)
    cache.put_chunk(layer, k, v, n)
    x = x + cache.attend_chunk(layer, blk.attn, q)
    return blk.ffn(x, rows, dispatch)[0]


@torch.no_grad()
def extend(model, state: InferenceState, ids: torch.Tensor, n: torch.Tensor) -> StepOutput:
    """Feed ids[b, :n[b]] to each row b; logits after each row's last fed token (B, V) (a row with
    n[b] = 0 is untouched, its logits meaningless)."""
    B, T = ids.shape
    dev = ids.device
    n = n.to(dev)
    nl = n.tolist()
    pos = torch.tensor(state.tokens.lengths, device=dev)[:, None] + torch.arange(T, device=dev)  # (B, T)
    valid = torch.arange(T, device=dev)[None] < n[:, None]  # (B, T)
    rows = _real_rows(valid)
    x = model.embed(ids)  # (B, T, D)
    cos, sin = _rope(model, pos, x.dtype)
    if not isinstance(model, ConceptMoELM):
        for i, blk in enumerate(model.layers):
            x = _block_chunk(blk, x, cos, sin, state.tokens, i, nl, rows, model.dispatch)
        state.tokens.lengths = [a + b for a, b in zip(state.tokens.lengths, nl)]
        return StepOutput(model.lm_head(model.norm(_last(x, n))))
    n_enc = len(model.encoder)
    for i, blk in enumerate(model.encoder):
        x = _block_chunk(blk, x, cos, sin, state.tokens, i, nl, rows, model.dispatch)
    h = model.encoder_out(x)  # (B, T, D)
    b, c_raw, p = _route_chunk(model, state, h, pos, valid)
    z = _concept_chunk(model, state, b, c_raw, p, pos)  # (B, T, D) z_{j(t)} per token
    x = model.skip_out(h) + z
    for i, blk in enumerate(model.decoder):
        x = _block_chunk(blk, x, cos, sin, state.tokens, n_enc + i, nl, rows, model.dispatch, z=z)
    state.tokens.lengths = [a + c for a, c in zip(state.tokens.lengths, nl)]
    return StepOutput(model.lm_head(model.norm(_last(x, n))), b)


def _route_chunk(model, state, h, pos, valid):
    """Boundaries (B, T), each position's concept input (B, T, D) and p (B, T), one position at a
    time as ``decode_step`` routes; the chunk and pooling state move past the chunk."""
    ck, terms = state.chunk, state.chunk.ratio
    shift = {} if terms is None else {"shift": terms.shift}
    T = h.shape[1]
    ps, bs, cs = [], [], []
    for t in range(T):
        ht, ok = h[:, t], valid[:, t]
        p, key = model.chunk.step(_router_input(ht, terms), ck.last_key, pos[:, t], **shift)
        if key is not None:
            ck.last_key = key if ck.last_key is None else torch.where(ok[:, None], key, ck.last_key)
        bt = (p >= 0.5) & ok
        c = ht
        if ck.pool_sum is not None:
            c = (ck.pool_sum + ht) / (ck.pool_count + 1)[:, None].to(ht.dtype)
            keep = (~bt & ok)[:, None].to(ht.dtype)
            ck.pool_sum = torch.where(ok[:, None], (ck.pool_sum + ht) * keep, ck.pool_sum)
            ck.pool_count = torch.where(ok, (ck.pool_count + 1) * (~bt), ck.pool_count)
        ps.append(p)
        bs.append(bt)
        cs.append(c)
    return torch.stack(bs, 1), torch.stack(cs, 1), torch.stack(ps, 1)


def _concept_chunk(model, state, b, c_raw, p, pos):
    """Step the concept layers on each row's new concepts; the dechunk z of every chunk token."""
    cfg, n_con = model.cfg, len(model.concept)
    B, T, D = c_raw.shape
    dev = c_raw.device
    m = b.sum(1)  # (B,) new concepts per row
    M = int(m.max())
    z_prev = state.dechunk.z  # (B, D)
    if M == 0:
        return z_prev[:, None].expand(B, T, D)
    order = torch.argsort((~b).to(torch.int8), dim=1, stable=True)[:, :M]  # boundary positions first, in order
    cmask = torch.arange(M, device=dev)[None] < m[:, None]  # (B, M)
    raw = torch.gather(c_raw, 1, order[..., None].expand(B, M, D))  # (B, M, D)
    pc = torch.gather(p, 1, order)  # (B, M)
    terms = state.chunk.ratio
    c_in = raw if terms is None or terms.concept is None else raw + terms.concept[:, None].to(raw.dtype)
    cache = state.concepts
    cpos = torch.tensor(cache.lengths, device=dev)[:, None] + torch.arange(M, device=dev)
    ccos, csin = _rope(model, cpos, c_in.dtype)
    ml = m.tolist()
    crows = _real_rows(cmask)
    c = c_in
    for loop in range(cfg.concept_loops):
        for i, blk in enumerate(model.concept):
            c = _block_chunk(blk, c, ccos, csin, cache, loop * n_con + i, ml, crows, model.dispatch)
    c = model.concept_out(c)
    cache.lengths = [a + k for a, k in zip(cache.lengths, ml)]
    src = c - c_in if cfg.dechunk_source == "update" else c - (c_in - raw)  # (B, M, D)
    zs, z = [], z_prev
    for j in range(M):  # the EMA over each row's new concepts, continuing from the cached z
        pj = pc[:, j, None].to(z.dtype)
        z = torch.where(cmask[:, j, None], pj * src[:, j] + (1 - pj) * z, z)
        zs.append(z)
    zc = torch.stack([z_prev] + zs, 1)  # (B, M + 1, D): index 0 is the z before the chunk
    idx = b.long().cumsum(1)  # (B, T): concepts of the chunk at or before t
    z_tok = torch.gather(zc, 1, idx[..., None].expand(B, T, D))
    for r in range(B):
        state.boundaries[r] += pos[r][b[r]].tolist()
    state.dechunk.z = torch.gather(zc, 1, m[:, None, None].expand(B, 1, D))[:, 0]  # after each row's last concept
    return z_tok
