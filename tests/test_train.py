"""Training runs end to end: files, metrics, checkpoints, reload, schedule (conceptmoe/train.py)."""

import json
import math

import numpy as np
import pytest
import torch

from conceptmoe.training import checkpoint as ck
from conceptmoe.model.config import ModelConfig
from conceptmoe.evaluation.evaluate import evaluate
from conceptmoe.training.validation import evaluate_tokens, windows
from conceptmoe.model.match import match_config
from conceptmoe.model import build_model
from conceptmoe.training.train import TrainConfig, default_out, lr_factor, model_config, train
from training_helpers import TINY, make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "cm"
    torch.set_num_threads(1)
    return train(TrainConfig(**TINY, data=str(corpus), out=str(out), max_steps=12, save_every=5,
                             eval_every=6))


def test_run_directory_contents(run):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "eval.json"):
        assert (run / name).is_file(), name
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["kind"] == "conceptmoe" and cfg["train"]["max_steps"] == 12
    # Only the newest checkpoint is kept, and it is the final step.
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000012"]
    assert not list(run.glob("*.tmp"))
    st = json.loads((run / "checkpoints/step-00000012/state.json").read_text())
    assert st["step"] == 12 and set(st["data_position"]) == {"epoch", "cursor"}


def test_metrics_rows(run):
    rows = ck.read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("loss", "lr", "compression", "tokens_per_s", "bpb", "ratio_loss", "balance_loss"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert [r["step"] for r in rows if "val_bpb" in r] == [6, 12]
    assert rows[-1]["tokens"] == 12 * 4 * 32
    assert rows[0]["loss"] > rows[-1]["loss"]  # it learns something even in 12 steps


def test_reload_gives_identical_eval(run):
    saved = json.loads((run / "eval.json").read_text())
    again = evaluate(run, device="cpu")
    for key in ("val_loss", "val_bpb", "compression", "tokens"):
        assert again[key] == saved[key], key
    # The final logged validation (a slice of the same held-out text) agrees too.
    rows = ck.read_metrics(run)
    assert rows[-1]["val_bpb"] == pytest.approx(saved["val_bpb"], rel=0.2)


def test_eval_on_other_data(run, tmp_path):
    f = tmp_path / "other.txt"
    f.write_text("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 5)
    res = evaluate(run, data=f, device="cpu")
    assert res["tokens"] == len(f.read_bytes()) - 1  # tiny preset: byte vocabulary, all but one predicted


def test_windows_predict_every_token_once():
    for n, t in [(10, 4), (9, 4), (4, 4), (2, 8), (100, 7)]:
        w = windows(n, t)
        assert w[0][0] == 0 and w[-1][1] == n
        assert sum(b - a - 1 for a, b in w) == n - 1
        assert all(w[i + 1][0] == w[i][1] - 1 for i in range(len(w) - 1))


def test_bpb_is_bits_over_bytes():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny", kind="moe"))
    ids = np.random.default_rng(0).integers(0, 256, size=300).astype(np.int32)
    lengths = np.full(256, 2, dtype=np.int64)  # pretend every token is 2 bytes
    res = evaluate_tokens(model, ids, lengths, seq_len=64)
    assert res["tokens"] == 299 and res["compression"] == 1.0
    assert res["val_bpb"] == pytest.approx(res["val_loss"] / math.log(2) / 2)


def test_lr_schedule():
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


def test_defaults_are_the_small_conceptmoe_at_r2():
    tc = TrainConfig()
    mc = model_config(tc)
    assert mc.kind == "conceptmoe" and mc.compression_ratio == 2.0 and mc.extra["preset"] == "small"
    assert mc == ModelConfig.from_preset("small")
    assert tc.total_steps * tc.batch_size * tc.seq_len >= 1_600_000 > (tc.total_steps - 1) * 8 * 256
    assert str(default_out(tc, mc)) == "runs/small-ConceptMoE-1L-top4-R2"


def test_strategy_builds_the_matched_config():
    tc = TrainConfig(preset="small", strategy="topk", ratio=2.0)
    want = match_config(ModelConfig.from_preset("small", kind="moe"), 2.0, "topk").config
    assert model_config(tc) == want
    abl = model_config(TrainConfig(preset="small", strategy="topk", overrides={"chunk_router": "linear"}))
    assert abl.chunk_router == "linear" and abl.concept_k == want.concept_k
    assert model_config(TrainConfig(preset="tiny", model="moe")).kind == "moe"
    assert model_config(TrainConfig(preset="tiny", ratio=1.5)).compression_ratio == 1.5


def test_chunk_router_gets_its_own_learning_rate(run):
    from conceptmoe.training.train import make_optimizer

    model = build_model(ModelConfig.from_preset("tiny"))
    opt = make_optimizer(model, TrainConfig(chunk_lr_mult=3.0))
    mults = {g["lr_mult"]: g for g in opt.param_groups}
    chunk_params = {id(p) for p in model.chunk.parameters()}
    assert {id(p) for p in mults[3.0]["params"]} == chunk_params
    assert mults[3.0]["weight_decay"] == 0.0


def test_moe_run_and_forced_overwrite(corpus, tmp_path):
    out = tmp_path / "moe"
    train(TrainConfig(**TINY, model="moe", data=str(corpus), out=str(out), max_steps=3))
    ev = json.loads((out / "eval.json").read_text())
    assert ev["compression"] == 1.0
    train(TrainConfig(**TINY, model="moe", data=str(corpus), out=str(out), max_steps=2, force=True))
    assert len(ck.read_metrics(out)) == 2


def test_cli_default_is_the_compute_matched_conceptmoe():
    from conceptmoe.cli import build_parser
    from conceptmoe.cli.training import train_config_from_args
    from conceptmoe.model.flops import count_flops

    parse = lambda *a: train_config_from_args(build_parser().parse_args(["train", *a]))  # noqa: E731
    tc, moe = parse(), parse("--model", "moe")
    assert tc.strategy == "topk" and moe.strategy is None
    spent = count_flops(model_config(tc))["activated_flops_per_token"]
    assert spent / count_flops(model_config(moe))["activated_flops_per_token"] == pytest.approx(1, abs=0.03)
    unmatched = parse("--strategy", "none")
    assert unmatched.strategy is None and model_config(unmatched).name == "ConceptMoE-1L-top4-R2"
    assert parse("--ratio", "1.5").strategy == "topk"


def test_trainer_anneals_the_boundary_sharpness(corpus, tmp_path, monkeypatch):
    """boundary_sharpness_final: each training step samples its boundaries at sharpness_at(step);
    validation still decides p >= 0.5; without it every step uses boundary_sharpness."""
    import conceptmoe.model.lm as lm

    seen, real = [], lm.boundaries

    def spy(p, training, noise, sharpness, uniforms=None):
        if training:
            seen.append(sharpness)
        return real(p, training, noise, sharpness, uniforms)

    monkeypatch.setattr(lm, "boundaries", spy)
    train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "anneal"), max_steps=5, eval_every=0,
                      val_tokens=200, dtype="fp32", overrides={"boundary_sharpness": 1.0,
                                                               "boundary_sharpness_final": 9.0}))
    assert seen == [1.0, 3.0, 5.0, 7.0, 9.0]
    seen.clear()
    train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "const"), max_steps=3, eval_every=0,
                      val_tokens=200, dtype="fp32", overrides={"boundary_sharpness": 2.0}))
    assert seen == [2.0] * 3


def test_trainer_switches_the_confidence_term_on_late(corpus, tmp_path, monkeypatch):
    """router_confidence_start: the trainer sets the model's weight from confidence_weight_at at
    every step (off for the first 60% of 5 steps, then 0.5); without a start it never overrides."""
    import conceptmoe.model.lm as lm

    seen, real = [], lm.ConceptMoELM.forward

    def spy(self, *a, **k):
        if self.training:
            seen.append(self.confidence_now)
        return real(self, *a, **k)

    monkeypatch.setattr(lm.ConceptMoELM, "forward", spy)
    conf = {"router_confidence_weight": 0.5}
    train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "late"), max_steps=5, eval_every=0,
                      val_tokens=200, dtype="fp32", overrides={**conf, "router_confidence_start": 0.6}))
    assert seen == [0.0, 0.0, 0.0, 0.5, 0.5]
    seen.clear()
    train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "always"), max_steps=3, eval_every=0,
                      val_tokens=200, dtype="fp32", overrides=conf))
    assert seen == [None] * 3
