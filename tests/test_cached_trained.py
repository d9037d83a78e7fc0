"""Cached decoding of a trained-like ConceptMoE against the full forward pass (CONCEPTMOE.md §4).

Unlike a freshly built model, every weight that the cache has to handle right is random and
non-zero here: W_q != W_k in the router (the cached key must be W_k h_{t-1}, and p_t must use
W_q h_t) and the joint-decoding W'_q, W'_k, W'_v (the decoder step must receive the concept z).

The full forward pass and the cached step compute p with different matmul shapes, so a p
within ~1e-7 of 0.5 could fall on different sides of the threshold. Each test checks that no p
of the sequences it decodes lies within ``MARGIN`` of 0.5, so a failure is never a coin flip.
"""

import pytest
import torch

from conceptmoe.inference import decode_step, prefill
from method_helpers import right_padded, trained_like

LENS = [5, 17, 9, 30]
N_NEW = 40
MARGIN = 1e-5


def _decode(model, seed=1, n_new=N_NEW):
    ids = right_padded(LENS, seed)
    out, state = prefill(model, ids, torch.tensor(LENS), extra_capacity=n_new)
    seqs = [ids[i, :n].tolist() for i, n in enumerate(LENS)]
    logits = [out.logits]
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(n_new):
        tok = torch.multinomial(out.logits.float().softmax(-1), 1, generator=g)[:, 0]
        for i, t in enumerate(tok.tolist()):
            seqs[i].append(t)
        out = decode_step(model, state, tok)
        logits.append(out.logits)
    return seqs, logits, state


@pytest.mark.parametrize("overrides", [{}, {"concept_pooling": "mean", "concept_loops": 2},
                                       {"chunk_router": "linear"}])
def test_trained_like_cached_steps_match_full_forward(overrides):
    model = trained_like(seed=0, **overrides).eval()
    with torch.no_grad():
        seqs, logits, state = _decode(model)
        rates = []
        for i, n in enumerate(LENS):
            full = model(torch.tensor(seqs[i])[None])
            p = full.chunks.p[0, 1:]
            assert (p - 0.5).abs().min() > MARGIN, "a p sits on the threshold: pick another seed"
            got = torch.stack([step[i] for step in logits])
            torch.testing.assert_close(got, full.logits[0, n - 1:], atol=1e-4, rtol=0)
            b = full.boundaries[0]
            assert state.boundaries[i] == b.nonzero().flatten().tolist()
            assert state.concepts.lengths[i] == int(b.sum())
            rates.append(float(b.float().mean()))
    assert all(0.15 < r < 0.85 for r in rates), rates  # neither every token nor none is a boundary


def test_joint_projections_matter_in_the_trained_like_model():
    """Sanity for the test above: with these weights, z in the decoder's Q/K/V moves the logits."""
    model = trained_like(seed=0).eval()
    ids = right_padded([24], seed=3)
    with torch.no_grad():
        with_joint = model(ids).logits
        for blk in model.decoder:
            for lin in (blk.attn.jq, blk.attn.jk, blk.attn.jv):
                lin.weight.zero_()
        without = model(ids).logits
    # Every position's logits move by far more than the 1e-4 the cache test allows.
    assert (with_joint - without).abs().amax(-1).min() > 1e-3


def test_p_exactly_one_half_is_a_boundary_in_every_path():
    """A linear router with zero weights gives p = sigmoid(0) = 0.5 exactly, at every token:
    eval, prefill and the decode step must all take it as a boundary (p >= 0.5), and agree."""
    model = trained_like(seed=0, chunk_router="linear").eval()
    with torch.no_grad():
        model.chunk.score.weight.zero_()
        model.chunk.score.bias.zero_()
        seqs, logits, state = _decode(model, n_new=6)
        for i, n in enumerate(LENS):
            full = model(torch.tensor(seqs[i])[None])
            assert bool(full.boundaries.all())
            assert state.concepts.lengths[i] == len(seqs[i])  # one concept per token
            got = torch.stack([step[i] for step in logits])
            torch.testing.assert_close(got, full.logits[0, n - 1:], atol=1e-4, rtol=0)
