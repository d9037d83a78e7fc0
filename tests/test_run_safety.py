"""Run directories nothing can corrupt: one writer, stored data, refused resumes, signals, divergence.

Real subprocesses where the property is about processes (locks, signals); every refusal checks
exit code 2, one line on stderr, and that the run's files are byte-for-byte unchanged.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus, run_cli

TIMING = ("tokens_per_s",)
STEPS = 60


def _digest(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}  # the lock holds a pid


def _one_line_error(res, *needles):
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(n in lines[0] for n in needles), res.stderr


def _strict(text):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _train_args(data, out, steps=STEPS, *extra):
    return ["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--max-steps", str(steps),
            "--save-every", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "5",
            "--device", "cpu", "--seed", "3", *extra]


def _start(args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "conceptmoe", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_rows(proc, out, rows, timeout=120):
    deadline = time.time() + timeout
    while len(ck.read_metrics(out)) < rows or ck.latest_checkpoint(out) is None:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.01)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted run every interrupted one must equal."""
    out = tmp_path_factory.mktemp("ref") / "run"
    res = run_cli(*_train_args(corpus, out))
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_a_checkpoint_and_resume_equals_uninterrupted(corpus, reference, tmp_path, sig, code):
    out = tmp_path / "run"
    proc = _start(_train_args(corpus, out))
    _wait_rows(proc, out, 6)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped by") and "--resume" in last, err
    steps = [r["step"] for r in ck.read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < STEPS
    assert int(ck.latest_checkpoint(out).name.split("-")[1]) == steps[-1]  # not lost: saved on the signal
    res = run_cli("train", "--out", str(out), "--resume")
    assert res.returncode == 0, res.stderr
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(ck.read_metrics(out)) == strip(ck.read_metrics(reference))
    assert json.loads((out / "eval.json").read_text()) == json.loads((reference / "eval.json").read_text())


def test_second_writer_refused_while_readers_work(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _start(_train_args(corpus, out, 100_000))
    try:
        _wait_rows(proc, out, 6)
        _one_line_error(run_cli(*_train_args(corpus, out, 100_000), "--resume"), str(out), f"pid {proc.pid}")
        _one_line_error(run_cli(*_train_args(corpus, out, 10), "--force"), "in use", f"pid {proc.pid}")
        assert run_cli("eval", str(out), "--json").returncode == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 143
    # the kernel released the lock with the process: the run can be taken over at once (a resume
    # that asks for another total is refused inside the lock, by the schedule check, not "in use")
    _one_line_error(run_cli("train", "--out", str(out), "--resume", "--max-steps", str(len(ck.read_metrics(out)) + 2)),
                    "100000-step run")
    res = run_cli(*_train_args(corpus, out, 2), "--force")
    assert res.returncode == 0, res.stderr


def test_concurrent_new_runs_one_wins(corpus, tmp_path):
    out = tmp_path / "run"
    a = _start(_train_args(corpus, out, 8))
    b = _start(_train_args(corpus, out, 8))
    (_, ea), (_, eb) = a.communicate(timeout=120), b.communicate(timeout=120)
    assert sorted([a.returncode, b.returncode]) == [0, 2], (ea, eb)
    loser = ea if a.returncode == 2 else eb
    assert "is in use by another conceptmoe process" in loser or "already holds a run" in loser, loser
    assert [r["step"] for r in ck.read_metrics(out)] == list(range(1, 9))


def test_relative_data_resumes_from_anywhere_and_notices_changes(corpus, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(corpus, work / "data")
    res = run_cli(*_train_args("data", tmp_path / "run", 4), cwd=work)
    assert res.returncode == 0, res.stderr
    stored = ck.read_run_config(tmp_path / "run")
    assert stored["train"]["data"] == str((work / "data").resolve())
    assert stored["data"]["sha256"] and stored["data"]["train_tokens"] > 0
    # another working directory with a *different* file at the same relative path
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    (other / "data" / "x.txt").write_text("something else entirely\n" * 200)
    assert run_cli("eval", str(tmp_path / "run"), "--json", cwd=other).returncode == 0
    res = run_cli("train", "--out", str(tmp_path / "run"), "--resume", cwd=other)  # finished: evaluated again
    assert res.returncode == 0, res.stderr
    # the stored data changes: resume and eval refuse, nothing is touched
    first = sorted((work / "data").iterdir())[0]
    first.write_text(first.read_text() + "\nan extra line\n")
    before = _digest(tmp_path / "run")
    _one_line_error(run_cli("train", "--out", str(tmp_path / "run"), "--resume"),
                    "data changed since the run started")
    _one_line_error(run_cli("eval", str(tmp_path / "run")), "data changed since the run started")
    assert _digest(tmp_path / "run") == before


def test_resume_without_checkpoints_refuses_and_touches_nothing(corpus, tmp_path):
    out = tmp_path / "run"
    assert run_cli(*_train_args(corpus, out, 4)).returncode == 0
    shutil.rmtree(out / "checkpoints")
    before = _digest(out)
    _one_line_error(run_cli("train", "--out", str(out), "--resume", "--max-steps", "8"), "no checkpoint")
    assert _digest(out) == before


def test_force_starts_metrics_fresh(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n" + json.dumps({"note": 1}) + "\n")
    assert run_cli(*_train_args(corpus, out, 3), "--force").returncode == 0
    rows = ck.read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["loss"] != 99.0


@pytest.mark.parametrize("model", ["conceptmoe", "moe"])
def test_divergence_stops_with_one_line_and_keeps_the_checkpoint(corpus, tmp_path, model):
    out = tmp_path / "run"
    res = run_cli(*_train_args(corpus, out, 30, "--model", model, "--lr", "1000", "--save-every", "1"))
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]  # the progress bar comes before it
    assert last.startswith("error: training diverged at step") and "Traceback" not in res.stderr, res.stderr
    bad_step = int(last.split("at step ")[1].split(":")[0])
    kept = ck.latest_checkpoint(out)
    assert kept is not None and int(kept.name.split("-")[1]) == bad_step - 1
    for line in (out / "metrics.jsonl").read_text().splitlines():  # what was logged is strict JSON
        _strict(line)
    ev = run_cli("eval", str(out), "--json")  # the kept weights: finite numbers, or a one-line refusal
    if ev.returncode == 0:
        _strict(ev.stdout)
    else:
        _one_line_error(ev, "diverged")
    assert not (out / "eval.json").exists()


def test_a_failed_start_does_not_block_the_next_train(corpus, tmp_path):
    out = tmp_path / "run"
    res = run_cli(*_train_args(corpus, out, 30, "--model", "moe", "--lr", "1000", "--save-every", "100"))
    assert res.returncode == 2 and ck.is_run(out) and ck.latest_checkpoint(out) is None, res.stderr
    res = run_cli(*_train_args(corpus, out, 3, "--model", "moe"))  # not "already holds a run"
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in ck.read_metrics(out)] == [1, 2, 3] and (out / "eval.json").is_file()
    _one_line_error(run_cli(*_train_args(corpus, out, 3, "--model", "moe")), "already holds a run")


def test_skip_bad_steps_is_bounded(corpus, tmp_path):
    res = run_cli(*_train_args(corpus, tmp_path / "run", 30, "--model", "moe", "--lr", "1000",
                               "--skip-bad-steps", "3"))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert [ln for ln in lines if "update skipped" in ln][-1].endswith("(3/3)")
    assert lines[-1].startswith("error: training diverged")


def test_outputs_are_strict_json(reference):
    for line in (reference / "metrics.jsonl").read_text().splitlines():
        _strict(line)
    _strict((reference / "eval.json").read_text())
    _strict((reference / "config.json").read_text())


@pytest.mark.parametrize("flags, match", [
    (["--eval-every", "-1"], "--eval-every"), (["--warmup-steps", "-5"], "--warmup-steps"),
    (["--ratio", "1e9"], "--ratio"), (["--skip-bad-steps", "-1"], "--skip-bad-steps"),
    (["--val-tokens", "0"], "--val-tokens"),
])
def test_loose_train_flags_are_refused(corpus, tmp_path, flags, match):
    _one_line_error(run_cli(*_train_args(corpus, tmp_path / "run", 2), *flags), match)
    assert not (tmp_path / "run").exists()


def test_moe_ignores_ratio(corpus, tmp_path):
    assert run_cli(*_train_args(corpus, tmp_path / "run", 2, "--model", "moe", "--ratio", "0.5")).returncode == 0
