"""Cached decoding (inference/steps.py, generate.py, cache.py) against the full forward pass."""

import pytest
import torch

from conceptmoe import ModelConfig, build_model
from conceptmoe.inference.cache import KVCache
from conceptmoe.inference.generate import compact, sample
from conceptmoe.inference import decode_step, prefill

LENS = [5, 17, 9, 30]  # four prompts of different lengths
N_NEW = 66


def _model(kind="conceptmoe", **overrides):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset("tiny", kind=kind, **overrides)).eval()


def _left_padded(lens, vocab=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = max(lens)
    ids = torch.randint(1, vocab, (len(lens), T), generator=g)
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, T - n:] = 1
        ids[i, :T - n] = 0
    return ids, mask


def _decode_and_compare(model, n_new=N_NEW):
    """Sample n_new tokens step by step; check every step's logits against a full forward."""
    ids, mask = _left_padded(LENS)
    cids, lengths = compact(ids, mask)
    out, state = prefill(model, cids, lengths, extra_capacity=n_new)
    seqs = [cids[i, :n].tolist() for i, n in enumerate(LENS)]
    logits, stepping = [out.logits], []
    g = torch.Generator().manual_seed(2)
    for _ in range(n_new):
        tok = sample(out.logits, temperature=1.0, generator=g)
        for i, t in enumerate(tok.tolist()):
            seqs[i].append(t)
        out = decode_step(model, state, tok)
        logits.append(out.logits)
        if out.boundary is not None:
            stepping.append(int(out.boundary.sum()))
    patterns = []
    for i, n in enumerate(LENS):
        full = model(torch.tensor(seqs[i])[None])
        ref = full.logits[0, n - 1:]  # predictions after the prompt and after each fed token
        got = torch.stack([step[i] for step in logits])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        assert state.tokens.lengths[i] == len(seqs[i])
        if full.boundaries is not None:
            b = full.boundaries[0]
            assert state.concepts.lengths[i] == int(b.sum())  # one concept entry per boundary
            assert state.boundaries[i] == b.nonzero().flatten().tolist()
            patterns.append(tuple(b.tolist()))
    return state, stepping, patterns


def test_moe_cached_steps_match_full_forward():
    state, _, _ = _decode_and_compare(_model("moe"))
    assert state.concepts is None


@pytest.mark.parametrize("overrides", [{}, {"concept_pooling": "mean"}, {"concept_loops": 2},
                                       {"chunk_router": "fixed", "compression_ratio": 3.0},
                                       {"stage_norms": True, "stage_skip": True}])
def test_conceptmoe_cached_steps_match_full_forward(overrides):
    model = _model(**overrides)
    if model.skip is not None:  # a learned skip, not its zero start
        torch.nn.init.normal_(model.skip.weight, std=0.2, generator=torch.Generator().manual_seed(5))
    state, stepping, patterns = _decode_and_compare(model)
    assert len(set(patterns)) == len(LENS)  # every row has its own boundary pattern
    # Ragged steps happened: some steps moved only part of the batch through the concept model.
    assert any(0 < n < len(LENS) for n in stepping)
    loops = model.cfg.concept_loops
    assert len(state.concepts.k) == loops * model.cfg.n_concept_layers  # one cache per loop
    assert state.concepts.lengths != state.tokens.lengths  # concept cache is shorter


@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_greedy_with_and_without_cache_identical(kind):
    model = _model(kind)
    ids, mask = _left_padded(LENS, seed=3)
    cached = model.generate(ids, 64, temperature=0, attention_mask=mask)
    plain = model.generate(ids, 64, temperature=0, attention_mask=mask, use_cache=False)
    assert cached.shape == (len(LENS), max(LENS) + 64)
    assert torch.equal(cached, plain)
    assert torch.equal(cached[:, :max(LENS)], ids)  # the prompt comes back unchanged


