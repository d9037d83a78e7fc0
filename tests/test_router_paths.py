"""The cosine router against the formula, with random independent W_q != W_k (CONCEPTMOE.md §2.2).

The identity start makes W_q = W_k, which hides a swap of the two; these tests use random
weights and compare the full form (``ChunkRouter.forward``), the cached one-token form
(``ChunkRouter.step``) and the model's prefill key with (1 - cos(W_q h_t, W_k h_{t-1})) / 2.
"""

import torch

from conceptmoe.inference import prefill
from conceptmoe.model.chunking import ChunkRouter
from method_helpers import hand_cosine_p, trained_like

D = 16


def _random_router(seed: int = 0) -> ChunkRouter:
    torch.manual_seed(seed)
    router = ChunkRouter(D, "cosine")
    with torch.no_grad():
        router.wq.weight.normal_()
        router.wk.weight.normal_()  # independent of W_q
    return router


def test_forward_matches_formula_and_not_the_swapped_one():
    router = _random_router()
    h = torch.randn(3, 20, D)
    p = router(h)
    wq, wk = router.wq.weight.detach(), router.wk.weight.detach()
    want = hand_cosine_p(h.double(), wq.double(), wk.double()).float()
    torch.testing.assert_close(p, want, atol=1e-6, rtol=0)
    swapped = hand_cosine_p(h, wk, wq)
    assert (swapped - want)[:, 1:].abs().max() > 0.05  # the input can tell W_q from W_k


def test_forward_with_offset_keeps_the_first_pair():
    router = _random_router(1)
    h = torch.randn(2, 12, D)
    full = router(h)
    tail = router(h[:, 4:], offset=4)
    # Position 4's p needs h_3, which the tail does not see: only the later positions agree.
    torch.testing.assert_close(tail[:, 1:], full[:, 5:], atol=1e-6, rtol=0)
    assert torch.all(full[:, 0] == 1)


def test_step_matches_formula_and_returns_the_key():
    router = _random_router(2)
    h = torch.randn(3, 15, D)
    wq, wk = router.wq.weight.detach(), router.wk.weight.detach()
    want = hand_cosine_p(h.double(), wq.double(), wk.double()).float()
    key = None
    for t in range(h.shape[1]):
        p, key_new = router.step(h[:, t], key, torch.full((3,), t))
        torch.testing.assert_close(p, want[:, t], atol=1e-6, rtol=0)
        torch.testing.assert_close(key_new, h[:, t] @ wk.T, atol=1e-5, rtol=1e-5)  # W_k h_t is cached
        key = key_new


def test_step_with_a_hand_made_key():
    """p_t against a cached key computed outside the module: W_q acts on h_t, the key is W_k h_{t-1}."""
    router = _random_router(3)
    h_prev, h = torch.randn(4, D), torch.randn(4, D)
    wq, wk = router.wq.weight.detach(), router.wk.weight.detach()
    p, _ = router.step(h, h_prev @ wk.T, torch.full((4,), 7))
    q, k = h @ wq.T, h_prev @ wk.T
    want = (1 - (q * k).sum(-1) / (q.norm(dim=-1) * k.norm(dim=-1))) / 2
    torch.testing.assert_close(p, want, atol=1e-6, rtol=0)


def test_prefill_caches_the_key_of_the_last_real_token():
    model = trained_like(seed=4).eval()
    ids = torch.randint(0, 256, (3, 11))
    lengths = torch.tensor([11, 4, 7])
    _, state = prefill(model, ids, lengths)
    h, _ = model.encode(ids)
    wk = model.chunk.wk.weight.detach()
    want = torch.stack([h[i, n - 1] @ wk.T for i, n in enumerate(lengths.tolist())])
    torch.testing.assert_close(state.chunk.last_key, want.detach(), atol=1e-5, rtol=1e-5)


