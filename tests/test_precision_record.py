"""Which precision a run was computed in is recorded (config.json ``precision``), kept when the run is
resumed on a machine with another default, shown by `compare` and pinned by `compare --dtype`."""

import json

import pytest

from conceptmoe import device
from conceptmoe.errors import UserError
from conceptmoe.evaluation.compare import CompareConfig, compare
from conceptmoe.evaluation.compare_report import precision_line
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus


def _precision(run):
    return json.loads((run / "config.json").read_text())["precision"]


def test_a_resumed_run_keeps_its_precision(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    base = dict(**TINY, data=str(corpus), out=str(run), eval_every=0, val_tokens=200, save_every=1)
    monkeypatch.setenv(device.BF16_ENV, "0")  # a machine without fast bf16: fp32 by default
    train(TrainConfig(**base, max_steps=2))
    assert _precision(run) == "fp32"
    monkeypatch.setenv(device.BF16_ENV, "1")  # moved to a machine whose default is bf16
    train(TrainConfig(**base, max_steps=3, resume=True))
    assert _precision(run) == "fp32" and len(ck.read_metrics(run)) == 3  # resumed, not switched
    train(TrainConfig(**base, max_steps=4, resume=True, dtype="bf16"))  # switched on request: both recorded
    assert _precision(run) == "fp32,bf16" and len(ck.read_metrics(run)) == 4
    train(TrainConfig(**base, max_steps=5, resume=True))  # and kept from then on
    assert _precision(run) == "fp32,bf16"
    train(TrainConfig(**{**base, "out": str(tmp_path / "fresh")}, max_steps=1))  # a new run: the default
    assert _precision(tmp_path / "fresh") == "bf16"


def test_compare_dtype_is_recorded_and_pinned(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    cfg = dict(preset="tiny", tokens=2 * 32 * 4, batch_size=4, seq_len=32, seeds=[0], device="cpu",
               data=str(corpus), out=str(tmp_path / "cmp"))
    out = compare(CompareConfig(**cfg, dtype="fp32"))
    rep = json.loads((out / "report.json").read_text())
    assert [m["precision"] for m in rep["models"]] == [["fp32"], ["fp32"]]
    assert rep["settings"]["dtype"] == "fp32"
    assert "Precision: fp32 for every run." in (out / "report.md").read_text()
    with pytest.raises(UserError, match="different settings"):  # finished in fp32: not reused as bf16
        compare(CompareConfig(**cfg, dtype="bf16"))
    compare(CompareConfig(**cfg))  # no --dtype: the finished runs count, whatever they ran in
    with pytest.raises(UserError, match="--dtype"):
        CompareConfig(**cfg, dtype="fp16")


def test_precision_line_spells_out_a_mix():
    same = [{"label": "moe", "seeds": [0, 1], "precision": ["bf16", "bf16"]}]
    assert precision_line(same) == "Precision: bf16 for every run.\n"
    mixed = same + [{"label": "topk-R2", "seeds": [0, 1], "precision": ["bf16", None]}]
    line = precision_line(mixed)
    assert "topk-R2 seed 1: not recorded" in line and "moe seed 0: bf16" in line
    assert precision_line([{"label": "moe", "seeds": [0], "precision": [None]}]) == ""
