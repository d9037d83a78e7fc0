"""The fused LM head + cross-entropy (model/linear_ce.py) equals the unfused reference: loss,
gradient of the hidden states and of the head's weight, in fp32 and under bf16 autocast, and
inside the model when the trainer asks for the loss only."""

import pytest
import torch
import torch.nn.functional as F

from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model
from conceptmoe.model.linear_ce import linear_cross_entropy


def _reference(h, w, labels):
    return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)


@pytest.mark.parametrize("rows", [7, 16, 1000])  # uneven last block, several blocks, one block
def test_fused_loss_and_gradients_equal_the_reference_in_fp32(rows):
    g = torch.Generator().manual_seed(0)
    N, D, V = 40, 12, 50
    h = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    ref = _reference(h, w, labels)
    gh, gw = torch.autograd.grad(ref * 3.0, (h, w))  # an upstream gradient other than 1
    got = linear_cross_entropy(h, w, labels, rows=rows)
    fh, fw = torch.autograd.grad(got * 3.0, (h, w))
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.allclose(fh, gh, atol=1e-6) and torch.allclose(fw, gw, atol=1e-6)


def test_fused_loss_under_bf16_matches_the_autocast_reference():
    g = torch.Generator().manual_seed(1)
    N, D, V = 64, 32, 96
    h = torch.randn(N, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(h, w, labels)
        got = linear_cross_entropy(h.to(torch.bfloat16), w, labels, rows=16)
    gh, gw = torch.autograd.grad(ref, (h, w))
    fh, fw = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32 and fw.dtype == torch.float32
    assert abs(float(got.detach()) - float(ref.detach())) < 1e-3
    for a, b in ((fh, gh), (fw, gw)):
        assert torch.allclose(a, b, atol=2e-2 * float(b.abs().max()))


def test_every_label_ignored_gives_zero_not_nan():
    h, w = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3)
    loss = linear_cross_entropy(h, w, torch.full((4,), -100))
    loss.backward()
    assert float(loss) == 0.0 and bool((h.grad == 0).all())


@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_a_loss_only_training_forward_equals_the_reference(kind):
    """The trainer's forward (``loss_only``): no logits, the same loss and gradients in fp32."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", kind=kind, tie_embeddings=True)
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (3, 24))
    labels = ids.clone()
    labels[0, 5:9] = -100
    u = {"boundary_noise": torch.rand(3, 24)} if kind == "conceptmoe" else {}

    def run(loss_only: bool):
        model.zero_grad()
        model.loss_only = loss_only
        out = model(ids, labels=labels, **u)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run(False)
    got, got_grads = run(True)
    assert got.logits is None and ref.logits is not None
    assert torch.allclose(got.loss, ref.loss, atol=1e-5)
    assert torch.allclose(got.aux["ce_loss"], ref.aux["ce_loss"], atol=1e-5)
    assert ref_grads.keys() == got_grads.keys() and "embed.weight" in got_grads
    for n in ref_grads:
        assert torch.allclose(got_grads[n], ref_grads[n], atol=1e-5, rtol=1e-4), n
    model.eval()  # evaluation keeps its logits whatever the flag says
    assert model(ids, labels=labels).logits is not None
