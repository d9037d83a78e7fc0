import pytest
import torch

from conceptmoe import ModelConfig, build_model



def tiny_model(kind: str = "conceptmoe", **overrides):
    return build_model(ModelConfig.from_preset("tiny", kind=kind, **overrides))

VARIANTS = [
    {"kind": "moe"},
    {"kind": "conceptmoe"},
    {"kind": "conceptmoe", "concept_pooling": "mean", "concept_loops": 2},
    {"kind": "conceptmoe", "chunk_router": "linear", "qk_norm": "full", "shared_expert_gate": True},
    {"kind": "conceptmoe", "chunk_router": "fixed", "joint_decoding": False, "qk_norm": "head"},
]


def _ids(B=3, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g)


@pytest.mark.parametrize("kw", VARIANTS)
def test_output_contract(kw):
    m = tiny_model(**kw)
    ids = _ids()
    out = m(ids)
    assert out.logits.shape == (3, 48, 256) and out.loss is None
    for key in ("ratio_loss", "balance_loss", "compression"):
        assert key in out.aux
    out = m(ids, labels=ids)
    assert out.loss is not None and torch.isfinite(out.loss)
    if kw["kind"] == "moe":
        assert out.boundaries is None and out.aux["compression"] == 1.0
    else:
        assert out.boundaries.shape == (3, 48) and out.boundaries.dtype == torch.bool
        assert out.aux["compression"] == pytest.approx(3 * 48 / out.boundaries.sum().item())


@pytest.mark.parametrize("kw", VARIANTS)
def test_causality(kw):
    m = tiny_model(**kw).eval()
    ids = _ids(B=2, T=40)
    with torch.no_grad():
        ref = m(ids).logits
        for t in (5, 17, 33):
            other = ids.clone()
            other[:, t + 1:] = torch.randint(0, 256, other[:, t + 1:].shape)
            out = m(other).logits
            torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(out[:, t + 1:], ref[:, t + 1:])


@pytest.mark.parametrize("kw", VARIANTS)
def test_batch_invariance_with_ragged_concepts(kw):
    m = tiny_model(**kw).eval()
    ids = _ids(B=4, T=40, seed=1)
    with torch.no_grad():
        batch = m(ids)
        if kw["kind"] == "conceptmoe" and kw.get("chunk_router") != "fixed":
            counts = batch.boundaries.sum(1)
            assert len(set(counts.tolist())) > 1, "test needs rows with different concept counts"
        for i in range(4):
            alone = m(ids[i: i + 1])
            torch.testing.assert_close(batch.logits[i: i + 1], alone.logits, atol=1e-5, rtol=1e-5)


def test_batch_invariance_forced_boundaries():
    m = tiny_model().eval()
    ids = _ids(B=3, T=30)
    forced = torch.zeros(3, 30, dtype=torch.bool)
    forced[0, ::2] = True  # 15 concepts
    forced[1, ::7] = True  # 5 concepts
    forced[2, :] = True  # 30 concepts (no compression)
    with torch.no_grad():
        batch = m(ids, boundaries_override=forced)
        for i in range(3):
            alone = m(ids[i: i + 1], boundaries_override=forced[i: i + 1])
            torch.testing.assert_close(batch.logits[i: i + 1], alone.logits, atol=1e-5, rtol=1e-5)
    assert batch.chunks.mask.sum(1).tolist() == [15, 5, 30]


def test_gradients_reach_chunk_experts_and_joint_projections():
    m = tiny_model().train()
    ids = _ids()
    # Joint projections start at zero, so their input-side gradient is what matters here.
    m(ids, labels=ids).loss.backward()
    named = dict(m.named_parameters())
    for name in ("chunk.wq.weight", "chunk.wk.weight", "encoder.0.moe.w_gate",
                 "concept.0.moe.w_down", "decoder.0.moe.w_up", "decoder.0.attn.jq.weight",
                 "decoder.0.attn.jk.weight", "decoder.0.attn.jv.weight", "encoder.0.moe.router.weight"):
        g = named[name].grad
        assert g is not None and g.abs().sum() > 0, name


def test_ratio_loss_trains_the_router():
    """A few steps on the ratio loss alone move compression toward R (router learns)."""
    m = tiny_model(compression_ratio=4.0, boundary_noise=False).train()
    ids = _ids(B=4, T=64)
    opt = torch.optim.Adam(m.chunk.parameters(), lr=0.05)
    start = m(ids).aux["compression"]
    for _ in range(40):
        opt.zero_grad()
        m(ids).aux["ratio_loss"].backward()
        opt.step()
    end = m(ids).aux["compression"]
    assert abs(end - 4.0) < abs(start - 4.0)


def test_train_mode_boundary_noise_is_seeded():
    m = tiny_model().train()
    ids = _ids()
    torch.manual_seed(11)
    b1 = m(ids).boundaries
    torch.manual_seed(11)
    b2 = m(ids).boundaries
    torch.manual_seed(12)
    b3 = m(ids).boundaries
    assert torch.equal(b1, b2) and not torch.equal(b1, b3)
    m.eval()
    assert torch.equal(m(ids).boundaries, m(ids).boundaries)


def test_labels_ignore_index_and_shift():
    m = tiny_model(kind="moe").eval()
    ids = _ids(B=1, T=10)
    labels = ids.clone()
    labels[:, 5:] = -100
    out = m(ids, labels=labels)
    logp = out.logits[0, :4].log_softmax(-1)
    ce = -logp[torch.arange(4), ids[0, 1:5]].mean()
    torch.testing.assert_close(out.aux["ce_loss"], ce, atol=1e-5, rtol=1e-5)


def test_small_preset_builds():
    for kind in ("moe", "conceptmoe"):
        n = build_model(ModelConfig.from_preset("small", kind=kind)).num_params()
        assert 5e6 < n < 3e7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_ffn_on_valid_rows_equals_boolean_indexing(dtype):
    """The concept layers' MoE on the real concepts only (flat row indices, computed once per
    forward): bitwise the boolean-mask gather/scatter it replaced, forward and backward, in fp32
    and under bf16 autocast; padding positions pass through untouched."""
    from conceptmoe.model.lm import valid_rows

    blk = tiny_model().concept[0]
    torch.manual_seed(3)
    x = torch.randn(3, 7, 32, requires_grad=True)
    mask = torch.rand(3, 7) < 0.6
    mask[:, 0] = True
    g = torch.randn(3, 7, 32)
    results = []
    for valid in (mask, valid_rows(mask), "reference"):
        x.grad = None
        blk.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            if isinstance(valid, str):
                h = blk.moe_norm(x)
                y, _ = blk.moe(h[mask])
                ref = torch.zeros_like(h)
                ref[mask] = y
                out = x + ref
            else:
                out, _ = blk.ffn(x, valid, "grouped")
        (out.float() * g).sum().backward()
        results.append((out.detach(), x.grad.clone(), blk.moe.w_up.grad.clone()))
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            assert torch.equal(a, b)
    assert torch.equal(results[0][0][~mask], x.detach()[~mask].to(results[0][0].dtype))
