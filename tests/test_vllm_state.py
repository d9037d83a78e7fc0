"""The vLLM plugin's concept step over a flat batch (``vllm_plugin/state.py``), vectorized over
requests, against a plain loop over requests (the first implementation): the same concepts,
positions, dechunked z and carried state, bit for bit. Needs no vLLM."""

from __future__ import annotations

import copy

import pytest
import torch

from conceptmoe.vllm_plugin.state import Batch, RequestStates, dechunk, gather_concepts, mean_pool

D = 8


def loop_gather(h, b, p, batch, states, mean):
    raws, cpos, cps, counts, firsts = [], [], [], [], []
    for s, e, row in zip(batch.starts, batch.ends, batch.rows):
        idx = b[s:e].nonzero().flatten()
        c0, k = int(states.concepts[row]), idx.numel()
        counts.append(k)
        firsts.append(c0)
        raws.append(mean_pool(h[s:e], idx, states, row) if mean else h[s:e][idx])
        cpos.append(torch.arange(c0, c0 + k))
        cps.append(p[s:e][idx])
    return torch.cat(raws), torch.cat(cpos), torch.cat(cps), counts, firsts


def loop_dechunk(z_tok, src, c_p, b, batch, counts, states):
    """Request by request, concept by concept: z = p src + (1 - p) z (``inference/steps.py``)."""
    off = 0
    for r, (s, e) in enumerate(zip(batch.starts, batch.ends)):
        row, k = batch.rows[r], counts[r]
        zs = [states.z[row].clone()]
        for j in range(k):
            pj = c_p[off + j].to(z_tok.dtype)
            zs.append(pj * src[off + j] + (1 - pj) * zs[-1])
        off += k
        z_tok[s:e] = torch.stack(zs)[b[s:e].long().cumsum(0)]
        states.z[row] = zs[-1]
    states.concepts[torch.tensor(batch.rows)] += torch.tensor(counts)


def case(seed: int, decode: bool = False, dtype: torch.dtype = torch.float32):
    """A flat batch of requests with carried state; ``decode``: one token a request (the fast path).
    ``dtype``: the model's (bf16 takes dechunk's torch loop, float32 its numpy one)."""
    g = torch.Generator().manual_seed(seed)
    lens = [1] * (1 + 3 * seed) if decode else [5, 1, 16, 1, 3, 1, 9][: 2 + seed % 6]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    rows = torch.randperm(20, generator=g)[: len(lens)].tolist()
    batch = Batch(starts, [s + n for s, n in zip(starts, lens)], [0] * len(lens), rows)
    n = sum(lens)
    h, p = torch.randn(n, D, generator=g).to(dtype), torch.rand(n, generator=g)
    b = p >= 0.5
    states = RequestStates.empty(20, D, dtype, torch.device("cpu"))
    states.z.normal_(generator=g)
    states.pool_sum.normal_(generator=g)
    states.pool_count.copy_(torch.randint(0, 4, (20,), generator=g))
    states.concepts.copy_(torch.randint(0, 9, (20,), generator=g))
    return h, b, p, batch, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_vectorized_concept_step_equals_the_loop(seed, mean, decode, dtype):
    h, b, p, batch, states = case(seed, decode, dtype)
    if decode and not b.any():
        b[0] = True
    ref_states = copy.deepcopy(states)
    got = gather_concepts(h, b, p, batch, states, mean)
    want = loop_gather(h, b, p, batch, ref_states, mean)
    for x, y in zip(got[:3], want[:3]):
        assert torch.equal(x, y)
    assert got[3:] == want[3:] and sum(got[3]) > 0
    src = torch.randn(got[0].shape).to(dtype)
    z_ref = torch.full((h.shape[0], D), 7.0, dtype=dtype)
    z = dechunk(src, got[2], b, batch, got[3], states)
    loop_dechunk(z_ref, src, want[2], b, batch, want[3], ref_states)
    assert z.dtype == dtype and torch.equal(z, z_ref)
    for name in ("z", "pool_sum", "pool_count", "concepts"):
        assert torch.equal(getattr(states, name), getattr(ref_states, name)), name


def test_a_batch_without_boundaries():
    h, b, p, batch, states = case(3)
    b[:] = False
    raw, pos, cp, counts, firsts = gather_concepts(h, b, p, batch, states, False)
    assert raw.shape == (0, D) and pos.numel() == 0 and counts == [0] * len(batch.rows)
    before = states.z.clone()
    z = dechunk(raw, cp, b, batch, counts, states)
    assert z.shape == (h.shape[0], D)
    for r, (s, e) in enumerate(zip(batch.starts, batch.ends)):
        assert torch.equal(z[s:e], before[batch.rows[r]].expand(e - s, D))  # every token reads its kept z
