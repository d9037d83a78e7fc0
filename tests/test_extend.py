"""Chunked prefill: ``prefill`` of a first piece then ``extend`` of the rest equals ``prefill`` of the whole.

Rows of different lengths take chunks of different sizes (some rows none in a chunk); the logits,
the concept boundaries, the cache lengths and the decode steps that follow must all agree with the
one-pass prefill, for a MoE, a ConceptMoE (last and mean pooling, "update" dechunk) and an elastic
model with a ratio per row, on dense caches.
"""

from __future__ import annotations

import pytest
import torch
from method_helpers import trained_like

from conceptmoe import ModelConfig, build_model
from conceptmoe.inference.extend import extend
from conceptmoe.inference.steps import decode_step, prefill


def _model(kind: str):
    if kind == "moe":
        torch.manual_seed(1)
        return build_model(ModelConfig.from_preset("tiny", kind="moe")).eval()
    if kind == "elastic":
        return trained_like(0, elastic_ratios=[1.5, 2.0, 3.0], ratio_embedding="router+concept").eval()
    if kind == "mean":
        return trained_like(1, concept_pooling="mean", dechunk_source="update").eval()
    if kind == "stages":
        return trained_like(2, stage_norms=True, stage_skip=True).eval()
    return trained_like(0).eval()


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows])


@pytest.mark.parametrize("kind", ["moe", "conceptmoe", "mean", "elastic", "stages"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_pass(kind, chunk):
    m = _model(kind)
    g = torch.Generator().manual_seed(3)
    lens = [23, 9, 40, 17]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    ratio = torch.tensor([1.5, 3.0, 2.0, 3.0]) if kind == "elastic" else None
    ids, lengths = _padded(prompts)
    ref_out, ref = prefill(m, ids, lengths, ratio=ratio)
    first = [max(1, n // 3) for n in lens]
    ids0, l0 = _padded([p[:k] for p, k in zip(prompts, first)])
    out, st = prefill(m, ids0, l0, ratio=ratio)
    done, last = list(first), out.logits.clone()
    while any(d < n for d, n in zip(done, lens)):
        take = [min(chunk, n - d) for d, n in zip(done, lens)]
        idc, _ = _padded([p[d:d + k] for p, d, k in zip(prompts, done, take)])
        o = extend(m, st, idc, torch.tensor(take))
        for b, k in enumerate(take):
            if k:
                last[b] = o.logits[b]
        done = [d + k for d, k in zip(done, take)]
    torch.testing.assert_close(last, ref_out.logits, atol=1e-4, rtol=1e-4)
    assert st.tokens.lengths == ref.tokens.lengths
    if ref.concepts is not None:
        assert st.boundaries == ref.boundaries and st.concepts.lengths == ref.concepts.lengths
        assert st.boundaries != [[0]] * len(lens), "no boundary past the first token: nothing was tested"
        torch.testing.assert_close(st.dechunk.z, ref.dechunk.z, atol=1e-4, rtol=1e-4)
    tok = ref_out.logits.argmax(-1)
    for _ in range(4):  # the states go on to decode alike
        a, b = decode_step(m, ref, tok), decode_step(m, st, tok)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
        tok = a.logits.argmax(-1)
