import pytest
import torch

from conceptmoe.model.chunking import (ChunkRouter, boundaries, fixed_boundaries, gather_concepts,
                                 ratio_loss, sharpen)


@pytest.mark.parametrize("R", [1.5, 2.0, 4.0])
def test_ratio_loss_minimal_at_one_over_R_along_F_equals_G(R):
    grid = torch.linspace(0.01, 0.99, 981)
    # Along F = G with real boundary tensors of density F.
    n = 1000
    impl = []
    for g in grid[::20]:
        k = int(round(float(g) * n))
        b = torch.zeros(1, n, dtype=torch.bool)
        b[0, :k] = True
        impl.append(float(ratio_loss(torch.full((1, n), k / n), b, R)))
    g_best = float(grid[::20][torch.tensor(impl).argmin()])
    assert abs(g_best - 1 / R) <= 0.02 + 1e-6
    assert abs(min(impl) - 1.0) < 2e-3


@pytest.mark.parametrize("R", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("density", [0.1, 0.3, 0.5, 0.9])
def test_ratio_loss_gradient_sign(R, density):
    n = 200
    b = torch.zeros(1, n, dtype=torch.bool)
    b[0, : int(density * n)] = True
    p = torch.full((1, n), 0.4, requires_grad=True)
    ratio_loss(p, b, R).backward()
    dG = p.grad.sum()  # all p share the mean, dL/dG = n * dL/dp_t / n
    Fm = b.float().mean()
    expected = torch.sign(R * Fm - 1)
    assert torch.sign(dG) == expected
    assert torch.allclose(dG, R / (R - 1) * (R * Fm - 1), atol=1e-5)  # F carries no gradient


def test_sharpen_pushes_to_extremes_and_keeps_half():
    p = torch.tensor([0.0, 0.1, 0.4, 0.5, 0.6, 0.9, 1.0])
    s = sharpen(p, 6.0)
    assert torch.all((s >= p) | (p < 0.5)) and torch.all((s <= p) | (p >= 0.5))
    assert s[0] == 0 and s[-1] == 1
    r = sharpen(torch.rand(1000), 6.0)
    assert (r >= 0).all() and (r <= 1).all()
    assert ((r - 0.5).abs() > 0.3).float().mean() > 0.5  # most mass pushed toward 0/1


def test_boundary_noise_off_in_eval_and_seeded_in_train():
    p = torch.rand(4, 300)
    p[:, 0] = 1
    b_eval = boundaries(p, training=False, noise=True, sharpness=6.0)
    assert torch.equal(b_eval[:, 1:], p[:, 1:] >= 0.5) and b_eval[:, 0].all()
    torch.manual_seed(3)
    b1 = boundaries(p, training=True, noise=True, sharpness=6.0)
    torch.manual_seed(3)
    b2 = boundaries(p, training=True, noise=True, sharpness=6.0)
    torch.manual_seed(4)
    b3 = boundaries(p, training=True, noise=True, sharpness=6.0)
    assert torch.equal(b1, b2) and not torch.equal(b1, b3)
    assert not torch.equal(b1, b_eval)  # noise actually changes some decisions
    assert torch.equal(boundaries(p, training=True, noise=False, sharpness=6.0), b_eval)


def test_cosine_router_probabilities():
    router = ChunkRouter(16, "cosine")
    h = torch.randn(2, 10, 16)
    h[:, 5] = h[:, 4]  # identical neighbours -> cosine 1 -> p = 0 (identity init)
    h[:, 7] = -h[:, 6]  # opposite neighbours -> p = 1
    p = router(h)
    assert p.shape == (2, 10) and (p >= 0).all() and (p <= 1).all()
    assert torch.all(p[:, 0] == 1)
    assert torch.allclose(p[:, 5], torch.zeros(2), atol=1e-6)
    assert torch.allclose(p[:, 7], torch.ones(2), atol=1e-6)


def test_fixed_boundaries_every_R():
    pos = torch.arange(12)
    assert fixed_boundaries(pos, 2.0).nonzero().flatten().tolist() == [0, 2, 4, 6, 8, 10]
    assert int(fixed_boundaries(torch.arange(300), 1.5).sum()) == 200


def test_gather_concepts_ragged_and_mean_pooling():
    h = torch.arange(2 * 6, dtype=torch.float).view(2, 6, 1).expand(2, 6, 2).contiguous()
    b = torch.tensor([[1, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    p = torch.rand(2, 6)
    ch = gather_concepts(h, p, b, "boundary")
    assert ch.concepts.shape == (2, 3, 2)
    assert ch.mask.tolist() == [[True, True, True], [True, True, False]]
    assert ch.concepts[0, :, 0].tolist() == [0, 2, 5] and ch.concepts[1, :2, 0].tolist() == [6, 7]
    assert ch.concept_index[0].tolist() == [0, 0, 1, 1, 1, 2]
    assert ch.positions[0].tolist() == [0, 2, 5]
    assert torch.equal(ch.concept_p[0], p[0, [0, 2, 5]])
    m = gather_concepts(h, p, b, "mean")
    # concept j = mean over tokens (b_{j-1}, b_j]
    assert m.concepts[0, :, 0].tolist() == [0, 1.5, 4.0]
    assert m.concepts[1, :2, 0].tolist() == [6, 7]


def test_sharpness_schedule_is_linear_from_start_to_final():
    from conceptmoe.model.chunking import sharpness_at
    from conceptmoe.model.config import ModelConfig, parse_overrides

    const = ModelConfig.from_preset("tiny", boundary_sharpness=3.0)
    assert [sharpness_at(const, s, 5) for s in range(5)] == [3.0] * 5
    assert parse_overrides(["boundary_sharpness_final=9", "router_temperature=learned"]) == \
        {"boundary_sharpness_final": 9.0, "router_temperature": "learned"}
    assert parse_overrides(["boundary_sharpness_final=none"]) == {"boundary_sharpness_final": None}
    cfg = const.replace(boundary_sharpness=1.0, boundary_sharpness_final=9.0)
    assert [sharpness_at(cfg, s, 5) for s in range(5)] == [1.0, 3.0, 5.0, 7.0, 9.0]
    # At a very large final sharpness the training samples are the eval decision p >= 0.5.
    p = torch.rand(4, 50)
    hard = cfg.replace(boundary_sharpness_final=1e6)
    b = boundaries(p, True, True, sharpness_at(hard, 99, 100), torch.rand(4, 50))
    assert torch.equal(b[:, 1:], (p >= 0.5)[:, 1:])
