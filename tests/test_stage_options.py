"""Dynamic chunking's training recipe (issue 67): stage norms, the learned skip, per-stage learning
rates and the tuning split.

The cached, chunked and vLLM paths with these options are held to the forward pass in
test_generate.py, test_extend.py and test_vllm_configs.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from method_helpers import trained_like
from training_helpers import make_corpus, run_cli

from conceptmoe import ModelConfig, build_model
from conceptmoe.data.corpus import HELD_OUT_PLAYS, TUNING_PLAYS, load_corpus
from conceptmoe.errors import UserError
from conceptmoe.model.flops import count_flops
from conceptmoe.model.match import match_config
from conceptmoe.training.config import TrainConfig, model_config
from conceptmoe.training.train import make_optimizer


def test_a_zero_skip_and_unit_norm_gains_change_nothing_but_the_norms():
    """At initialisation the skip projection is zero: the model is the one without it, weight for
    weight (the same random numbers drawn for every other parameter)."""
    torch.manual_seed(4)
    plain = build_model(ModelConfig.from_preset("tiny"))
    torch.manual_seed(4)
    skip = build_model(ModelConfig.from_preset("tiny", stage_skip=True))
    assert torch.count_nonzero(skip.skip.weight) == 0
    sd = skip.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in plain.state_dict().items())
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    plain.eval(), skip.eval()
    assert torch.equal(plain(ids).logits, skip(ids).logits)


@pytest.mark.parametrize("option", ["stage_norms", "stage_skip"])
def test_each_option_changes_the_forward_pass(option):
    """The training forward reads each option (a path that ignored one would pass the cache tests)."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    on = trained_like(3, **{option: True}).eval()
    off = trained_like(3).eval()
    off.load_state_dict({k: v for k, v in on.state_dict().items() if k in off.state_dict()})
    assert not torch.allclose(on(ids).logits, off(ids).logits, atol=1e-4)


def test_the_encoder_norm_feeds_router_concepts_and_skip():
    """With stage norms the router sees the normed encoder output: scaling the encoder's last
    residual stream (by scaling the norm's input) leaves p unchanged."""
    m = trained_like(5, stage_norms=True).eval()
    h = torch.randn(1, 12, m.cfg.d_model)
    assert torch.allclose(m.route(m.encoder_out(h), None), m.route(m.encoder_out(3 * h), None), atol=1e-5)


def test_the_skip_and_norms_are_counted_in_flops_and_matching():
    base = ModelConfig.from_preset("small", kind="moe")
    cm = match_config(base, 2.0).config
    d = cm.d_model
    f0, f1 = count_flops(cm), count_flops(cm.replace(stage_skip=True, stage_norms=True))
    assert f1["activated_flops_per_token"] - f0["activated_flops_per_token"] == 2 * d * d
    assert f1["total_params"] - f0["total_params"] == d * d + 2 * d
    assert f1["breakdown_flops_per_token"]["stage_skip"] == 2 * d * d
    # A ConceptMoE with the skip is matched with it: no more compute than the MoE's, within tolerance.
    res = match_config(base.replace(stage_skip=True), 2.0)
    assert res.config.stage_skip and abs(res.flops_ratio - 1) <= 0.03
    mb = build_model(res.config)
    assert mb.num_params() == count_flops(res.config)["total_params"]


def test_train_matches_the_skip_from_set():
    tc = TrainConfig(strategy="topk", overrides={"stage_skip": True, "stage_norms": True})
    mc = model_config(tc)
    assert mc.stage_skip and mc.stage_norms
    assert count_flops(mc)["activated_flops_per_token"] <= 1.03 * count_flops(
        ModelConfig.from_preset("small", kind="moe"))["activated_flops_per_token"]


def _groups(tc: TrainConfig, cfg: ModelConfig):
    opt = make_optimizer(build_model(cfg), tc)
    return {g["name"]: g for g in opt.param_groups}


