"""The MoE-versus-ConceptMoE comparison end to end on the tiny preset (conceptmoe/compare.py)."""

import dataclasses
import json

import pytest
import torch

from conceptmoe.training import checkpoint as ck
from conceptmoe.evaluation.compare import CompareConfig, compare, plan, verdict
from conceptmoe.errors import UserError
from conceptmoe.model.flops import count_flops
from conceptmoe.training.train import model_config
from training_helpers import make_corpus


def _cfg(corpus, out, **kw):
    return CompareConfig(**{**dict(preset="tiny", tokens=4 * 32 * 4, batch_size=4, seq_len=32, lr=3e-3, seeds=[0],
                                   device="cpu", data=str(corpus), out=str(out)), **kw})


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("cmp")
    corpus = make_corpus(tmp / "corpus")
    cc = _cfg(corpus, tmp / "out", seeds=[0, 1], ablations=True)
    return compare(cc), cc


def test_report_files_and_rows(report_dir):
    out, cc = report_dir
    rep = json.loads((out / "report.json").read_text())
    labels = [r["label"] for r in rep["models"]]
    assert labels == ["moe", "topk-R2", "topk-R2-linear-router", "topk-R2-fixed-chunks",
                      "topk-R2-no-joint", "topk-R2-no-noise"]
    for r in rep["models"]:
        assert len(r["val_bpb_seeds"]) == 2 and r["val_bpb_std"] >= 0
        assert r["train_tokens_per_s"] > 0 and r["total_params"] > 0 and r["curve"]
    base, cm = rep["models"][0], rep["models"][1]
    assert base["compression"] == 1.0 and base["name"] == "MoE-top2"
    # The matched ConceptMoE spends what the baseline spends (within the solver's 3%).
    assert cm["activated_flops_per_token"] / base["activated_flops_per_token"] == pytest.approx(1, abs=0.03)
    assert cm["total_params"] / base["total_params"] == pytest.approx(1, abs=0.03)
    assert cm["attention_map_flops_per_token"] < base["attention_map_flops_per_token"]
    md = (out / "report.md").read_text()
    assert "| moe | MoE-top2 |" in md and "## Verdict" in md and len(rep["verdict"]) == 5
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_shared_tokenizer(report_dir):
    out, _ = report_dir
    shared = (out / "tokenizer.json").read_text()
    runs = list(out.glob("*/seed*"))
    assert len(runs) == 12
    assert all((r / "tokenizer.json").read_text() == shared for r in runs)
    seeds = {json.loads((r / "config.json").read_text())["train"]["seed"] for r in runs}
    assert seeds == {0, 1}


def test_rerun_skips_finished_runs_and_refuses_other_settings(report_dir):
    out, cc = report_dir
    before = {r: (r / "model.safetensors").stat().st_mtime_ns for r in out.glob("*/seed*")}
    compare(cc)
    assert {r: (r / "model.safetensors").stat().st_mtime_ns for r in out.glob("*/seed*")} == before
    with pytest.raises(UserError, match="different settings"):
        compare(_cfg(cc.data, out, seeds=[0], lr=1e-3))
    assert {r: (r / "model.safetensors").stat().st_mtime_ns for r in out.glob("*/seed*")} == before


def test_concept_knob_retrains_only_conceptmoe(tmp_path):
    torch.set_num_threads(1)
    corpus = make_corpus(tmp_path / "corpus")
    out = compare(_cfg(corpus, tmp_path / "out"))
    stamp = lambda label: (out / label / "seed0" / "model.safetensors").stat().st_mtime_ns  # noqa: E731
    moe, cm = stamp("moe"), stamp("topk-R2")
    tuned = _cfg(corpus, out, overrides={"ratio_loss_weight": 0.1})
    with pytest.raises(UserError, match="topk-R2/seed0"):
        compare(tuned)
    compare(dataclasses.replace(tuned, force=True))
    assert stamp("moe") == moe and stamp("topk-R2") != cm
    cfg = json.loads((out / "topk-R2" / "seed0" / "config.json").read_text())
    assert cfg["model"]["ratio_loss_weight"] == 0.1


