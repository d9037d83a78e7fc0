"""Padding the concept count to a bucket (done on CUDA, lm.CUDA_CONCEPT_BUCKET) changes no result."""

import torch

from conceptmoe.model.chunking import gather_concepts
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model


def test_gather_pads_to_a_multiple_of_the_bucket_at_most_T():
    g = torch.Generator().manual_seed(0)
    h, p = torch.randn(3, 100, 8, generator=g), torch.rand(3, 100, generator=g)
    b = torch.rand(3, 100, generator=g) < 0.4
    b[:, 0] = True
    plain, padded = gather_concepts(h, p, b), gather_concepts(h, p, b, pad_to=16)
    C = plain.concepts.shape[1]
    assert padded.concepts.shape[1] == -(-C // 16) * 16 > C
    assert torch.equal(padded.mask.sum(1), b.sum(1)) and torch.equal(padded.concepts[:, :C], plain.concepts)
    assert not padded.concepts[:, C:].any()
    every = torch.ones(1, 100, dtype=torch.bool)  # 100 concepts: rounding up to 128 would pass T
    assert gather_concepts(h[:1], p[:1], every, pad_to=64).concepts.shape[1] == 100


def test_bucketed_forward_and_backward_equal_the_unpadded_ones():
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", kind="conceptmoe")
    x = torch.randint(0, cfg.vocab_size, (3, 64))
    u = torch.rand(3, 64)
    results = []
    for bucket in (1, 32):
        torch.manual_seed(1)
        model = build_model(cfg).train()
        model.concept_bucket = bucket
        out = model(x, labels=x, boundary_noise=u)
        out.loss.backward()  # cross-entropy plus every auxiliary term
        results.append((out, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}))
    (a, ga), (b, gb) = results
    assert b.chunks.concepts.shape[1] % 32 == 0 and b.chunks.concepts.shape[1] > a.chunks.concepts.shape[1]
    assert torch.allclose(a.loss, b.loss, rtol=1e-6, atol=1e-6)
    assert torch.allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-6), n
