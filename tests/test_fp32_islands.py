"""fp32 islands under bf16 autocast (issue 18): the MoE router (logits, softmax, top-k, z-loss),
the cosine and linear chunk routers, the ratio loss and the dechunk scan compute in fp32, exactly
as without autocast, while the rest of the model runs in bf16."""

import pytest
import torch

from conceptmoe.model import chunking
from conceptmoe.model.chunking import ChunkRouter, ratio_loss
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model
from conceptmoe.model.moe import MoE


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_moe_router_is_fp32_under_autocast():
    torch.manual_seed(0)
    moe = MoE(32, 8, 2, 16)
    x = torch.randn(50, 32)
    want = moe.route(x)
    with _bf16():
        got = moe.route(x)
        z = moe.aux_terms(got[0], got[1], got[3]).stats.z_sum
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)  # logits, probs, top-k weights, indices
    assert z.dtype == torch.float32
    assert torch.equal(z, moe.aux_terms(*want[:2], want[3]).stats.z_sum)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_chunk_router_is_fp32_under_autocast(kind):
    torch.manual_seed(0)
    router = ChunkRouter(32, kind)
    with torch.no_grad():  # random projections, not the identity start that hides a bf16 matmul
        for p in router.parameters():
            p.add_(0.3 * torch.randn_like(p))
    h = torch.randn(2, 40, 32)
    want = router(h)
    last_key = router.wk(h[:, 4]) if kind == "cosine" else None  # the cache holds an fp32 key
    with _bf16():
        got = router(h)
        p1, _ = router.step(h[:, 5], last_key, torch.tensor([5, 5]))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert p1.dtype == torch.float32 and torch.allclose(p1, want[:, 5], rtol=0, atol=1e-6)  # bf16: ~1e-3


def test_ratio_loss_is_fp32_under_autocast():
    p = torch.rand(2, 30)
    b, valid = p > 0.5, torch.rand(2, 30) > 0.2
    for mask in (None, valid):
        want = ratio_loss(p, b, 2.0, mask)
        with _bf16():
            got = ratio_loss(p, b, 2.0, mask)
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_a_conceptmoe_forward_keeps_its_islands_fp32(monkeypatch):
    seen = {"route": [], "scan": []}
    route, scan = MoE.route, chunking.ema_scan

    def spy_route(self, x):
        out = route(self, x)
        seen["route"].append(tuple(t.dtype for t in out[:3]))
        return out

    def spy_scan(p, c, *a, **k):
        seen["scan"].append((p.dtype, c.dtype, torch.is_autocast_enabled("cpu")))
        return scan(p, c, *a, **k)

    monkeypatch.setattr(MoE, "route", spy_route)
    monkeypatch.setattr(chunking, "ema_scan", spy_scan)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny")).train()
    x = torch.randint(0, model.cfg.vocab_size, (2, 32))
    with _bf16():
        out = model(x, labels=x)
    assert out.logits.dtype == torch.bfloat16  # the model itself ran in bf16
    assert seen["route"] and all(d == (torch.float32,) * 3 for d in seen["route"])
    assert seen["scan"] == [(torch.float32, torch.float32, False)]
    assert out.chunks.p.dtype == torch.float32
    for name in ("ratio_loss", "balance_loss", "router_z_loss"):
        assert out.aux[name].dtype == torch.float32, name