def test_interrupted_comparison_resumes(tmp_path):
    torch.set_num_threads(1)
    corpus = make_corpus(tmp_path / "corpus")
    cc = _cfg(corpus, tmp_path / "out")
    out = compare(cc)
    run = out / "topk-R2" / "seed0"
    want = [r["loss"] for r in ck.read_metrics(run)]
    (run / "eval.json").unlink()  # as if killed after the step-4 checkpoint, before the end
    compare(cc)
    assert [r["loss"] for r in ck.read_metrics(run)] == want and (run / "eval.json").is_file()


def test_plan_and_verdict():
    cc = CompareConfig(preset="small", strategies=["topk", "loop"], ratios=[1.5, 2.0], out="x")
    labels = [label for label, _ in plan(cc)]
    assert labels == ["moe", "topk-R1.5", "loop-R1.5", "topk-R2", "loop-R2"]
    for _, tc in plan(cc)[1:]:
        cfg = model_config(tc)
        assert count_flops(cfg)["activated_flops_per_token"] == pytest.approx(
            count_flops(model_config(plan(cc)[0][1]))["activated_flops_per_token"], rel=0.03)
    rows = [{"label": "moe", "name": "MoE", "val_bpb": 2.0, "compression": 1.0, "ratio": 1.0},
            {"label": "a", "name": "A", "val_bpb": 1.9, "compression": 2.1, "ratio": 2.0},
            {"label": "b", "name": "B", "val_bpb": 2.1, "compression": 2.5, "ratio": 2.0}]
    v = verdict(rows)
    assert "<= baseline" in v[0] and "within 10%" in v[0]
    assert "> baseline" in v[1] and "outside 10%" in v[1]


def test_bad_settings():
    with pytest.raises(UserError, match="--ratios"):
        CompareConfig(ratios=[1.0])
    with pytest.raises(UserError, match="--seeds"):
        CompareConfig(seeds=[1, 1])


def test_report_states_the_epochs_of_the_training_data(report_dir):
    out, cc = report_dir
    rep = json.loads((out / "report.json").read_text())
    record = json.loads((out / "moe" / "seed0" / "config.json").read_text())["data"]
    trained = max(m["tokens"] for m in ck.read_metrics(out / "moe" / "seed0"))
    assert trained >= cc.tokens
    assert rep["data"]["train_tokens"] == record["train_tokens"] and rep["data"]["sha256"] == record["sha256"]
    assert rep["data"]["epochs"] == pytest.approx(trained / record["train_tokens"])
    assert all(r["epochs"] == pytest.approx(rep["data"]["epochs"]) for r in rep["models"])
    md = (out / "report.md").read_text()
    assert f"Training data: {record['train_tokens']:,} tokens" in md
    assert f"**{rep['data']['epochs']:.2f} epochs**" in md


def test_report_flags_more_than_two_epochs():
    from conceptmoe.evaluation.compare_report import data_epochs, data_line

    record = {"source": "python-stdlib", "sha256": "ab" * 32, "train_tokens": 1000, "val_tokens": 50,
              "recipe": {"version": "CPython 3.11.7", "sha256": "cd" * 32}}
    two = data_epochs(record, [[{"tokens": 1000}, {"tokens": 2000}], [{"tokens": 2000}]])
    assert two["epochs"] == 2.0 and two["tokens_trained"] == 2000 and two["recipe"] == record["recipe"]
    assert "**2.00 epochs**" in data_line(two) and "not a headline" not in data_line(two)
    assert "CPython 3.11.7, fingerprint cdcdcdcdcdcd" in data_line(two)
    three = data_epochs(record, [[{"tokens": 3000}]])
    assert "**3.00 epochs**" in data_line(three) and "More than 2 epochs" in data_line(three)
    assert data_epochs({}, [[{"tokens": 10}]])["epochs"] is None
    assert "epochs unknown" in data_line(data_epochs({}, [[{"tokens": 10}]]))
