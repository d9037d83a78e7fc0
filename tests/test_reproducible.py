"""Bit-identical reruns (training/reproducible.py): one recipe and seed on one machine with one
thread count gives the same weights (bytes) and metrics, in fp32 and bf16, with and without a
resume in the middle; a resumed session on another thread count says so."""

import json
import os
import signal

import pytest
import torch

from conceptmoe.errors import Interrupted
from conceptmoe.training import loop
from conceptmoe.training.reproducible import differences, resumed_environment
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus

TIMING = ("tokens_per_s", "mfu", "seconds", "elapsed")  # wall-clock figures: differ by nature


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _config(corpus, out, dtype):
    return TrainConfig(**TINY, data=str(corpus), out=str(out), max_steps=10, save_every=100, eval_every=5,
                       dtype=dtype, val_tokens=2048)


def _metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _interrupt_at(monkeypatch, at: int) -> None:
    """SIGTERM to this process when the loop reaches step ``at`` (once): the loop finishes the
    step, checkpoints and raises Interrupted, as under a cluster scheduler."""
    real, sent = loop.lr_factor, []

    def factor(step, *a):
        if step == at and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(step, *a)

    monkeypatch.setattr(loop, "lr_factor", factor)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_runs_and_a_resumed_one_are_identical(corpus, tmp_path, monkeypatch, dtype):
    torch.set_num_threads(1)
    a = train(_config(corpus, tmp_path / "a", dtype))
    b = train(_config(corpus, tmp_path / "b", dtype))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert _metrics(a) == _metrics(b)
    assert json.loads((a / "eval.json").read_text()) == json.loads((b / "eval.json").read_text())

    with monkeypatch.context() as m:  # killed after step 4, resumed from its checkpoint
        _interrupt_at(m, 4)
        with pytest.raises(Interrupted):
            train(_config(corpus, tmp_path / "c", dtype))
    assert (tmp_path / "c" / "checkpoints").is_dir() and not (tmp_path / "c" / "eval.json").exists()
    cfg = _config(corpus, tmp_path / "c", dtype)
    cfg.resume = True
    c = train(cfg)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()
    assert _metrics(a) == _metrics(c)
    env = json.loads((c / "config.json").read_text())["environment"]
    assert env["start"]["threads"] == 1 and env["resumed_on"] == []


def test_another_thread_count_is_named_on_resume():
    start = {"torch": "2.13.0", "threads": 2, "world": 1, "cpu_model": "X", "cpu_flags": ["avx2"]}
    record, note = resumed_environment(None, start)
    assert record == {"start": start, "resumed_on": []} and note is None
    same, note = resumed_environment({"environment": record}, dict(start))
    assert same == record and note is None
    now = {**start, "threads": 1}
    moved, note = resumed_environment({"environment": record}, now)
    assert "threads 2 -> 1" in note and "not bit-identical" in note
    assert moved["resumed_on"] == [now] and moved["start"] == start
    # back on the first environment: compared with the last one, so named again
    _, note = resumed_environment({"environment": moved}, start)
    assert "threads 1 -> 2" in note
    assert differences(start, {**start, "cpu_flags": ["avx2", "avx512f"]}) == [
        "cpu_flags 1 flags -> 2 flags (another instruction set)"]


def test_cuda_determinism_setting(monkeypatch):
    """CONCEPTMOE_CUDA_DETERMINISM: strict by default (flash attention's deterministic backward,
    no cuDNN attention: warn-only mode ran non-deterministic backwards on an H200), warn on request,
    anything else refused on every device; a change of mode is named on resume."""
    from conceptmoe.errors import UserError
    from conceptmoe.training import reproducible

    monkeypatch.delenv(reproducible.CUDA_DETERMINISM_ENV, raising=False)
    assert reproducible.cuda_determinism() == "strict"
    monkeypatch.setenv(reproducible.CUDA_DETERMINISM_ENV, " Warn ")
    assert reproducible.cuda_determinism() == "warn"
    monkeypatch.setenv(reproducible.CUDA_DETERMINISM_ENV, "loose")
    with pytest.raises(UserError, match="expected strict or warn"):
        reproducible.make_deterministic(torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()  # the CPU path changes nothing
    env = {"torch": "2.13.0", "threads": 16, "world": 1, "gpu": "H200", "deterministic": "warn"}
    assert differences(env, {**env, "deterministic": "strict"}) == ["deterministic warn -> strict"]


def test_a_run_names_its_code_commit(tmp_path):
    """config.json's environment names the checkout's commit (issue 53: a study record gives each
    run's code), "+dirty" when tracked files differ from it, "unknown" outside a checkout."""
    import subprocess

    from conceptmoe.training.reproducible import code_commit

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True).stdout

    assert code_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD").strip()
    assert code_commit(tmp_path) == head and len(head) == 40
    (tmp_path / "f.py").write_text("x = 2\n")
    assert code_commit(tmp_path) == head + "+dirty"