def test_batched_generation_equals_one_row_at_a_time():
    model = _model()
    ids, mask = _left_padded(LENS, seed=4)
    batch = model.generate(ids, 20, temperature=0, attention_mask=mask)
    for i, n in enumerate(LENS):
        alone = model.generate(ids[i:i + 1, -n:], 20, temperature=0)
        assert torch.equal(batch[i, -20:], alone[0, -20:])


def test_right_padding_gives_same_tokens_as_left_padding():
    model = _model()
    ids, mask = _left_padded(LENS, seed=5)
    right_ids, _ = compact(ids, mask)
    right_mask = (torch.arange(max(LENS))[None] < torch.tensor(LENS)[:, None]).long()
    a = model.generate(ids, 10, temperature=0, attention_mask=mask)[:, -10:]
    b = model.generate(right_ids, 10, temperature=0, attention_mask=right_mask)[:, -10:]
    assert torch.equal(a, b)


def test_sampling_is_seeded_and_eos_fills_finished_rows():
    model = _model()
    ids, mask = _left_padded(LENS, seed=6)
    kw = dict(temperature=1.0, top_k=50, top_p=0.9, attention_mask=mask)
    a = model.generate(ids, 16, generator=torch.Generator().manual_seed(7), **kw)
    b = model.generate(ids, 16, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, b)
    eos = int(a[0, max(LENS) + 2])  # row 0 emits this token at its third step
    c = model.generate(ids, 16, eos_token_id=eos, generator=torch.Generator().manual_seed(7), **kw)
    first = (c[0, max(LENS):] == eos).nonzero()[0, 0]
    assert bool((c[0, max(LENS) + first:] == eos).all())
    assert model.training is False


def test_generate_restores_training_mode():
    model = _model()
    model.train()
    model.generate(torch.randint(0, 256, (1, 6)), 3, temperature=0)
    assert model.training


def test_sample_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, temperature=0).item() == 1
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, 1.0, top_k=1, generator=g).item() == 1 for _ in range(20))
    assert all(sample(logits, 1.0, top_p=0.5, generator=g).item() == 1 for _ in range(20))
    picks = {sample(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert picks == {1, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, top_p=1.5)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300, 1e-40, 1e-8])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    # 1e-46 and smaller are 0 in fp32: every token once reached the cut and softmax gave NaN
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4  # (B, V)
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        assert sample(logits, temperature, top_p=top_p, generator=g).tolist() == logits.argmax(-1).tolist()
        assert sample(logits, temperature, top_k=5, top_p=top_p, generator=g).tolist() == logits.argmax(-1).tolist()


def test_attention_mask_validation():
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous"):
        compact(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="at least one"):
        compact(ids, torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))


def test_kv_cache_grows_in_blocks():
    cache = KVCache.empty(1, 2, 1, 2, capacity=3, dtype=torch.float32, device="cpu", block=4)
    assert cache.capacity == 4
    buffers = set()
    for step in range(10):
        kv = torch.full((2, 1, 1, 2), float(step))
        cache.put_step(0, kv, kv)
        cache.advance()
        buffers.add(cache.k[0].data_ptr())
    assert cache.capacity == 12 and len(buffers) == 3  # 4 -> 8 -> 12: two regrowths in 10 steps
    assert cache.k[0][1, 0, :10, 0].tolist() == [float(i) for i in range(10)]
    assert cache.bytes_used() == 2 * 10 * 2 * 2 * 4


def test_learned_router_temperature_cached_steps_match_full_forward():
    """The learned inverse temperature (router_temperature="learned") acts in the cached step as in the
    full pass: exp(a) = 2.7 here, so a step that skipped it would decide other boundaries."""
    model = _model(router_temperature="learned")
    with torch.no_grad():
        model.chunk.log_scale.fill_(1.0)
    state, stepping, patterns = _decode_and_compare(model)
    assert len(set(patterns)) == len(LENS) and any(0 < n < len(LENS) for n in stepping)
