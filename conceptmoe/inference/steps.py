"""Cached inference: prefill and one-token decode steps for MoE and ConceptMoE (CONCEPTMOE.md §4).

``prefill(model, ids, lengths)`` runs the forward pass over a batch of *right-padded* prompts
(row b holds its ``lengths[b]`` real tokens at positions 0..lengths[b]-1) and keeps an
``InferenceState`` (``cache.py``): token K/V for the token-rate layers, concept K/V for the
concept model (one cache per concept layer and loop), the chunk module's last key W_k ĥ_{t-1},
the pooling sum for mean pooling, and the dechunk EMA state z. Because attention is causal and
padding sits after each row's tokens, padding never changes a real token's output; MoE layers
skip padding and boundaries are never taken on padding.

``decode_step(model, state, tokens)`` feeds one token per row: encoder step -> p_t against the
cached key -> rows with p_t >= 0.5 step the concept model once (ragged concept caches: the
others do not touch theirs) and update z with the concept output, or with
``dechunk_source="update"`` the update c_out - c_in; the others carry z -> decoder step with joint
decoding -> logits. Boundaries are always the deterministic p >= 0.5 (inference rule).

The full forward pass of ``model/lm.py`` is the reference: tests check every cached step against it.
Images: ``prefill(..., pixel_values=...)`` embeds a prompt whose ``input_ids`` hold image
placeholders (``model/vision.py``); decoding then feeds text tokens only.

One numerical limit: the step computes p_t for one position per row ((B, D) matmuls) and the
full pass for all positions at once ((B, T, D)); they round differently (~1e-7), so a p_t
within ~1e-7 of 0.5 can be a boundary in one and not in the other, after which the two
sequences of concepts differ. The equivalence holds for every p away from 0.5 by more than that.

Shape legend: B batch, T tokens, C concepts, D d_model, V vocab, n rows stepping the concept model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import rope_tables
from ..model.chunking import dechunk, gather_concepts
from ..model.lm import Block, ConceptMoELM, valid_rows
from ..model.vision import embed_inputs
from .cache import ChunkState, DechunkState, InferenceState, KVCache


@dataclass
class StepOutput:
    logits: torch.Tensor  # (B, V) next-token logits of each row
    boundary: torch.Tensor | None = None  # (B,) bool: the fed token started a concept (ConceptMoE)
    hidden: torch.Tensor | None = None  # (B, T, D) last layer's states of every position (prefill, on request)


def _rope(model, pos: torch.Tensor, dtype: torch.dtype):
    """cos/sin for per-row positions pos (B, T) -> (B, T, Dh)."""
    return rope_tables(pos, model.cfg.head_dim, model.cfg.rope_theta, dtype)


def _block_prefill(blk: Block, x, cos, sin, cache: KVCache, layer: int, valid, dispatch: str,
                   z=None) -> torch.Tensor:
    """Block.forward that also stores K/V; ``valid`` (``_real_rows``) skips MoE work on padding."""
    q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin, z)
    cache.put_prefix(layer, k, v)
    x = x + blk.attn.attend(q, k, v)
    return blk.ffn(x, valid, dispatch)[0]


def _real_rows(valid: torch.Tensor) -> torch.Tensor | None:
    """The flat indices of a (B, T) mask's real positions, once for all the layers that share it;
    None when nothing is padding: the MoE then skips the gather/scatter."""
    return None if bool(valid.all()) else valid_rows(valid)


def _block_step(blk: Block, x, cos, sin, cache: KVCache, layer: int, dispatch: str,
                rows: torch.Tensor | None = None, z=None) -> torch.Tensor:
    """One position per row: x (n, 1, D) for ``rows`` (None: all rows) -> (n, 1, D)."""
    q, k, v = blk.attn.project(blk.attn_norm(x), cos, sin, z)
    cache.put_step(layer, k, v, rows)
    x = x + cache.attend(layer, blk.attn, q, rows)
    return blk.ffn(x, None, dispatch)[0]


def _new_cache(model, n_layers: int, batch: int, capacity: int, ref: torch.Tensor, kind: str = "token",
               make=None) -> KVCache:
    """A dense ``KVCache``, or what ``make(kind, n_layers, batch, capacity, ref)`` gives (a server's
    block storage, ``serve/paged.py``): "token" for the token-rate layers, "concept" for the concept layers."""
    if make is not None:
        return make(kind, n_layers, batch, capacity, ref)
    cfg = model.cfg
    return KVCache.empty(n_layers, batch, cfg.n_kv_heads, cfg.head_dim, capacity, ref.dtype, ref.device)


def _last(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) at each row's last real position -> (B, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), lengths - 1]


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
            extra_capacity: int = 0, pixel_values: torch.Tensor | None = None,
            ratio: float | torch.Tensor | None = None, extrapolate: bool = False,
            keep_hidden: bool = False, make_cache=None) -> tuple[StepOutput, InferenceState]:
    """Forward over right-padded prompts (B, T); returns last-token logits and the state.

    ``extra_capacity``: token entries to preallocate for the tokens still to come.
    ``pixel_values`` (B, N, C, H, W): the images whose placeholders the prompts hold.
    ``ratio``: an elastic ConceptMoE's R, one number or one per row (B,); kept for the decode steps
    (outside the trained range only with ``extrapolate``, as ``model(ids, ratio=, extrapolate=)``).
    ``keep_hidden``: also return the last layer's states of every position (prompt log-probabilities).
    ``make_cache``: builds the caches instead of dense ``KVCache``s (``_new_cache``); a cache's
    ``lengths`` are set before anything is written, so it may store only each row's real entries.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    lengths = torch.full((B,), T, device=dev) if lengths is None else lengths.to(dev)
    if int(lengths.min()) < 1 or int(lengths.max()) > T:
        raise ValueError("every row needs between 1 and T real tokens")
    valid = torch.arange(T, device=dev)[None] < lengths[:, None]  # (B, T)
    x = model.embed(input_ids) if pixel_values is None else embed_inputs(model, input_ids, pixel_values)  # (B, T, D)
    cos, sin = model.rope(T, dev, x.dtype)
    if not isinstance(model, ConceptMoELM):
        if ratio is not None:
            raise ValueError("ratio: a plain MoE has no compression ratio")
        cache = _new_cache(model, len(model.layers), B, T + extra_capacity, x, make=make_cache)
        cache.lengths = lengths.tolist()
        rows = _real_rows(valid)
        for i, blk in enumerate(model.layers):
            x = _block_prefill(blk, x, cos, sin, cache, i, rows, model.dispatch)
        cache.lengths = lengths.tolist()
        logits = model.lm_head(model.norm(_last(x, lengths)))
        return StepOutput(logits, hidden=x if keep_hidden else None), InferenceState(tokens=cache)
    out, state = _prefill_concept(model, x, cos, sin, lengths, valid, extra_capacity, ratio, extrapolate, make_cache)
    if not keep_hidden:
        out.hidden = None
    return out, state


