"""vlm-digits training batches carry right padding (issue 18): it is left out of the ratio loss's
F and G (as evaluation leaves it out), and the text loss under --grad-accum is the token-weighted
mean of the whole batch, equal to the run without accumulation."""

import pytest
import torch

from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train


def test_padding_is_left_out_of_f_and_g():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny")).train()
    x = torch.randint(0, model.cfg.vocab_size, (2, 32))
    real = torch.ones(2, 32, dtype=torch.long)
    real[1, 20:] = 0  # row 1: 12 positions of padding
    u = torch.rand(2, 32, generator=torch.Generator().manual_seed(1))
    out = model(x, labels=x, boundary_noise=u, attention_mask=real)
    p, b, m = out.chunks.p.detach().float(), out.boundaries, real.bool()
    assert float(out.aux["boundary_prob"]) == pytest.approx(float(p[m].mean()), rel=1e-6)  # G
    assert out.aux["compression"] == pytest.approx(float(m.sum() / (b & m).sum()), rel=1e-6)  # 1 / F
    padded = model(x, labels=x, boundary_noise=u)  # the same batch with the padding counted
    assert float(padded.aux["boundary_prob"]) != pytest.approx(float(out.aux["boundary_prob"]), rel=1e-4)
    whole = model(x, labels=x, boundary_noise=u, attention_mask=torch.ones_like(real))
    assert torch.equal(whole.loss, padded.loss)  # an all-ones mask changes nothing


def test_padding_is_left_out_of_the_confidence_term():
    # the confidence term is a mean of 4·p·(1 - p) over the real positions after the first, as the
    # ratio loss's G: its share of the loss is the loss with the term minus the loss without it
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny")
    plain = build_model(cfg).eval()  # eval: the same decisions in both models
    conf = build_model(cfg.replace(router_confidence_weight=0.5)).eval()
    conf.load_state_dict(plain.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    real = torch.ones(2, 32, dtype=torch.long)
    real[1, 20:] = 0  # row 1: 12 positions of padding
    with torch.no_grad():
        out0, out1 = plain(x, labels=x, attention_mask=real), conf(x, labels=x, attention_mask=real)
    q, m = out0.chunks.p[:, 1:].float(), real[:, 1:].bool()
    want = 0.5 * (4 * q * (1 - q))[m].mean()
    assert float(out1.loss - out0.loss) == pytest.approx(float(want), abs=1e-6)
    assert float(want) != pytest.approx(float(0.5 * (4 * q * (1 - q)).mean()), abs=1e-4)  # padding counted


def test_vlm_digits_grad_accum_is_token_weighted(tmp_path):
    over = {"d_model": 32, "n_experts": 4, "expert_hidden": 16, "n_layers": 3}
    common = dict(data="vlm-digits", preset="vlm", overrides=over, batch_size=4, seq_len=96, device="cpu",
                  progress=False, max_steps=4, eval_every=0, save_every=10, dtype="fp32", seed=2)
    rows = {}
    for k in (1, 2):
        rows[k] = ck.read_metrics(train(TrainConfig(**common, grad_accum=k, out=str(tmp_path / f"k{k}"))))
    for key in ("loss", "ce_loss"):
        worst = max(abs(a[key] - b[key]) for a, b in zip(rows[1], rows[2]))
        assert worst <= 1e-4, (key, worst)
    assert len(rows[2]) == 4
