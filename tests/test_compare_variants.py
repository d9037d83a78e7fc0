"""`conceptmoe compare --variants FILE`, the wall-clock curves and the router-decisiveness report."""

import json

import pytest
import torch

from conceptmoe.errors import UserError
from conceptmoe.evaluation.compare import (CompareConfig, decisiveness, _train_seconds, compare, load_variants,
                                         plan)
from conceptmoe.training.validation import P_BINS, evaluate_tokens
from conceptmoe.training.train import model_config
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model
from training_helpers import make_corpus, run_cli

VARIANTS = {"split-enc2": {"set": {"n_encoder_layers": 2}, "seeds": [1]},
            "slow-router": {"set": {"ratio_loss_weight": 0.1}, "chunk_lr_mult": 0.5, "lr": 1e-3}}


def _cfg(corpus, out, **kw):
    return CompareConfig(**{**dict(preset="tiny", tokens=4 * 32 * 4, batch_size=4, seq_len=32, lr=3e-3, seeds=[0],
                                   device="cpu", data=str(corpus), out=str(out)), **kw})


def test_variants_train_their_seeds_and_report(tmp_path):
    torch.set_num_threads(1)
    corpus = make_corpus(tmp_path / "corpus")
    out = compare(_cfg(corpus, tmp_path / "out", seeds=[0, 1], variants=VARIANTS))
    assert sorted(p.name for p in (out / "split-enc2").iterdir()) == ["seed1"]  # only the seeds asked for
    assert sorted(p.name for p in (out / "slow-router").iterdir()) == ["seed0", "seed1"]
    split = json.loads((out / "split-enc2" / "seed1" / "config.json").read_text())
    assert split["model"]["n_encoder_layers"] == 2 and split["train"]["seed"] == 1
    slow = json.loads((out / "slow-router" / "seed0" / "config.json").read_text())
    assert slow["model"]["ratio_loss_weight"] == 0.1 and slow["train"]["chunk_lr_mult"] == 0.5
    assert slow["train"]["lr"] == 1e-3  # the variant's own learning rate; the others keep --lr
    assert json.loads((out / "topk-R2" / "seed0" / "config.json").read_text())["train"]["lr"] == 3e-3
    rep = {r["label"]: r for r in json.loads((out / "report.json").read_text())["models"]}
    assert list(rep) == ["moe", "topk-R2", "split-enc2", "slow-router"]
    assert rep["split-enc2"]["seeds"] == [1] and len(rep["split-enc2"]["val_bpb_seeds"]) == 1
    assert rep["moe"]["seeds"] == [0, 1] and "p_histogram" not in rep["moe"]
    for label in ("topk-R2", "split-enc2", "slow-router"):
        r = rep[label]
        first = json.loads((out / label / f"seed{r['seeds'][0]}" / "eval.json").read_text())
        assert r["p_histogram"] == first["p_histogram"] and len(r["p_histogram"]) == P_BINS
        assert 0 <= r["p_near_half"] <= 1 and 0 <= r["p_decisive"] <= 1
        secs = [s for s, _ in r["curve_seconds"]]
        assert secs == sorted(secs) and secs[0] > 0 and len(secs) == len(r["curve"])
    assert rep["slow-router"]["lr"] == 1e-3 and rep["moe"]["lr"] == rep["split-enc2"]["lr"] == 3e-3
    md = (out / "report.md").read_text()
    assert "(lr 0.001) |" in md and md.count("(lr ") == 1
    assert "| split-enc2 |" in md and "## Router decisiveness" in md
    assert (out / "p_hist.png").read_bytes()[:4] == b"\x89PNG"


