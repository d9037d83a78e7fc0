"""Each way the boundary probability p reaches the loss, one at a time (CONCEPTMOE.md §2.2, §2.5, §2.7).

p reaches the loss along three paths: the straight-through estimator on the decoder input
(h_t + z_{j(t)}·STE(P_t)), the dechunk EMA weights (z_j = p·ĉ_j + (1-p)·z_{j-1}) and the ratio
loss (G = mean p). "W_q.grad is non-zero" holds as long as any one of them survives, so each
path is checked on its own: autograd through the real model, with the other paths cut, against
``reference_losses`` (a hand-built forward in which only the named path carries gradient).
The total loss must be exactly CE + w_b·balance + w_z·z-loss + λ·ratio.
"""

import pytest
import torch

import conceptmoe.model.chunking as chunking
from conceptmoe import ModelConfig, build_model
from method_helpers import reference_losses, rel_err, router_grad, trained_like

TOL = 2e-4  # relative error of a gradient vector against its reference


def _setup(seed=0, B=2, T=40):
    model = trained_like(seed=seed).eval()  # eval: no noise; gradients flow all the same
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 256, (B, T), generator=g)
    b = torch.rand(B, T, generator=g) < 0.45  # boundaries as if sampled: P mixes p and 1 - p
    b[:, 0] = True
    return model, ids, b


def _model_ce_grad(model, ids, b):
    out = model(ids, labels=ids, boundaries_override=b)
    return router_grad(model, out.aux["ce_loss"])


def test_ce_gradient_through_the_ste_alone(monkeypatch):
    model, ids, b = _setup()
    ema = chunking.ema_scan
    monkeypatch.setattr(chunking, "ema_scan", lambda p, c, *a: ema(p.detach(), c, *a))  # cut the EMA path
    got = _model_ce_grad(model, ids, b)
    want = router_grad(model, reference_losses(model, ids, b, paths=("ste",))[0])
    assert want.norm() > 1e-4
    assert rel_err(got, want) < TOL


def test_ce_gradient_through_the_ema_weights_alone(monkeypatch):
    model, ids, b = _setup()
    monkeypatch.setattr(chunking, "ste_ones", lambda x: torch.ones_like(x))  # cut the STE path
    got = _model_ce_grad(model, ids, b)
    want = router_grad(model, reference_losses(model, ids, b, paths=("ema",))[0])
    assert want.norm() > 1e-4
    assert rel_err(got, want) < TOL


def test_ce_gradient_is_the_sum_of_both_paths():
    model, ids, b = _setup(seed=2)
    got = _model_ce_grad(model, ids, b)
    ste = router_grad(model, reference_losses(model, ids, b, paths=("ste",))[0])
    ema = router_grad(model, reference_losses(model, ids, b, paths=("ema",))[0])
    both = router_grad(model, reference_losses(model, ids, b, paths=("ste", "ema"))[0])
    assert rel_err(ste + ema, both) < TOL  # the reference is linear in its paths
    # Each path is a sizeable part of the whole, so losing either shows.
    assert min(rel_err(both, ste), rel_err(both, ema)) > 100 * TOL
    assert rel_err(got, both) < TOL


def test_ratio_loss_gradient_alone():
    model, ids, b = _setup(seed=3)
    out = model(ids, labels=ids, boundaries_override=b)
    want = router_grad(model, reference_losses(model, ids, b, paths=("ratio",))[1])
    assert want.norm() > 1e-4
    assert rel_err(router_grad(model, out.aux["ratio_loss"]), want) < TOL
    # In the total loss the ratio term adds exactly λ times that gradient.
    w = model.cfg
    rest = (out.aux["ce_loss"] + w.balance_loss_weight * out.aux["balance_loss"]
            + w.router_z_loss_weight * out.aux["router_z_loss"])
    extra = router_grad(model, out.loss) - router_grad(model, rest)
    assert rel_err(extra, w.ratio_loss_weight * want) < 1e-3


@pytest.mark.parametrize("kw", [{"kind": "moe"}, {"chunk_router": "cosine"},
                                {"chunk_router": "linear", "concept_pooling": "mean"}])
def test_total_loss_is_the_weighted_sum_of_its_terms(kw):
    # Distinct, non-default weights: a dropped or swapped term cannot hide behind another.
    cfg = ModelConfig.from_preset("tiny", balance_loss_weight=0.37, router_z_loss_weight=0.11,
                                  ratio_loss_weight=0.23, **kw)
    model = build_model(cfg).train()
    ids = torch.randint(0, 256, (2, 32))
    out = model(ids, labels=ids)
    a = out.aux
    want = (a["ce_loss"] + cfg.balance_loss_weight * a["balance_loss"]
            + cfg.router_z_loss_weight * a["router_z_loss"] + cfg.ratio_loss_weight * a["ratio_loss"])
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=0)
    for key in ("balance_loss", "router_z_loss") + (("ratio_loss",) if cfg.is_concept else ()):
        assert float(a[key].detach()) > 1e-3, key  # every term is present and large enough to matter
    if cfg.is_concept:
        torch.testing.assert_close(  # the ratio term in aux is the formula of §2.2
            a["ratio_loss"], chunking.ratio_loss(out.chunks.p, out.boundaries, cfg.compression_ratio))
