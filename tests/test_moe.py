import pytest
import torch

from conceptmoe.model.moe import MoE


def _moe(**kw):
    args = dict(d=24, n_experts=6, top_k=2, hidden=16, n_shared=1, shared_hidden=8)
    args.update(kw)
    return MoE(**args)


@pytest.mark.parametrize("kw", [{}, {"norm_topk_prob": True}, {"shared_gate": True},
                                {"n_shared": 0}, {"top_k": 6}])
@pytest.mark.parametrize("dispatch", ["grouped", "split"])
def test_dispatch_matches_loop_reference(kw, dispatch):
    moe = _moe(**kw)
    x = torch.randn(50, 24, requires_grad=True)
    y_ref, _ = moe(x, "loop")
    g = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad(y_ref, [x, *moe.parameters()], g, allow_unused=True)
    y, _ = moe(x, dispatch)
    grads = torch.autograd.grad(y, [x, *moe.parameters()], g, allow_unused=True)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, grads_ref):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_reduction_backward_works_with_grouped_mm():
    moe = _moe()
    y, _ = moe(torch.randn(10, 24), "grouped")
    y.sum().backward()  # expanded gradient: must not crash
    assert moe.w_gate.grad is not None and moe.w_gate.grad.abs().sum() > 0


def test_balance_loss_formula_and_uniform_minimum():
    moe = _moe(n_experts=4, top_k=1)
    x = torch.randn(64, 24)
    logits, probs, w, idx = moe.route(x)
    aux = moe.aux_terms(logits, probs, idx)
    f = torch.bincount(idx.flatten(), minlength=4).float() / idx.numel()
    assert torch.allclose(aux.balance_loss, 4 * (f * probs.mean(0)).sum())
    # Perfectly uniform routing gives balance loss 1 (its minimum).
    with torch.no_grad():
        moe.router.weight.zero_()
    logits, probs, w, idx = moe.route(x)
    assert torch.allclose(moe.aux_terms(logits, probs, idx).balance_loss, torch.tensor(1.0))


def test_topk_renormalisation():
    x = torch.randn(8, 24)
    _, _, w, _ = _moe(norm_topk_prob=True).route(x)
    assert torch.allclose(w.sum(-1), torch.ones(8))
    _, _, w, _ = _moe(norm_topk_prob=False).route(x)
    assert (w.sum(-1) < 1).all()


def test_empty_input():
    y, aux = _moe()(torch.randn(0, 24))
    assert y.shape == (0, 24) and torch.isfinite(aux.balance_loss)