def _prefill_concept(model: ConceptMoELM, x, cos, sin, lengths, valid, extra_capacity: int, ratio=None,
                     extrapolate: bool = False, make_cache=None):
    cfg, (B, T, _) = model.cfg, x.shape
    n_enc, n_con = len(model.encoder), len(model.concept)
    tokens = _new_cache(model, n_enc + len(model.decoder), B, T + extra_capacity, x, make=make_cache)
    tokens.lengths = lengths.tolist()
    rows = _real_rows(valid)
    for i, blk in enumerate(model.encoder):
        x = _block_prefill(blk, x, cos, sin, tokens, i, rows, model.dispatch)
    h = model.encoder_out(x)  # (B, T, D) encoder states ĥ
    terms = model.ratio_terms(ratio, B, x.device, extrapolate)  # elastic models: each row's R
    p = model.route(h, terms)  # (B, T)
    b = (p >= 0.5) & valid
    b[:, 0] = True
    ch = gather_concepts(h, p, b, cfg.concept_pooling)
    C = ch.concepts.shape[1]
    concepts = _new_cache(model, n_con * cfg.concept_loops, B, C + 1, x, "concept", make_cache)
    concepts.lengths = ch.mask.sum(1).tolist()
    c = c_in = model.concept_input(ch.concepts, ch.mask, terms)  # (B, C, D)
    ccos, csin = model.rope(C, x.device, x.dtype)  # concept index as RoPE position
    concept_rows = _real_rows(ch.mask)
    for loop in range(cfg.concept_loops):
        for i, blk in enumerate(model.concept):
            c = _block_prefill(blk, c, ccos, csin, concepts, loop * n_con + i, concept_rows, model.dispatch)
    c = model.concept_out(c)
    concepts.lengths = ch.mask.sum(1).tolist()
    update = cfg.dechunk_source == "update"
    z_tok, z_res = dechunk(ch, c, c_in) if update else dechunk(ch, c - (c_in - ch.concepts))  # (B, T, D) each
    x = model.skip_out(h) + z_res
    for i, blk in enumerate(model.decoder):
        x = _block_prefill(blk, x, cos, sin, tokens, n_enc + i, rows, model.dispatch, z=z_tok)
    tokens.lengths = lengths.tolist()
    chunk = ChunkState(ratio=terms)
    if cfg.chunk_router == "cosine":
        chunk.last_key = model.chunk.key(_router_input(_last(h, lengths), terms))  # fp32, as the router's
    if cfg.concept_pooling == "mean":
        # Tokens after a row's last boundary wait in the pool for the concept that closes them.
        tail = valid & (torch.arange(T, device=x.device)[None] > _last_boundary(b)[:, None])
        chunk.pool_sum = (h * tail[..., None]).sum(1)
        chunk.pool_count = tail.sum(1)
    state = InferenceState(tokens=tokens, concepts=concepts, chunk=chunk,
                           dechunk=DechunkState(_last(z_tok, lengths)),
                           boundaries=[row.nonzero().flatten().tolist() for row in b])
    logits = model.lm_head(model.norm(_last(x, lengths)))
    return StepOutput(logits, b, hidden=x), state


