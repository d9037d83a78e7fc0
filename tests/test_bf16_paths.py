"""The bf16 fast paths of training on CPU agree with their references (CONCEPTMOE.md §2b):
padded expert groups, the gather with an index_add_ backward, fp32 attention for short
sequences, RoPE that keeps bf16 queries bf16."""

import pytest
import torch
import torch.nn.functional as F

from conceptmoe.model import attention, moe
from conceptmoe.model.attention import Attention, apply_rope, rope_tables
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.moe import MoE, _GatherRows, _pad_groups

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def test_padded_groups_keep_every_slot_in_order():
    g = torch.Generator().manual_seed(1)
    E, K, N = 5, 2, 70
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])  # (N, K) distinct experts
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    tok, counts = order // K, torch.bincount(flat, minlength=E)
    ws = torch.rand(N * K, 1, generator=g)
    tok_p, padded, ws_p, dest = _pad_groups(tok, counts, flat[order], ws, N, multiple=16)
    assert bool((padded % 16 == 0).all()) and bool((padded >= counts).all()) and bool((padded - counts < 16).all())
    assert torch.equal(tok_p[dest], tok) and torch.equal(ws_p[dest], ws)  # where each sorted slot went
    few = _pad_groups(tok, counts, flat[order], ws, N, multiple=64)[1]  # few rows: the next power of two
    assert few.tolist() == [1 << (int(c) - 1).bit_length() if c else 0 for c in counts]
    real = tok_p != N
    assert torch.equal(tok_p[real], tok) and torch.equal(ws_p[real], ws) and bool((ws_p[~real] == 0).all())
    starts = padded.cumsum(0) - padded
    for e in range(E):  # expert e's real rows open its padded group, padding closes it
        group = tok_p[starts[e]:starts[e] + padded[e]]
        assert bool((group[:counts[e]] != N).all()) and bool((group[counts[e]:] == N).all())
    cap = int(counts.max()) + 3  # one capacity for every expert (the batched-matmul layout)
    tok_c, padded_c, _, dest_c = _pad_groups(tok, counts, flat[order], ws, N, cap=cap)
    assert padded_c.tolist() == [cap] * E and tok_c.numel() == E * cap and torch.equal(tok_c[dest_c], tok)


def test_gather_rows_backward_sums_repeated_rows():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 2, 2, 5, 0, 0, 1])
    g = torch.randn(7, 3, dtype=torch.float64)
    (ref,) = torch.autograd.grad(x[idx], x, g)
    out = _GatherRows.apply(x, idx)
    assert torch.equal(out, x[idx])
    (got,) = torch.autograd.grad(out, x, g)
    assert torch.allclose(got, ref)


def _moe_grads(m: MoE, x: torch.Tensor, dispatch: str):
    m.zero_grad()
    xi = x.clone().requires_grad_()
    with torch.autocast(**BF16):
        y, _ = m(xi, dispatch)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.float().detach(), xi.grad, m.w_gate.grad.clone(), m.router.weight.grad.clone()


def test_grouped_experts_run_in_bf16_on_padded_groups_and_match_the_references(monkeypatch):
    monkeypatch.setattr(moe, "CPU_BMM_MAX_PADDING", 0.0)  # the per-expert groups, not one capacity
    torch.manual_seed(0)
    m = MoE(32, n_experts=6, top_k=2, hidden=16, n_shared=1)
    x = torch.randn(300, 32)  # about 100 rows per expert: multiples of 64
    seen = []
    real = F.grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append((a.dtype, b.dtype, torch.diff(offs, prepend=offs.new_zeros(1))))
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(F, "grouped_mm", spy)
    grouped = _moe_grads(m, x, "grouped")
    assert seen and all(a == b == torch.bfloat16 for a, b, _ in seen)  # bf16 operands, not fp32
    assert all(bool(((sizes % moe.CPU_GROUP_ROWS == 0) | (sizes & (sizes - 1) == 0)).all()) for _, _, sizes in seen)
    for ref in (_moe_grads(m, x, "split"), _moe_grads(m, x, "loop")):  # both bf16 under autocast
        for a, b in zip(grouped, ref):
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


