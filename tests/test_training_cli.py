"""The train / eval / compare / boundaries commands: output, and bad input as one-line errors.

Every error case checks: exit code 2, exactly one line on stderr starting with ``error:``, no
traceback, and (where a run exists) that the run's files are unchanged afterwards.
"""

import hashlib
import json
import shutil

import pytest
import torch

from conceptmoe.cli import main
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs") / "cm"
    return train(TrainConfig(**TINY, data=str(corpus), out=str(out), max_steps=4, save_every=2))


@pytest.fixture
def run(base_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


def _digest(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}  # the lock holds a pid


def _fails(capsys, argv, match):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and match in lines[0], err


def _tiny_train(corpus, out, *extra):
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--max-steps", "2",
            "--batch-size", "4", "--seq-len", "32", "--device", "cpu", *extra]


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"), (b"", "empty"), (b"caf\xe9 latin-1\n", "not UTF-8")])
def test_train_bad_data(capsys, tmp_path, content, match):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    _fails(capsys, _tiny_train(data, tmp_path / "out"), match)
    assert not (tmp_path / "out").exists()  # nothing was written


def test_refuses_existing_run_and_leaves_it_intact(capsys, corpus, run):
    before = _digest(run)
    _fails(capsys, _tiny_train(corpus, run), "already holds a run")
    _fails(capsys, _tiny_train(corpus, run, "--resume", "--preset", "small"), "different model config")
    _fails(capsys, _tiny_train(corpus, run, "--resume", "--set", "d_model=64"), "different model config")
    _fails(capsys, _tiny_train(corpus, run, "--resume", "--seed", "5"), "different seed")
    _fails(capsys, _tiny_train(corpus / "nope.txt", run, "--force"), "does not exist")
    assert _digest(run) == before


def test_resume_without_a_run(capsys, corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(capsys, _tiny_train(corpus, tmp_path / "empty", "--resume"), "holds no run")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    _fails(capsys, _tiny_train(corpus, tmp_path / "junk"), "not empty and holds no run")


def test_corrupted_weights(capsys, run):
    (run / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    _fails(capsys, ["eval", str(run)], "corrupted")
    _fails(capsys, ["boundaries", str(run), "--text", "hello"], "corrupted")
    _fails(capsys, _tiny_train("unused", run, "--resume"), "")  # checkpoint shares the damaged file


def test_truncated_weights(capsys, run):
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").unlink()  # break the hard link: only the top-level copy is damaged
    (run / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(capsys, ["eval", str(run)], "corrupted")


def test_bad_flags(capsys, corpus, tmp_path):
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--set", "nonsense=1"), "unknown model field")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--set", "d_model=30"), "d_model")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--model", "moe", "--strategy", "topk"), "--strategy")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--ratio", "1"), "--ratio")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--batch-size", "0"), "--batch-size")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--tokens", "100"), "not both")
    _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--seq-len", "100000"), "fewer than --seq-len")
    _fails(capsys, ["eval", str(tmp_path)], "holds no run")
    _fails(capsys, ["compare", "--strategies", "topk,bogus", "--out", str(tmp_path / "c")], "--strategies")
    if not torch.cuda.is_available():
        _fails(capsys, _tiny_train(corpus, tmp_path / "o", "--device", "cuda"), "CUDA is not available")
    assert not (tmp_path / "o").exists()


def test_eval_json(capsys, run):
    assert main(["eval", str(run), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"val_loss", "val_bpb", "compression", "tokens", "health"}  # health: tests/test_watch.py
    saved = json.loads((run / "eval.json").read_text())
    assert {k: v for k, v in res.items() if k != "health"} == {k: v for k, v in saved.items() if k in res}


def test_train_cli_prints_summary(capsys, corpus, tmp_path):
    assert main(_tiny_train(corpus, tmp_path / "r")) == 0
    out = capsys.readouterr().out
    assert "run saved to" in out and "val_bpb" in out
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["max_steps"] == 2


def test_boundaries_cli(capsys, run, tmp_path):
    html = tmp_path / "b.html"
    assert main(["boundaries", str(run), "--text", "Hello, world! <b>", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "tokens/concept" in out and "Hello" in out
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "&lt;" in page and "<b>" not in page
    assert "<script" not in page and "http" not in page  # self-contained
    _fails(capsys, ["boundaries", str(run), "--file", str(tmp_path / "missing.txt")], "does not exist")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    _fails(capsys, ["boundaries", str(run), "--file", str(tmp_path / "bin.txt")], "not UTF-8")
    _fails(capsys, ["boundaries", str(run), "--text", "   "], "empty")


def test_boundaries_refuses_moe(capsys, corpus, tmp_path):
    out = tmp_path / "moe"
    train(TrainConfig(**TINY, model="moe", data=str(corpus), out=str(out), max_steps=1))
    _fails(capsys, ["boundaries", str(out), "--text", "hello"], "plain MoE")