def _router_input(h: torch.Tensor, terms) -> torch.Tensor:
    """What the router reads of h (B, D): h plus the rows' ratio vectors (elastic, "router")."""
    return h if terms is None or terms.router is None else h + terms.router.to(h.dtype)


def _last_boundary(b: torch.Tensor) -> torch.Tensor:
    """Position of each row's last boundary: (B,)."""
    T = b.shape[1]
    return (torch.arange(T, device=b.device)[None] * b).amax(1)


@torch.no_grad()
def decode_step(model, state: InferenceState, tokens: torch.Tensor) -> StepOutput:
    """Feed one token per row (B,) and return the next-token logits (B, V)."""
    dev = tokens.device
    pos = torch.tensor(state.tokens.lengths, device=dev)  # (B,) position of the fed token
    x = model.embed(tokens[:, None])  # (B, 1, D)
    cos, sin = _rope(model, pos[:, None], x.dtype)  # (B, 1, Dh)
    if not isinstance(model, ConceptMoELM):
        for i, blk in enumerate(model.layers):
            x = _block_step(blk, x, cos, sin, state.tokens, i, model.dispatch)
        state.tokens.advance()
        return StepOutput(model.lm_head(model.norm(x[:, 0])))
    cfg, n_enc, n_con = model.cfg, len(model.encoder), len(model.concept)
    for i, blk in enumerate(model.encoder):
        x = _block_step(blk, x, cos, sin, state.tokens, i, model.dispatch)
    h = model.encoder_out(x[:, 0])  # (B, D)
    ck, z = state.chunk, state.dechunk.z
    terms = ck.ratio
    shift = {} if terms is None else {"shift": terms.shift}
    p, key = model.chunk.step(_router_input(h, terms), ck.last_key, pos, **shift)
    if key is not None:
        ck.last_key = key
    b = p >= 0.5  # (B,)
    rows = b.nonzero().flatten()  # (n,) rows whose token starts a concept
    if ck.pool_sum is not None:
        pooled = (ck.pool_sum + h) / (ck.pool_count + 1)[:, None].to(h.dtype)
    if rows.numel():
        c_raw = (pooled if ck.pool_sum is not None else h)[rows]  # (n, D)
        c_in = c_raw  # plus the rows' ratio vector (elastic "router+concept"), taken off again below
        if terms is not None and terms.concept is not None:
            c_in = c_raw + terms.concept[rows].to(c_raw.dtype)
        c = c_in[:, None]  # (n, 1, D)
        cpos = torch.tensor([state.concepts.lengths[r] for r in rows.tolist()], device=dev)
        ccos, csin = _rope(model, cpos[:, None], x.dtype)
        for loop in range(cfg.concept_loops):
            for i, blk in enumerate(model.concept):
                c = _block_step(blk, c, ccos, csin, state.concepts, loop * n_con + i,
                                model.dispatch, rows=rows)
        c = model.concept_out(c)
        state.concepts.advance(rows)
        pr = p[rows, None].to(z.dtype)
        z = z.clone()
        src = c[:, 0] - c_in if cfg.dechunk_source == "update" else c[:, 0] - (c_in - c_raw)
        z[rows] = pr * src + (1 - pr) * z[rows]  # EMA update of the rows with a boundary
        state.dechunk.z = z
        for r in rows.tolist():
            state.boundaries[r].append(int(pos[r]))
    if ck.pool_sum is not None:
        keep = (~b)[:, None].to(h.dtype)
        ck.pool_sum = (ck.pool_sum + h) * keep
        ck.pool_count = (ck.pool_count + 1) * (~b)
    x = (model.skip_out(h) + z)[:, None]  # STE(P) is exactly 1 in the forward pass
    zq = z[:, None]
    for i, blk in enumerate(model.decoder):
        x = _block_step(blk, x, cos, sin, state.tokens, n_enc + i, model.dispatch, z=zq)
    state.tokens.advance()
    return StepOutput(model.lm_head(model.norm(x[:, 0])), b)