@pytest.mark.parametrize("n_shared", [0, 1])
def test_experts_at_one_capacity_run_as_batched_matmuls_and_match_the_references(monkeypatch, n_shared):
    """Many rows under bf16: every expert padded to the largest group (a multiple of
    CPU_GROUP_ROWS), one bmm per projection; outputs and gradients as the split and loop paths."""
    torch.manual_seed(0)
    m = MoE(32, n_experts=6, top_k=2, hidden=16, n_shared=n_shared)
    with torch.no_grad():
        m.router.weight.mul_(20)  # uneven groups: the padding differs from expert to expert
    x = torch.randn(300, 32)
    seen = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: (seen.append((a.shape, a.dtype, b.dtype)), real(a, b))[1])
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: pytest.fail("grouped_mm on the batched path"))
    capped = _moe_grads(m, x, "grouped")
    assert len(seen) == 3 and all(a == b == torch.bfloat16 for _, a, b in seen)
    E, cap, _ = seen[0][0]
    _, idx = m.route(x)[2:]
    assert E == 6 and cap % moe.CPU_GROUP_ROWS == 0 and cap >= int(torch.bincount(idx.flatten()).max())
    monkeypatch.setattr(torch, "bmm", real)
    for ref in (_moe_grads(m, x, "split"), _moe_grads(m, x, "loop")):
        for a, b in zip(capped, ref):
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_too_uneven_groups_keep_their_own_padding(monkeypatch):
    """Past CPU_BMM_MAX_PADDING times the real rows, one capacity would waste more than it saves."""
    torch.manual_seed(0)
    m = MoE(32, n_experts=6, top_k=2, hidden=16)
    x = torch.randn(300, 32)
    monkeypatch.setattr(moe, "CPU_BMM_MAX_PADDING", 1.0)  # any padding at all is too much
    monkeypatch.setattr(torch, "bmm", lambda *a: pytest.fail("bmm past the padding limit"))
    _moe_grads(m, x, "grouped")


def test_fp32_moe_is_not_padded(monkeypatch):
    """Without autocast nothing changes: fp32 groups keep their own sizes."""
    torch.manual_seed(0)
    m = MoE(32, n_experts=6, top_k=2, hidden=16)
    sizes = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda a, b, offs=None, **kw: (
        sizes.append(int(offs[-1])), real(a, b, offs=offs, **kw))[1])
    y, _ = m(torch.randn(50, 32))
    assert sizes == [100, 100, 100] and y.dtype == torch.float32


def test_rope_keeps_bf16_queries_bf16():
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    cos, sin = rope_tables(torch.arange(8)[None], 16, 10000.0, torch.float32)
    out = apply_rope(q, cos, sin)
    assert out.dtype == torch.bfloat16
    ref = apply_rope(q.float(), cos, sin)
    assert torch.allclose(out.float(), ref, atol=3e-2)


@pytest.mark.parametrize("T, fp32", [(24, True), (attention.CPU_FP32_ATTENTION_MAX_KEYS + 8, False)])
def test_short_attention_trains_in_fp32_under_bf16_autocast(monkeypatch, T, fp32):
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    att = Attention(cfg)
    x = torch.randn(2, T, cfg.d_model, requires_grad=True)
    cos, sin = rope_tables(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta, torch.float32)
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: (seen.append(q.dtype), real(q, *a, **kw))[1])
    with torch.autocast(**BF16):
        out = att(x, cos, sin)
    assert out.dtype == torch.bfloat16 and seen == [torch.float32 if fp32 else torch.bfloat16]
    out.float().sum().backward()
    assert x.grad is not None and att.wq.weight.grad is not None
    with torch.no_grad(), torch.autocast(**BF16):  # inference keeps bf16 attention
        att(x, cos, sin)
    assert seen[-1] == torch.bfloat16
    with torch.no_grad():
        ref = att(x, cos, sin)  # fp32 throughout
    assert torch.allclose(out.float(), ref, atol=5e-2 * float(ref.abs().max()))


def test_the_expert_dispatch_path_runs_the_experts_as_one_process_does():
    # Expert parallelism installs ``expert_dispatch`` (parallel/expert_parallel.py); with a
    # dispatch that keeps every expert here, the layer must compute what it computes without
    # one: the rows travel in the compute dtype (bf16 under autocast: half the all-to-all bytes,
    # the bf16 grouped matmul) and the routing weights scale the hidden activations.
    torch.manual_seed(0)
    m = MoE(32, n_experts=4, top_k=2, hidden=16)
    x = torch.randn(64, 32)
    sent = []

    def here(mod, xs, counts, grouped, scale):  # an expert-parallel group of one
        sent.append((xs.dtype, scale.dtype, grouped))
        return mod.expert_ffn(xs, counts, grouped, scale=scale)

    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            m.expert_dispatch = None
            want = m(x, dispatch="split")[0]
            m.expert_dispatch = here
            got = m(x, dispatch="split")[0]
        assert torch.equal(got, want), float((got - want).abs().max())
    m.expert_dispatch = None
    assert sent == [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, False)]
