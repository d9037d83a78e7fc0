"""A learned router whose held-out compression is far from its target R is reported (one stderr line)
by `train` and `eval`: the study found R = 4 realising 22-46 (docs/study-elastic/README.md)."""

import pytest

from conceptmoe.evaluation.evaluate import compression_warning
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus


def test_warning_only_beyond_the_tolerance_and_for_learned_routers():
    assert compression_warning(2.2, 2.0) is None  # +10%
    assert compression_warning(1.75, 2.0) is None  # -12.5%
    far = compression_warning(22.49, 4.0)
    assert far.startswith("warning: held-out compression 22.49 is +462% off the target R = 4") and "\n" not in far
    assert "-37%" in compression_warning(1.26, 2.0)
    assert compression_warning(9.0, 2.0, "fixed") is None  # fixed chunking realises R by construction
    assert compression_warning(float("nan"), 2.0) is None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cw")
    corpus = make_corpus(root / "c", n_docs=3, chars=3000)
    return train(TrainConfig(**TINY, data=str(corpus), out=str(root / "run"), max_steps=1, eval_every=0,
                             val_tokens=300, dtype="fp32"))


@pytest.mark.parametrize("realised, warned", [(9.0, True), (2.1, False)])
def test_eval_prints_the_warning(run, monkeypatch, capsys, realised, warned):
    import conceptmoe.cli.training as cli
    from conceptmoe.cli import main

    monkeypatch.setattr(cli, "evaluate", lambda *a, **k: {"val_loss": 4.0, "val_bpb": 2.0, "compression": realised,
                                                          "tokens": 300})
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("warning: held-out compression 9.00 is +350% off the target R = 2" in err) == warned
