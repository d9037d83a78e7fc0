import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conceptmoe import ModelConfig, build_model
from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.model.flops import count_flops
from conceptmoe.model.match import match_config


@pytest.mark.parametrize("kw", [
    {"kind": "moe"},
    {"kind": "moe", "n_shared_experts": 0, "qk_norm": "full"},
    {},
    {"concept_loops": 2, "concept_top_k": 5, "shared_expert_gate": True},
    {"chunk_router": "linear", "joint_decoding": False},
    {"chunk_router": "fixed", "compression_ratio": 3.0},
    {"router_temperature": "learned"},
    {"elastic_ratios": [1.5, 2.0, 3.0], "ratio_embedding": "router+concept"},
])
def test_analytic_flops_match_flop_counter(kw):
    """Linear-layer FLOPs of a real forward pass equal the analytic count (attention map removed)."""
    m = build_model(ModelConfig.from_preset("tiny", **kw)).eval()
    m.dispatch = "loop"  # plain matmuls: FlopCounterMode has no formula for grouped_mm
    ids = torch.randint(0, 256, (1, 96))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        out = m(ids)
    counts = fc.get_flop_counts()["Global"]
    # Remove the attention map (SDPA) and the dechunk scan's block matmuls (bmm), which are
    # not linear layers; everything left is a linear-layer matmul.
    linear = sum(v for op, v in counts.items() if "scaled_dot" not in str(op) and "bmm" not in str(op))
    comp = out.aux["compression"] if m.cfg.is_concept else None
    analytic = count_flops(m.cfg, 96, comp)["activated_flops_per_token"] * 96
    assert linear == pytest.approx(analytic, rel=0.02)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_param_count_matches_model(preset, kind):
    cfg = ModelConfig.from_preset(preset, kind=kind, concept_loops=2, concept_n_experts=5, concept_top_k=2)
    assert count_flops(cfg)["total_params"] == build_model(cfg).num_params()


@pytest.mark.parametrize("kw", [
    {"router_temperature": "learned"},
    *({"elastic_ratios": [1.5, 2.0, 3.0, 4.0], "ratio_embedding": mode}
      for mode in ("shift", "router", "router+concept")),
    {"elastic_ratios": [2.0, 3.0], "router_temperature": "learned", "chunk_router": "cosine"},
])
def test_param_count_matches_elastic_and_tempered_models(kw):
    # "equal total parameters" must hold for these too: the learned temperature (1 scalar) and the
    # ratio embedding's tables (K shifts, K vectors per mode) count like every other parameter
    cfg = ModelConfig.from_preset("tiny", **kw)
    n = build_model(cfg).num_params()
    assert n > build_model(ModelConfig.from_preset("tiny")).num_params()
    assert count_flops(cfg)["total_params"] == n
    assert count_flops(cfg)["activated_params"] - count_flops(ModelConfig.from_preset("tiny"))["activated_params"] \
        == n - build_model(ModelConfig.from_preset("tiny")).num_params()


def test_concept_savings_scale_with_R():
    moe = count_flops(ModelConfig.from_preset("paper", kind="moe"), 8192)
    c2 = count_flops(ModelConfig.from_preset("paper", compression_ratio=2.0), 8192)
    c4 = count_flops(ModelConfig.from_preset("paper", compression_ratio=4.0), 8192)
    assert c4["activated_flops_per_token"] < c2["activated_flops_per_token"] < moe["activated_flops_per_token"]
    # Concept layers' attention map shrinks ~R²: the per-token attention cost of the 23 concept
    # layers at R=2 is ~1/4 of the same layers in the baseline.
    per_layer = moe["attention_map_flops_per_token"] / 27
    concept_part = c2["attention_map_flops_per_token"] - 4 * per_layer
    assert concept_part / (23 * per_layer) == pytest.approx(0.25, rel=0.01)
    kv_expected = (4 + 23 / 2) / 27
    assert c2["kv_cache_bytes_per_token"] / moe["kv_cache_bytes_per_token"] == pytest.approx(kv_expected)


