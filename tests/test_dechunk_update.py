"""``dechunk_source="update"`` and ``joint_layers`` (issue 10 B): full forward, cached decode, FLOPs.

The dechunk may carry the concept model's update c_out - c_in instead of its output. With every
token a concept (fixed router, R = 1) the ConceptMoE is then exactly the MoE made of the same
blocks; with a trained-like router (R > 1) every cached decode step still equals the full pass.
"""

import pytest
import torch

from conceptmoe import ModelConfig, build_model, count_flops
from conceptmoe.inference import decode_step, prefill
from conceptmoe.model.config import parse_overrides
from method_helpers import right_padded, trained_like

LENS = [5, 17, 9, 30]
N_NEW = 30
MARGIN = 1e-5


def _as_moe(cm):
    """The MoE whose layers are the ConceptMoE's encoder + concept + decoder blocks, in order."""
    moe = build_model(cm.cfg.replace(kind="moe", concept_loops=1, joint_layers=None))
    state = {k: v for k, v in cm.state_dict().items() if not k.startswith(("encoder.", "concept.", "decoder.", "chunk."))}
    blocks = list(cm.encoder) + list(cm.concept) + list(cm.decoder)
    for i, blk in enumerate(blocks):
        state.update({f"layers.{i}.{k}": v for k, v in blk.state_dict().items() if ".j" not in k})
    moe.load_state_dict(state)
    return moe.eval()


@pytest.mark.parametrize("pooling", ["boundary", "mean"])
def test_update_at_ratio_one_is_the_moe_of_the_same_blocks(pooling):
    cm = trained_like(seed=3, chunk_router="fixed", compression_ratio=1.0, dechunk_source="update",
                      concept_pooling=pooling, joint_decoding=False).eval()
    ids = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        got, want = cm(ids), _as_moe(cm)(ids)
        assert bool(got.boundaries.all()) and got.aux["compression"] == 1.0
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        # The reference wiring counts the encoder state twice: far from the MoE.
        ref = cm.cfg.replace(dechunk_source="output")
        cm.cfg = ref
        assert (cm(ids).logits - want.logits).abs().max() > 1e-2


@pytest.mark.parametrize("overrides", [
    {},
    {"concept_pooling": "mean", "concept_loops": 2},
    {"n_layers": 5, "n_decoder_layers": 2, "joint_layers": 1},
    {"chunk_router": "fixed", "compression_ratio": 1.0},
])
def test_update_wiring_cached_steps_match_full_forward(overrides):
    model = trained_like(seed=0, dechunk_source="update", **overrides).eval()
    ids = right_padded(LENS, 1)
    g = torch.Generator().manual_seed(101)
    with torch.no_grad():
        out, state = prefill(model, ids, torch.tensor(LENS), extra_capacity=N_NEW)
        seqs, logits = [ids[i, :n].tolist() for i, n in enumerate(LENS)], [out.logits]
        for _ in range(N_NEW):
            tok = torch.multinomial(out.logits.float().softmax(-1), 1, generator=g)[:, 0]
            for i, t in enumerate(tok.tolist()):
                seqs[i].append(t)
            out = decode_step(model, state, tok)
            logits.append(out.logits)
        for i, n in enumerate(LENS):
            full = model(torch.tensor(seqs[i])[None])
            if model.cfg.chunk_router != "fixed":
                assert (full.chunks.p[0, 1:] - 0.5).abs().min() > MARGIN, "p on the threshold: pick another seed"
            got = torch.stack([step[i] for step in logits])
            torch.testing.assert_close(got, full.logits[0, n - 1:], atol=1e-4, rtol=0)
            assert state.boundaries[i] == full.boundaries[0].nonzero().flatten().tolist()


def test_update_and_output_differ_when_trained_like():
    """The two wirings are different functions (so the cached test above can tell them apart)."""
    ids = right_padded([24], 3)
    with torch.no_grad():
        a = trained_like(seed=0, dechunk_source="update").eval()(ids).logits
        b = trained_like(seed=0).eval()(ids).logits
    assert (a - b).abs().max() > 1e-2


def test_joint_layers_last_k_only():
    cfg = ModelConfig.from_preset("tiny", n_layers=6, n_decoder_layers=3, joint_layers=2)
    m = build_model(cfg)
    assert [blk.attn.joint for blk in m.decoder] == [False, True, True]
    assert cfg.n_joint_layers == 2 and cfg.replace(joint_layers=None).n_joint_layers == 3
    assert cfg.replace(joint_decoding=False).n_joint_layers == 0
    d, kvd = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_joint = 2 * (d * cfg.n_heads * cfg.head_dim + 2 * d * kvd)
    full, two = count_flops(cfg.replace(joint_layers=None)), count_flops(cfg)
    assert full["activated_flops_per_token"] - two["activated_flops_per_token"] == per_joint
    assert full["total_params"] - two["total_params"] == per_joint // 2
    assert two["total_params"] == m.num_params()
    with pytest.raises(ValueError, match="joint_layers"):
        cfg.replace(joint_layers=4)
    assert parse_overrides(["joint_layers=none", "dechunk_source=update"]) == {
        "joint_layers": None, "dechunk_source": "update"}


def test_late_fields_are_stored_only_when_set():
    cfg = ModelConfig.from_preset("small")
    assert "dechunk_source" not in cfg.to_dict() and "joint_layers" not in cfg.to_dict()
    new = cfg.replace(dechunk_source="update", joint_layers=0)
    assert new.to_dict()["dechunk_source"] == "update" and new.to_dict()["joint_layers"] == 0
    assert ModelConfig.from_json(new.to_json()) == new
    with pytest.raises(ValueError, match="dechunk_source"):
        cfg.replace(dechunk_source="input")
    with pytest.raises(ValueError, match="compression_ratio"):
        cfg.replace(compression_ratio=1.0)  # R = 1 only with the fixed router
    assert cfg.replace(compression_ratio=1.0, chunk_router="fixed").compression_ratio == 1.0
