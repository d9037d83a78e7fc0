"""``train --init RUN`` (issue 10 C): a run starts from another run's weights and tokenizer, resumes exactly."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.interop import convert_run
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from test_resume import _kill_after, _strip
from training_helpers import TINY, make_corpus


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init")
    corpus = make_corpus(tmp / "corpus")
    run = train(TrainConfig(model="moe", **TINY, data=str(corpus), out=str(tmp / "moe"), max_steps=8))
    return corpus, run


def test_init_starts_from_the_weights_and_tokenizer(moe, tmp_path):
    corpus, src = moe
    cm = convert_run(src, tmp_path / "cm", ratio=1.5)
    run = train(TrainConfig(**{**TINY, "lr": 1e-12}, data=str(corpus), init=str(cm), out=str(tmp_path / "ct"),
                            max_steps=1, warmup_steps=0))
    a, b = load_file(cm / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6  # lr ~ 0: still the init weights
    assert (run / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    stored = ck.read_run_config(run)
    assert stored["model"] == ck.read_run_config(cm)["model"]
    assert stored["train"]["init"] == str(cm.resolve())
    # A normal rate moves them: the loaded weights are really trained.
    run2 = train(TrainConfig(**TINY, data=str(corpus), init=str(cm), out=str(tmp_path / "ct2"), max_steps=2))
    c = load_file(run2 / "model.safetensors")
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-4


def test_init_refusals(moe, tmp_path, capsys):
    corpus, src = moe
    with pytest.raises(UserError, match="--strategy"):
        TrainConfig(**TINY, init=str(src), strategy="topk")
    with pytest.raises(UserError, match="different runs"):
        TrainConfig(**TINY, init=str(src), out=str(src))
    with pytest.raises(UserError, match="no run"):
        TrainConfig(**TINY, init=str(tmp_path))
    with pytest.raises(UserError, match="do not fit"):
        train(TrainConfig(**TINY, data=str(corpus), init=str(src), out=str(tmp_path / "x"), max_steps=1,
                          overrides={"n_experts": 4, "top_k": 2}))
    assert main(["train", "--init", str(src), "--preset", "tiny", "--out", str(tmp_path / "y")]) == 2
    assert "leave out --preset" in capsys.readouterr().err


def test_init_run_resumes_exactly_without_the_init_run(moe, tmp_path):
    corpus, src = moe
    cm = convert_run(src, tmp_path / "cm", ratio=2.0)
    args = ["--init", str(cm), "--data", str(corpus), "--max-steps", "24", "--save-every", "5",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "8", "--device", "cpu"]
    from training_helpers import run_cli
    ref = run_cli("train", *args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    want = _strip(ck.read_metrics(tmp_path / "ref"))
    out = tmp_path / "killed"
    import test_resume
    saved = test_resume._args
    test_resume._args = lambda corpus, o: ["train", *args, "--out", str(o)]
    try:
        assert _kill_after(corpus, out, 7) < 24
    finally:
        test_resume._args = saved
    shutil.move(cm, tmp_path / "gone")  # resuming needs only the run itself
    res = run_cli("train", *args[2:], "--out", str(out), "--resume")
    assert res.returncode == 0, res.stderr
    assert _strip(ck.read_metrics(out)) == want
    assert json.loads((out / "eval.json").read_text())["val_bpb"] == json.loads((tmp_path / "ref" / "eval.json").read_text())["val_bpb"]


def test_default_lr_follows_the_model_kind(moe, tmp_path):
    """Without --lr a MoE trains at 2e-3 and a ConceptMoE at 1e-3 (the study's finding), also when the
    kind comes from --init; an explicit --lr wins; the stored config records the rate used."""
    corpus, src = moe
    assert (TrainConfig().lr, TrainConfig(model="moe").lr, TrainConfig(strategy="loop").lr) == (1e-3, 2e-3, 1e-3)
    assert TrainConfig(model="moe", lr=5e-4).lr == 5e-4
    no_lr = {k: v for k, v in TINY.items() if k != "lr"}
    run = train(TrainConfig(model="moe", **no_lr, data=str(corpus), out=str(tmp_path / "moe"), max_steps=1))
    assert ck.read_run_config(run)["train"]["lr"] == 2e-3
    assert next(r["lr"] for r in ck.read_metrics(run)) > 0
    cm = convert_run(src, tmp_path / "cm", ratio=1.5)
    assert TrainConfig(init=str(src)).lr == 2e-3 and TrainConfig(init=str(cm)).lr == 1e-3
    with pytest.raises(UserError, match="--lr"):
        TrainConfig(lr=0.0)


@pytest.fixture(scope="module")
def elastic(moe, tmp_path_factory):
    """An elastic run (trained for 1.5, 2, 3) whose ratio tables are random and independent, so
    that rows taken by position differ from rows interpolated onto other ratios."""
    import torch
    from safetensors.torch import save_file

    corpus, _ = moe
    run = train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path_factory.mktemp("el") / "el"),
                            max_steps=2, ratios="1.5,2,3"))
    w = load_file(str(run / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for k in [k for k in w if k.startswith("ratio_embed.")]:
        w[k] = torch.randn(w[k].shape, generator=g) * 0.3
    save_file(w, str(run / "model.safetensors"))
    return corpus, run


@pytest.mark.parametrize("ratios", ["2,3,4", "2,2.5,3,5"])  # same size (rows by position), another size
def test_init_elastic_reinterpolates_the_ratio_tables(elastic, tmp_path, ratios, capsys):
    import torch

    from conceptmoe.model.elastic import RatioEmbedding

    corpus, src = elastic
    new = [float(r) for r in ratios.split(",")]
    run = train(TrainConfig(**{**TINY, "lr": 1e-12, "progress": True}, data=str(corpus), init=str(src),
                            out=str(tmp_path / "ct"), max_steps=1, ratios=ratios))
    assert "re-interpolated (in log R) onto --ratios " + ratios in capsys.readouterr().err
    # --init loads the source's model.safetensors (calibrated shifts); the new run's checkpoint holds what
    # it trained from them (its model.safetensors is calibrated again: training/ratio_calibration.py)
    ckpt = next((run / "checkpoints").iterdir()) / "model.safetensors"
    old_w, new_w = load_file(str(src / "model.safetensors")), load_file(str(ckpt))
    old = RatioEmbedding([1.5, 2.0, 3.0], new_w["ratio_embed.router"].shape[1], "router", 2.0)
    old.load_state_dict({k.split(".", 1)[1]: v for k, v in old_w.items() if k.startswith("ratio_embed.")})
    want = old(torch.tensor(new))  # what the init run serves at the new ratios (5: extrapolated)
    assert torch.allclose(new_w["ratio_embed.shift"], want.shift, atol=1e-5)
    assert torch.allclose(new_w["ratio_embed.router"], want.router, atol=1e-5)
    assert json.loads((run / "config.json").read_text())["model"]["elastic_ratios"] == new


def test_init_refuses_ratios_it_cannot_start(moe, elastic, tmp_path):
    _, src = moe
    with pytest.raises(UserError, match="--ratios: --init .* is a plain MoE run"):
        TrainConfig(**TINY, init=str(src), ratios="2,3")
    _, el = elastic
    with pytest.raises(UserError, match="--ratios: --init .* cannot start them: R=8 is too far"):
        TrainConfig(**TINY, init=str(el), ratios="2,8")
    with pytest.raises(UserError, match="design ratio R=2"):
        TrainConfig(**TINY, init=str(el), ratios="2.5,3")