@pytest.mark.parametrize("preset", ["small", "paper"])
@pytest.mark.parametrize("ratio", [1.5, 2.0])
@pytest.mark.parametrize("strategy", ["topk", "layers", "loop"])
def test_match_within_tolerance(preset, ratio, strategy):
    base = ModelConfig.from_preset(preset, kind="moe")
    res = match_config(base, ratio, strategy)
    assert abs(res.flops_ratio - 1) <= 0.03 and abs(res.params_ratio - 1) <= 0.03
    cfg = res.config
    assert cfg.is_concept and cfg.compression_ratio == ratio
    # The ratios are recomputed, not copied.
    f, b = count_flops(cfg), count_flops(base)
    assert res.flops_ratio == pytest.approx(f["activated_flops_per_token"] / b["activated_flops_per_token"])
    assert res.name.startswith("ConceptMoE-") and res.name.endswith(f"-R{ratio:g}")
    if strategy == "topk":
        assert cfg.concept_k > base.top_k and cfg.n_layers == base.n_layers
    elif strategy == "layers":
        assert cfg.n_layers > base.n_layers and cfg.concept_experts < base.n_experts
    else:
        assert cfg.concept_loops > 1 and cfg.n_layers == base.n_layers


def test_cli_flops_json(capsys):
    assert main(["flops", "--preset", "small", "--seq-len", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("total_params", "activated_params", "activated_flops_per_token",
                "attention_map_flops_per_token", "kv_cache_bytes_per_token"):
        assert out[key] > 0
    assert out["seq_len"] == 1024
    assert main(["flops", "--preset", "small", "--set", "kind=moe", "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)
    assert moe["kind"] == "moe" and moe["attention_map_flops_per_token"] > out["attention_map_flops_per_token"]


def test_cli_match_json(capsys):
    assert main(["match", "--baseline", "small", "--ratio", "2", "--strategy", "loop", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"config", "name", "flops_ratio", "params_ratio"} <= set(out)
    assert ModelConfig.from_dict(out["config"]).concept_loops > 1
    assert abs(out["flops_ratio"] - 1) <= 0.03


@pytest.mark.parametrize("argv", [
    ["flops", "--preset", "nope"],
    ["flops", "--set", "top_k=99"],
    ["flops", "--set", "bogus=1"],
    ["flops", "--seq-len", "0"],
    ["match", "--ratio", "1"],
    ["match", "--baseline", "tiny", "--ratio", "1.5", "--strategy", "loop"],
])
def test_cli_bad_input_one_line_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


@pytest.mark.parametrize("preset, multiple", [("tiny", 2), ("small", 2), ("small", 4), ("small", 8)])
@pytest.mark.parametrize("strategy", ["topk", "layers", "loop"])
def test_match_with_a_shardable_expert_count(preset, multiple, strategy):
    base = ModelConfig.from_preset(preset, kind="moe")
    try:
        res = match_config(base, 2.0, strategy, experts_multiple_of=multiple)
    except UserError as e:  # tiny has 8 experts: not every strategy finds a multiple within 3%
        assert preset == "tiny" and "--experts-multiple-of" in str(e)
        return
    free = match_config(base, 2.0, strategy)
    assert res.config.concept_experts % multiple == 0 and res.config.n_experts % multiple == 0
    assert res.error <= 0.03
    assert res.constraint == {"experts_multiple_of": multiple, "error": res.error, "unconstrained_error": free.error}
    assert res.error >= free.error - 1e-12  # the constraint can only cost
    assert res.to_dict()["constraint"] == res.constraint and "constraint" not in free.to_dict()
    f = count_flops(res.config)
    assert res.flops_ratio == pytest.approx(f["activated_flops_per_token"] / res.baseline["activated_flops_per_token"])


def test_the_small_default_match_is_shardable_when_asked():
    base = ModelConfig.from_preset("small", kind="moe")
    assert match_config(base, 2.0, "topk").config.concept_experts == 29  # prime: no EP degree shards it
    assert match_config(base, 2.0, "topk", experts_multiple_of=2).config.concept_experts % 2 == 0
    with pytest.raises(UserError, match="--experts-multiple-of 3: the baseline's token-rate layers have 32"):
        match_config(base, 2.0, "topk", experts_multiple_of=3)
    with pytest.raises(UserError, match="multiple of 8 concept experts"):
        match_config(ModelConfig.from_preset("tiny", kind="moe"), 2.0, "topk", experts_multiple_of=8)


def test_cli_match_reports_the_cost_of_the_constraint(capsys):
    assert main(["match", "--baseline", "small", "--ratio", "2", "--experts-multiple-of", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("experts a multiple of 4: matching error 1.51% (unconstrained 0.39%)"), line
    assert main(["match", "--baseline", "small", "--ratio", "2", "--experts-multiple-of", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["constraint"]["experts_multiple_of"] == 4