def test_confidence_term_adds_4p1mp_and_pushes_p_from_the_threshold():
    from conceptmoe.model.config import ModelConfig
    from conceptmoe.model.lm import build_model

    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", kind="conceptmoe")
    plain = build_model(cfg).eval()  # eval: deterministic boundaries, same decisions for both
    conf = build_model(cfg.replace(router_confidence_weight=0.5)).eval()
    conf.load_state_dict(plain.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    out0, out1 = plain(x, labels=x), conf(x, labels=x)
    q = out0.chunks.p[:, 1:]
    assert torch.allclose(out1.loss - out0.loss, 0.5 * (4 * q * (1 - q)).mean(), atol=1e-6)
    # Descending the term alone moves every p away from 0.5 (1 - cos is monotone in the router's output).
    params = [p for n, p in conf.named_parameters() if n.startswith("chunk.")]
    (4 * conf(x).chunks.p[:, 1:] * (1 - conf(x).chunks.p[:, 1:])).mean().backward()
    spread = (conf(x).chunks.p[:, 1:] - 0.5).abs().mean().item()
    with torch.no_grad():
        for p in params:
            p -= 0.05 * p.grad
    assert (conf(x).chunks.p[:, 1:] - 0.5).abs().mean().item() > spread
    # The trainer's scheduled weight (confidence_now) replaces the config's: 0 takes the term off.
    conf.load_state_dict(plain.state_dict())  # undo the step above
    conf.confidence_now = 0.0
    torch.testing.assert_close(conf(x, labels=x).loss, plain(x, labels=x).loss)
    conf.confidence_now = 0.25
    want = plain(x, labels=x).loss + 0.25 * (4 * q * (1 - q)).mean()
    torch.testing.assert_close(conf(x, labels=x).loss, want, atol=1e-6, rtol=0)


def test_confidence_term_switches_on_at_its_start_fraction():
    import pytest
    from conceptmoe.model.chunking import confidence_weight_at
    from conceptmoe.model.config import ModelConfig, parse_overrides

    cfg = ModelConfig.from_preset("tiny", kind="conceptmoe", router_confidence_weight=0.2)
    assert [confidence_weight_at(cfg, s, 10) for s in range(10)] == [0.2] * 10  # start 0: always on
    late = cfg.replace(router_confidence_start=0.6)
    assert [confidence_weight_at(late, s, 10) for s in range(10)] == [0.0] * 6 + [0.2] * 4
    assert parse_overrides(["router_confidence_start=0.5"]) == {"router_confidence_start": 0.5}
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="router_confidence_start"):
            cfg.replace(router_confidence_start=bad)


def test_learned_temperature_scales_the_logit_of_p_in_forward_and_step():
    """router_temperature="learned": p = sigmoid(exp(a) · logit(p_cos)); a = 0 is the paper's p."""
    router = _random_router(5)
    hot = ChunkRouter(D, "cosine", temperature="learned")
    hot.load_state_dict({**router.state_dict(), "log_scale": torch.tensor(0.0)})
    h = torch.randn(2, 14, D)
    torch.testing.assert_close(hot(h), router(h), atol=1e-6, rtol=0)  # a = 0: unchanged
    with torch.no_grad():
        hot.log_scale.fill_(0.8)
    base = router(h).double().clamp(1e-6, 1 - 1e-6)
    want = torch.sigmoid(torch.logit(base) * torch.tensor(0.8).exp()).float()
    want[:, 0] = 1
    p = hot(h)
    torch.testing.assert_close(p, want, atol=1e-6, rtol=0)
    assert (p[:, 1:] - 0.5).abs().mean() > (router(h)[:, 1:] - 0.5).abs().mean()  # further from 0.5
    assert torch.equal(p >= 0.5, router(h) >= 0.5)  # the same decisions
    key = None
    for t in range(h.shape[1]):
        q, key = hot.step(h[:, t], key, torch.full((2,), t))
        torch.testing.assert_close(q, p[:, t], atol=1e-6, rtol=0)
    p.sum().backward()
    assert hot.log_scale.grad is not None and hot.log_scale.grad != 0
