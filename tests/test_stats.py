"""Global batch statistics (model/stats.py): the losses the model reports are the method's formulas,
and the data-parallel gradient scaling is exact."""

import pytest
import torch

from conceptmoe import ModelConfig, build_model
from conceptmoe.model.moe import MoE


def _layer_aux(model):
    """Per-layer MoEAux of the next forward (forward hooks on every MoE)."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out[1]))
             for m in model.modules() if isinstance(m, MoE)]
    return seen, hooks


@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_reported_router_losses_are_the_per_layer_formulas(kind):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny", kind=kind)).train()
    x = torch.randint(0, 256, (3, 40))
    seen, hooks = _layer_aux(model)
    out = model(x, labels=x)
    for h in hooks:
        h.remove()
    # E * sum_e f_e * P_e and mean logsumexp^2, averaged over layers (as each MoE computes them alone)
    balance = torch.stack([a.balance_loss for a in seen]).mean()
    z = torch.stack([a.z_loss for a in seen]).mean()
    torch.testing.assert_close(out.aux["balance_loss"], balance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux["router_z_loss"], z, rtol=1e-5, atol=1e-6)
    assert float(balance.detach()) > 0.5  # E * sum f P >= 1 for a balanced router: the sign is right


@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_two_identical_ranks_give_the_one_process_gradient(kind):
    """W ranks holding the same slice: the global means equal the local ones and the averaged
    gradient must equal the single-process gradient (the s·W/N scaling of stats.py)."""
    cfg = ModelConfig.from_preset("tiny", kind=kind, boundary_noise=False)
    grads = []
    for reduce in (None, lambda t: 2 * t):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        model.stats_reduce = reduce
        x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
        out = model(x, labels=x)
        (out.aux["balance_loss"] + out.aux["router_z_loss"] + out.aux["ratio_loss"]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-8, msg=n)
