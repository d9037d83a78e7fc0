"""An elastic run realises every trained R at inference on more than one corpus
(training/ratio_calibration.py, issue 41): the threshold shift of each trained ratio is moved on
training text at the end, model.safetensors takes the moves, the checkpoint keeps its weights."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conceptmoe.evaluation.evaluate import evaluate
from conceptmoe.training import ratio_calibration, train as train_module
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus

RATIOS = [[1.5, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]]
TOLERANCE = 0.15  # the band `train` and `eval` warn outside of


def code_corpus(folder: Path, n: int = 8, chars: int = 8000) -> Path:
    """A second kind of text: the start of some of this Python's standard-library modules."""
    folder.mkdir(parents=True, exist_ok=True)
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-m]*.py"))[:n]
    for f in src:
        (folder / f"{f.stem}.txt").write_text(f.read_text(encoding="utf-8", errors="replace")[:chars], encoding="utf-8")
    return folder


def _elastic(corpus: Path, out: Path) -> Path:
    torch.set_num_threads(1)
    return train(TrainConfig(**{**TINY, "lr": 3e-3}, data=str(corpus), out=str(out), ratios=RATIOS, max_steps=40,
                             eval_every=0, overrides={"ratio_loss_weight": 0.3}))


def _realised(run: Path) -> dict[float, float]:
    return {r: evaluate(run, device="cpu", ratio=r)["compression"] for r, _ in RATIOS}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpora")
    return {"plays": make_corpus(base / "plays"), "code": code_corpus(base / "code")}


@pytest.mark.parametrize("kind", ["plays", "code"])
def test_every_trained_ratio_is_realised_on_held_out_text(corpora, tmp_path, kind):
    run = _elastic(corpora[kind], tmp_path / kind)
    got = _realised(run)
    off = {r: round(c / r - 1, 3) for r, c in got.items() if abs(c / r - 1) > TOLERANCE}
    assert not off, f"{kind}: realised compression off by more than 15% at {off}"
    rec = json.loads((run / "eval.json").read_text())["calibration"]
    assert [r["ratio"] for r in rec["ratios"]] == [1.5, 2.0, 3.0, 4.0]
    assert all(abs(r["after"] / r["ratio"] - 1) < 0.05 for r in rec["ratios"])  # on the training slice
    # model.safetensors holds the moved shifts; the checkpoint keeps the trained ones
    ckpt = next((run / "checkpoints").iterdir()) / "model.safetensors"
    moved = load_file(run / "model.safetensors")["ratio_embed.shift"] - load_file(ckpt)["ratio_embed.shift"]
    assert torch.allclose(moved, torch.tensor([r["shift_move"] for r in rec["ratios"]]), atol=1e-6)
    assert (run / "model.safetensors").stat().st_ino != ckpt.stat().st_ino


def test_without_calibration_the_rule_misses(corpora, tmp_path, monkeypatch):
    """What the calibration fixes: the same run without it leaves some R outside the band."""
    monkeypatch.setattr(train_module, "_calibrate", lambda *a, **k: None)
    run = _elastic(corpora["code"], tmp_path / "raw")
    got = _realised(run)
    assert any(abs(c / r - 1) > TOLERANCE for r, c in got.items()), got


def test_training_slice_restores_the_position():
    from conceptmoe.data.corpus import BatchSampler
    import numpy as np

    s = BatchSampler(np.arange(4096, dtype=np.int64), seq_len=16, batch_size=4, seed=0)
    s.next(), s.next(), s.next()  # not where drawing the 2-batch slice from the start would leave it
    pos = dict(s.position)
    ids = ratio_calibration.training_slice(s, n_tokens=128)
    assert ids.shape == (8, 16) and s.position == pos
    fresh = BatchSampler(np.arange(4096, dtype=np.int64), seq_len=16, batch_size=4, seed=0)
    assert torch.equal(ids[:4], fresh.next())  # the first batches of epoch 0
