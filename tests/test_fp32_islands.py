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


def _first_decoded_p(model, ids):
    """(p of the full forward at the last position, p of the first decoded step there) (B,) each."""
    from conceptmoe.inference.steps import decode_step, prefill
    seen, step = [], model.chunk.step

    def spy(h, last_key, pos, **kw):
        p, key = step(h, last_key, pos, **kw)
        seen.append(p)
        return p, key

    model.chunk.step = spy
    try:
        with torch.no_grad():
            full = model(ids).chunks.p[:, -1]
            _, state = prefill(model, ids[:, :-1])
            decode_step(model, state, ids[:, -1])
    finally:
        del model.chunk.step
    return full, seen[0]


def test_the_first_decoded_boundary_probability_is_the_full_forwards():
    # Prefill once cached W_k h in the model's dtype, outside the router's fp32 island: in a bf16
    # model the first decoded token's p was then up to 4e-4 off (1.2e-4 here), enough to flip a p
    # near 0.5. With the key in fp32 both paths read the same fp32 key of the same bf16 state.
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny")).eval()
    with torch.no_grad():  # random router projections, not the identity start
        for lin in (model.chunk.wq, model.chunk.wk):
            lin.weight.add_(0.5 * torch.randn_like(lin.weight))
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, model.cfg.vocab_size, (4, 24))
    full, step = _first_decoded_p(model, ids)
    assert full.dtype == step.dtype == torch.float32
    assert (full - step).abs().max() <= 2e-6, (full - step).abs().max()


def test_fp32_islands_go_through_one_helper():
    # every island turns autocast off through model/fp32.py (which also upcasts the operands), so
    # no call site can turn it off and forget the cast, or cast and leave autocast on
    import re
    from pathlib import Path
    root = Path(chunking.__file__).resolve().parents[1]
    off = [str(f.relative_to(root)) for f in root.rglob("*.py")
           if re.search(r"autocast\([^)]*enabled\s*=\s*False", f.read_text())]
    assert off == ["model/fp32.py"], off
