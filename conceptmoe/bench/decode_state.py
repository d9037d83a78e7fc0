"""Synthetic decode states for the decode benchmark (CONCEPTMOE.md §4).

``synthetic_state(model, batch, kv, extra)`` builds an ``InferenceState`` as if ``kv`` tokens
per row (and round(kv/R) concepts) had been prefilled: random K/V of the right shapes instead of
a prefill of kv x batch tokens. ``snapshot`` / ``restore`` rewind a state between timed repeats.

Shape legend: B batch rows, D d_model.
"""

from __future__ import annotations

import torch

from ..inference.cache import ChunkState, DechunkState, InferenceState, KVCache


def _fill(cache: KVCache, n: int, g: torch.Generator) -> None:
    """Random K/V in entries [0, n) of every row (a random block tiled: cheap for long caches)."""
    for buf in cache.k + cache.v:
        blk = torch.randn(buf.shape[0], buf.shape[1], min(n, 256), buf.shape[3], generator=g).to(buf)
        for i in range(0, n, blk.shape[2]):
            j = min(n, i + blk.shape[2])
            buf[:, :, i:j] = blk[:, :, :j - i]
    cache.lengths = [n] * len(cache.lengths)


def synthetic_state(model, batch: int, kv: int, extra: int, seed: int = 0,
                    ratio: float | None = None, extrapolate: bool = False) -> InferenceState:
    """A decode state as if ``kv`` tokens (and kv/R concepts) per row had been prefilled;
    ``ratio``: the R asked of an elastic model (its rows carry that ratio's embedding)."""
    cfg, p = model.cfg, next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    new = lambda layers, n: KVCache.empty(layers, batch, cfg.n_kv_heads, cfg.head_dim,  # noqa: E731
                                          n + extra + 1, p.dtype, p.device)
    if not cfg.is_concept:
        tokens = new(cfg.n_layers, kv)
        _fill(tokens, kv, g)
        return InferenceState(tokens=tokens)
    tokens = new(cfg.n_encoder_layers + cfg.n_decoder_layers, kv)
    _fill(tokens, kv, g)
    n_con = max(1, round(kv / (ratio or cfg.compression_ratio)))
    concepts = new(cfg.n_concept_layers * cfg.concept_loops, n_con)
    _fill(concepts, n_con, g)
    D = cfg.d_model
    chunk = ChunkState(last_key=torch.randn(batch, D, generator=g).to(p),
                       ratio=model.ratio_terms(ratio, batch, p.device, extrapolate))
    if cfg.concept_pooling == "mean":
        chunk.pool_sum = torch.zeros(batch, D).to(p)
        chunk.pool_count = torch.zeros(batch, dtype=torch.long, device=p.device)
    z = 0.02 * torch.randn(batch, D, generator=g).to(p)
    return InferenceState(tokens, concepts, chunk, DechunkState(z), [[] for _ in range(batch)])


def snapshot(st: InferenceState) -> dict:
    snap = {"tok": list(st.tokens.lengths)}
    if st.concepts is not None:
        snap.update(con=list(st.concepts.lengths), key=st.chunk.last_key, z=st.dechunk.z,
                    pool=(st.chunk.pool_sum, st.chunk.pool_count))
    return snap


def restore(st: InferenceState, snap: dict) -> None:
    """Rewind a decode state: entries past the saved lengths are simply overwritten later."""
    st.tokens.truncate(snap["tok"])
    if st.concepts is not None:
        st.concepts.truncate(snap["con"])
        st.chunk.last_key, st.dechunk.z = snap["key"], snap["z"]
        st.chunk.pool_sum, st.chunk.pool_count = snap["pool"]
        st.boundaries = [[] for _ in st.boundaries]