def test_variant_file_errors(tmp_path):
    bad = tmp_path / "v.json"
    for text, msg in [("{", "not valid JSON"), ("[]", "non-empty JSON object"),
                      ('{"x": {"ratio": 1}}', "ratio must be"), ('{"moe": {}}', "label"),
                      ('{"a b": {}}', "label"), ('{"x": {"sett": {}}}', "unknown key"),
                      ('{"x": {"seeds": [5]}}', "subset of --seeds"), ('{"x": {"strategy": "wide"}}', "strategy"),
                      ('{"x": {"chunk_lr_mult": -1}}', "chunk_lr_mult"), ('{"x": {"lr": 0}}', "lr must be"),
                      ('{"x": {"lr": "1e-3"}}', "lr must be")]:
        bad.write_text(text)
        with pytest.raises(UserError, match=msg):
            CompareConfig(variants=load_variants(str(bad)), out=str(tmp_path / "o"))
    with pytest.raises(UserError, match="cannot read"):
        load_variants(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="already has a model"):
        plan(CompareConfig(variants={"topk-R2": {}}, out="x"))
    cc = CompareConfig(preset="tiny", variants={"x": {"set": {"no_such_field": 1}}}, out="x")
    with pytest.raises(UserError, match="no_such_field"):
        model_config(plan(cc)[-1][1])


def test_variants_cli_error_is_one_line(tmp_path):
    bad = tmp_path / "v.json"
    bad.write_text('{"x": {"seeds": [3]}}')
    r = run_cli("compare", "--preset", "tiny", "--variants", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "subset of --seeds" in r.stderr
    assert not (tmp_path / "o").exists()


def test_train_seconds_sum_step_times():
    rows = [{"tokens": 100, "tokens_per_s": 50.0}, {"tokens": 200, "tokens_per_s": 100.0, "val_bpb": 3.0},
            {"tokens": 300, "tokens_per_s": 25.0}, {"tokens": 400, "tokens_per_s": 100.0, "val_bpb": 2.5}]
    assert _train_seconds(rows) == {200: 3.0, 400: 8.0}


def test_p_histogram_counts_every_position_but_the_first():
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", kind="conceptmoe")
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (200,)).numpy()
    res = evaluate_tokens(model, ids, torch.ones(cfg.vocab_size, dtype=torch.long).numpy(), seq_len=32)
    n_windows = len(range(0, 199, 31))  # windows of 32 overlapping by one token
    assert sum(res["p_histogram"]) == 200 + n_windows - 1 - n_windows
    moe = build_model(ModelConfig.from_preset("tiny", kind="moe"))
    assert "p_histogram" not in evaluate_tokens(moe, ids, torch.ones(cfg.vocab_size).long().numpy(), seq_len=32)
    d = decisiveness([1, 0, 0, 0, 0, 0, 0, 0, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4])
    assert d["p_near_half"] == pytest.approx(5 / 10) and d["p_decisive"] == pytest.approx(5 / 10)
    assert d["p_above_half"] == pytest.approx(4 / 10)  # bins 10-19


def test_each_model_trains_at_its_default_lr_unless_lr_is_given():
    cc = CompareConfig(out="x", variants={"v": {"lr": 5e-4}})
    assert {label: tc.lr for label, tc in plan(cc)} == {"moe": 2e-3, "topk-R2": 1e-3, "v": 5e-4}
    assert {label: tc.lr for label, tc in plan(CompareConfig(out="x", lr=3e-3))} == {"moe": 3e-3, "topk-R2": 3e-3}


def test_a_comparison_made_at_one_lr_says_how_to_continue_it(tmp_path):
    """Comparisons made before the per-model default learning rates (one --lr for all) resume with
    that --lr; without it the one-line error says so."""
    corpus = make_corpus(tmp_path / "corpus")
    compare(_cfg(corpus, tmp_path / "out"))  # lr 3e-3 for both
    with pytest.raises(UserError, match=r"topk-R2/seed0.*pass --lr 0.003 to continue it"):
        compare(_cfg(corpus, tmp_path / "out", lr=None))
    compare(_cfg(corpus, tmp_path / "out"))  # the same --lr: every run reused
