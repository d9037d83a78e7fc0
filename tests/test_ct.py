"""``compare --init`` (issue 10 C): continual training of converted ConceptMoEs vs the continued MoE."""

import json

import pytest

from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.evaluation.continual import CTConfig, continual_compare
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus

SETTINGS = dict(ratios=[2.0], tokens=4 * 32 * 6, batch_size=4, seq_len=32, lr=3e-3, eval_every=3,
                device="cpu", progress=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ct")
    corpus = make_corpus(tmp / "corpus")
    return train(TrainConfig(model="moe", **TINY, data=str(corpus), out=str(tmp / "moe"), max_steps=10))


def test_ct_report(moe, tmp_path):
    out = continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "ct"), **SETTINGS))
    rep = json.loads((out / "report.json").read_text())
    labels = [r["label"] for r in rep["models"]]
    assert labels == ["moe", "R2-topk", "R2-loop2"]
    rows = {r["label"]: r for r in rep["models"]}
    assert rows["moe"]["name"].startswith("MoE") and rows["R2-loop2"]["config"]["concept_loops"] == 2
    for r in rep["models"]:
        assert r["curve"][0] == [0, r["val_bpb_start"]] and len(r["curve"]) == 3  # start, step 3, step 6
        assert r["recovered_at_tokens"] is None or r["recovered_at_tokens"] >= 0
    assert rows["moe"]["recovered_at_tokens"] == 0 and rows["moe"]["compression_start"] == 1.0
    stored = json.loads((out / "R2-topk" / "config.json").read_text())["train"]
    assert stored["init"] == str((out / "converted" / "R2-topk").resolve())
    assert (out / "report.md").read_text().count("| R2-") == 2 and (out / "curves.png").is_file()
    # Rerun with the same settings: nothing is retrained.
    mtime = (out / "moe" / "eval.json").stat().st_mtime_ns
    continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "ct"), **SETTINGS))
    assert (out / "moe" / "eval.json").stat().st_mtime_ns == mtime
    # Other models (a variant left out, a ratio added): the runs both comparisons have are kept.
    kept = {label: (out / label / "eval.json").stat().st_mtime_ns for label in ("moe", "R2-topk")}
    continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "ct"),
                               **{**SETTINGS, "ratios": [2.0, 1.5], "variants": ["topk"]}))
    rep = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in rep["models"]] == ["moe", "R2-topk", "R1.5-topk"]
    assert {label: (out / label / "eval.json").stat().st_mtime_ns for label in kept} == kept
    assert (out / "R2-loop2" / "eval.json").is_file()  # left out of this report, not deleted
    with pytest.raises(UserError, match="other settings"):
        continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "ct"), **{**SETTINGS, "lr": 1e-3}))


def test_ct_refusals(moe, tmp_path, capsys):
    with pytest.raises(UserError, match="ConceptMoE"):
        from conceptmoe.interop import convert_run
        CTConfig(init=str(convert_run(moe, tmp_path / "cm")))
    with pytest.raises(UserError, match="variants"):
        CTConfig(init=str(moe), variants=["layers"])
    assert main(["compare", "--init", str(moe), "--strategies", "layers", "--out", str(tmp_path / "x")]) == 2
    assert "topk" in capsys.readouterr().err
    assert main(["compare", "--chunk-lr-mult", "2", "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_ct_split(moe, tmp_path, capsys):
    """--split sets the conversions' stages; the comparison records it, so another split is another
    comparison."""
    out = tmp_path / "ct"
    continual_compare(CTConfig(init=str(moe), out=str(out), split="2+1+1", **{**SETTINGS, "variants": ["topk"]}))
    cfg = json.loads((out / "converted" / "R2-topk" / "config.json").read_text())["model"]
    assert (cfg["n_encoder_layers"], cfg["n_decoder_layers"], cfg["n_layers"]) == (2, 1, 4)
    assert json.loads((out / "ct.json").read_text())["split"] == "2+1+1"
    assert "conversions split 2+1+1." in (out / "report.md").read_text()
    with pytest.raises(UserError, match="other settings"):
        continual_compare(CTConfig(init=str(moe), out=str(out), **{**SETTINGS, "variants": ["topk"]}))
    # the default is written out (1 + 2 + 1 for this 4-layer MoE), so a changed default is another comparison
    assert CTConfig(init=str(moe), **SETTINGS).settings()["split"] == "1+2+1"
    with pytest.raises(UserError, match="covers 9 layers"):
        CTConfig(init=str(moe), split="3+3+3")
    assert main(["compare", "--split", "1+2+1", "--out", str(tmp_path / "y")]) == 2
    assert "--init" in capsys.readouterr().err and not (tmp_path / "y").exists()
    assert main(["compare", "--init", str(moe), "--split", "2+x+1", "--out", str(tmp_path / "z")]) == 2
    assert "--split must read E+C+D" in capsys.readouterr().err


def test_ct_log_watches_each_run_and_is_not_a_setting(moe, tmp_path):
    out = continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "ct"), log="jsonl",
                                     **{**SETTINGS, "variants": ["topk"]}))
    for label in ("moe", "R2-topk"):
        assert json.loads((out / label / "config.json").read_text())["train"]["log"] == "jsonl"
    assert "log" not in CTConfig(init=str(moe), log="jsonl", **SETTINGS).settings()


def test_ct_writes_a_recipe_that_reruns_it(moe, tmp_path, capsys):
    out = tmp_path / "ct"
    flags = ["--tokens", "384", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3", "--strategies", "loop",
             "--ratios", "1.5", "--device", "cpu", "--set", "ratio_loss_weight=0.05"]
    assert main(["compare", "--init", str(moe), *flags, "--out", str(out)]) == 0
    written = (out / "recipe.toml").read_text()
    assert 'strategies = ["loop"]' in written and "ratios = [1.5]" in written and 'split = "' in written
    assert "[set]" in written and "ratio_loss_weight = 0.05" in written and str(moe.resolve()) in written
    capsys.readouterr()
    assert main(["compare", "--init", str(moe), *flags, "--print-config"]) == 0
    assert capsys.readouterr().out == written  # what --print-config shows is what the comparison keeps
    done = (out / "R1.5-loop2" / "eval.json").stat().st_mtime_ns
    assert main(["compare", "--config", str(out / "recipe.toml"), "--out", str(out)]) == 0  # the same comparison
    assert (out / "R1.5-loop2" / "eval.json").stat().st_mtime_ns == done
