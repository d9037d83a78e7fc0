"""Correctness items from review (issue 8, part E): names, the token-rate top-k, the linear
router's start, grouped_mm's stride rule, FLOPs at the realised compression."""

import json

import pytest
import torch

from conceptmoe import ModelConfig, build_model
from conceptmoe.bench.calibrate import calibrate_router
from conceptmoe.model.chunking import boundaries, sharpen
from conceptmoe.model.flops import count_flops
from conceptmoe.model.match import match_config
from conceptmoe.model.moe import MoE
from conceptmoe.evaluation.compare import CompareConfig, build_report, render_markdown
from conceptmoe.training.checkpoint import RUN_FORMAT
from conceptmoe.training.config import TrainConfig


# ----- E1, E2: names -----
def test_loop_and_layers_get_different_names():
    base = ModelConfig.from_preset("small", kind="moe", n_encoder_layers=1, n_decoder_layers=1)
    layers = match_config(base, 2.0, "layers")
    loop = match_config(base, 2.0, "loop")
    assert layers.config.concept_loops == 1 and loop.config.concept_loops == 2
    assert layers.name == "ConceptMoE-2L-top3-R2" and loop.name == "ConceptMoE-2L-loop2-top3-R2"
    cfg = ModelConfig.from_preset("tiny", concept_loops=3)
    assert cfg.name == "ConceptMoE-3L-loop3-top2-R2"


def test_match_shows_a_moved_token_topk_and_only_then():
    moved = match_config(ModelConfig.from_preset("paper", kind="moe"), 2.0, "topk")
    assert moved.config.top_k != 8
    assert moved.name == f"ConceptMoE-1L-top{moved.config.concept_k}-tokentop{moved.config.top_k}-R2"
    d = moved.to_dict()
    assert d["token_top_k"] == {"baseline": 8, "matched": moved.config.top_k}
    assert ModelConfig.from_dict(d["config"]).name == moved.name  # the name survives config.json
    kept = match_config(ModelConfig.from_preset("small", kind="moe"), 2.0, "topk")
    assert kept.config.top_k == 4 and "tokentop" not in kept.name
    assert "token_top_k" not in kept.to_dict() and "base_top_k" not in kept.config.extra


# ----- E3: threshold rules and the linear router's start -----
def test_sharpen_and_the_eval_rule_agree_on_the_side_of_one_half():
    p = torch.cat([torch.linspace(0, 1, 1001), torch.tensor([0.5, 0.5 - 1e-7, 0.5 + 1e-7])])
    assert torch.equal(sharpen(p, 6.0) >= 0.5, p >= 0.5)
    assert float(sharpen(torch.tensor(0.5), 6.0)) == pytest.approx(0.5 ** (1 / 6))
    # At p = 0.5 exactly, training samples a boundary more often than not, as eval takes one.
    p_half = torch.full((1, 4000), 0.5)
    torch.manual_seed(0)
    assert boundaries(p_half, training=True, noise=True, sharpness=6.0).float().mean() > 0.8
    assert boundaries(p_half, training=False, noise=True, sharpness=6.0).all()


@pytest.mark.parametrize("R", [1.5, 2.0, 4.0])
def test_linear_router_starts_near_one_over_R_in_train_and_eval(R):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny", chunk_router="linear", compression_ratio=R))
    ids = torch.randint(0, 256, (4, 256))
    with torch.no_grad():
        rate_eval = model.eval()(ids).boundaries.float().mean().item()
        rate_train = model.train()(ids).boundaries.float().mean().item()
    assert rate_eval == pytest.approx(1 / R, abs=0.06)
    assert rate_train == pytest.approx(1 / R, abs=0.06)


def test_calibrated_linear_router_hits_the_ratio_exactly():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny", chunk_router="linear", compression_ratio=3.0)).eval()
    ids = torch.randint(0, 256, (2, 300))
    h = model.encode(ids)[0]
    n = 2 * (round(300 / 3.0) - 1)
    calibrate_router(model, h[:, 1:].flatten(0, 1), h[:, :-1].flatten(0, 1), n)
    assert int(model(ids).boundaries.sum()) == 2 * round(300 / 3.0)


# ----- E4: grouped_mm needs 16-byte strides -----
@pytest.mark.parametrize("d,hidden,dtype", [(24, 18, torch.float32), (34, 16, torch.float32),
                                            (36, 18, torch.float32), (24, 18, torch.bfloat16),
                                            (24, 16, torch.float32)])
def test_grouped_dispatch_falls_back_when_strides_do_not_fit(d, hidden, dtype):
    torch.manual_seed(0)
    moe = MoE(d, 6, 2, hidden, n_shared=1).to(dtype)
    x = torch.randn(40, d, dtype=dtype, requires_grad=True)
    g = torch.randn(40, d, dtype=dtype)
    ref, _ = moe(x, "loop")
    ref_grads = torch.autograd.grad(ref, [x, moe.w_gate, moe.w_down], g)
    y, _ = moe(x, "grouped")
    grads = torch.autograd.grad(y, [x, moe.w_gate, moe.w_down], g)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


def test_model_with_expert_hidden_18_trains_a_step():
    model = build_model(ModelConfig.from_preset("tiny", expert_hidden=18))
    ids = torch.randint(0, 256, (2, 24))
    model(ids, labels=ids).loss.backward()
    assert model.concept[0].moe.w_gate.grad.abs().sum() > 0


# ----- E5: compare reports FLOPs at the realised compression -----
def _fake_run(run, compression):
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"format": RUN_FORMAT, "model": {}, "data": {"train_tokens": 1000}}))
    (run / "eval.json").write_text(json.dumps({"val_bpb": 2.0, "val_loss": 1.4, "compression": compression,
                                               "p_histogram": [1] * 20}))
    (run / "metrics.jsonl").write_text(json.dumps({"tokens": 100, "tokens_per_s": 50.0, "val_bpb": 2.1}) + "\n")


def test_compare_report_has_flops_at_the_realised_compression(tmp_path):
    cc = CompareConfig(preset="tiny", out=str(tmp_path), seq_len=32, device="cpu", seeds=[0])
    models = [("moe", TrainConfig(preset="tiny", model="moe")),
              ("topk-R2", TrainConfig(preset="tiny", strategy="topk", ratio=2.0))]
    _fake_run(tmp_path / "moe" / "seed0", 1.0)
    _fake_run(tmp_path / "topk-R2" / "seed0", 3.1)  # compressed more than R = 2: fewer concept FLOPs
    rep = build_report(cc, models)
    assert rep["data"]["epochs"] == pytest.approx(100 / 1000)  # tokens trained / the data's training tokens
    base, cm = rep["models"]
    assert base["activated_flops_per_token_realised"] == base["activated_flops_per_token"]
    cfg = ModelConfig.from_dict(cm["config"])
    concept = cm["activated_flops_per_token"] - cm["activated_flops_per_token_realised"]
    per_pass = count_flops(cfg, 32, compression=1.0)["breakdown_flops_per_token"]["concept_layers"]
    assert concept == pytest.approx(per_pass * (1 / 2.0 - 1 / 3.1))  # concept layers scale with 1/R
    md = render_markdown(rep)
    assert "at realised compression" in md
    row = next(line for line in md.splitlines() if line.startswith("| topk-R2 |"))
    assert f"| {cm['activated_flops_per_token'] / 1e6:.2f} | {cm['activated_flops_per_token_realised'] / 1e6:.2f} |" in row