def test_without_stage_rates_the_groups_are_the_old_ones():
    groups = _groups(TrainConfig(lr=1e-3, chunk_lr_mult=0.5), ModelConfig.from_preset("tiny", stage_norms=True))
    assert list(groups) == ["decay", "no_decay", "chunk"]
    assert [groups[n]["lr_mult"] for n in groups] == [1.0, 1.0, 0.5]
    assert TrainConfig().to_dict().get("stage_lr_mults", "absent") == "absent"  # old configs unchanged


def test_stage_rates_put_every_concept_parameter_in_its_stage():
    cfg = ModelConfig.from_preset("tiny", stage_norms=True, stage_skip=True, concept_loops=2)
    m = build_model(cfg)
    tc = TrainConfig(lr=2e-3, stage_lr_mults=[1.5, 0.25], chunk_lr_mult=2.0)
    opt = make_optimizer(m, tc)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))
    for name, p in m.named_parameters():
        g = by_param[id(p)]
        if name.startswith(("concept.", "concept_norm.")):
            assert g["name"].startswith("concept_") and g["lr_mult"] == 0.25, name
        elif name.startswith("chunk."):
            assert g["name"] == "chunk" and g["lr_mult"] == 3.0, name
        else:
            assert g["name"] in ("decay", "no_decay") and g["lr_mult"] == 1.5, name
    assert by_param[id(m.concept_norm.weight)]["weight_decay"] == 0.0
    assert by_param[id(m.skip.weight)]["weight_decay"] == tc.weight_decay


def test_stage_rates_auto_is_the_rule_and_bad_values_are_one_line_errors():
    assert TrainConfig(stage_lr_mults="auto", ratio=4.0).stage_lr_mults == [1.0, 0.5]
    assert TrainConfig(stage_lr_mults="1,0.7").stage_lr_mults == [1.0, 0.7]
    for bad in ("1", "0,1", "1,-1", "a,b", "1,nan", [1, 2, 3]):
        with pytest.raises(UserError, match="--stage-lr-mults"):
            TrainConfig(stage_lr_mults=bad)
    with pytest.raises(UserError, match="plain MoE"):
        TrainConfig(model="moe", stage_lr_mults="auto")
    assert math.isclose(TrainConfig(stage_lr_mults="auto").stage_lr_mults[1], 2 ** -0.5, rel_tol=1e-5)


def test_the_tuning_split_never_reads_the_held_out_plays():
    tune, main = load_corpus("shakespeare-tune"), load_corpus("shakespeare")
    names = {d.name for d in tune.train + tune.val}
    assert not names & set(HELD_OUT_PLAYS)
    assert {d.name for d in tune.val} == set(TUNING_PLAYS)
    assert not {d.name for d in tune.train} & set(TUNING_PLAYS)
    assert {d.name for d in tune.train} | set(TUNING_PLAYS) == {d.name for d in main.train}
    assert tune.record()["split"] == "tuning plays" and tune.record()["sha256"] != main.record()["sha256"]


def test_train_cli_records_stage_rates_and_refuses_bad_ones(tmp_path):
    out, data = tmp_path / "run", make_corpus(tmp_path / "data")
    r = run_cli("train", "--preset", "tiny", "--data", str(data), "--max-steps", "2", "--batch-size", "2",
                "--seq-len", "32", "--eval-every", "0", "--val-tokens", "512", "--device", "cpu",
                "--stage-lr-mults", "auto", "--set", "stage_norms=true", "--out", str(out))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["stage_lr_mults"] == [1.0, 0.707107] and cfg["model"]["stage_norms"] is True
    assert "stage_lr_mults = [1.0, 0.707107]" in (out / "recipe.toml").read_text()
    r = run_cli("train", "--resume", "--out", str(out), "--stage-lr-mults", "1,1", "--max-steps", "2")
    assert r.returncode != 0 and "--stage-lr-mults" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("train", "--model", "moe", "--stage-lr-mults", "auto", "--out", str(tmp_path / "m"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "MoE" in r.stderr
