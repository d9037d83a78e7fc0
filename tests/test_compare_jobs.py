"""``compare --jobs N`` (training/jobs.py): the runs of a comparison trained in N processes at once
give the same runs as one after another; a failing run is reported without losing the others;
a stop signal checkpoints every running run and the same command resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conceptmoe.errors import UserError
from conceptmoe.evaluation.compare import CompareConfig, compare
from conceptmoe.evaluation.continual import CTConfig, continual_compare
from conceptmoe.lock import RunLock
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.jobs import TrainJob, train_runs
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus, run_cli

SMALL_RUN = dict(preset="tiny", tokens=4 * 32 * 4, batch_size=4, seq_len=32, lr=3e-3, device="cpu")


@pytest.fixture
def one_thread(monkeypatch):
    """Workers inherit OMP_NUM_THREADS=1; this process trains with one thread too, so both ways
    compute in the same order."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _val_bpb(out):
    rep = json.loads((out / "report.json").read_text())
    return {r["label"]: r["val_bpb_seeds"] for r in rep["models"]}


def test_parallel_runs_equal_sequential_runs(tmp_path, one_thread):
    corpus = make_corpus(tmp_path / "corpus")
    seq = compare(CompareConfig(**SMALL_RUN, seeds=[0, 1], data=str(corpus), out=str(tmp_path / "seq")))
    par = compare(CompareConfig(**SMALL_RUN, seeds=[0, 1], data=str(corpus), out=str(tmp_path / "par"), jobs=2))
    assert _val_bpb(par) == _val_bpb(seq)  # exactly: each run is seeded by its own config
    logs = sorted(p.name for p in (par / "logs").iterdir())
    assert logs == ["moe-seed0.log", "moe-seed1.log", "topk-R2-seed0.log", "topk-R2-seed1.log"]
    assert all("== " in (par / "logs" / name).read_text() for name in logs)
    assert not (seq / "logs").exists()  # one after another: output on the terminal
    # jobs is not a setting of the comparison: the sequential one reruns with --jobs and reuses every run
    again = compare(CompareConfig(**SMALL_RUN, seeds=[0, 1], data=str(corpus), out=str(tmp_path / "seq"), jobs=2))
    assert _val_bpb(again) == _val_bpb(seq) and not (again / "logs").exists()


def test_ct_parallel_equals_sequential(tmp_path, one_thread):
    corpus = make_corpus(tmp_path / "corpus")
    moe = train(TrainConfig(model="moe", **TINY, data=str(corpus), out=str(tmp_path / "moe"), max_steps=6))
    kw = dict(ratios=[2.0], tokens=4 * 32 * 3, batch_size=4, seq_len=32, lr=3e-3, eval_every=3, device="cpu",
              progress=False)
    seq = continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "seq"), **kw))
    par = continual_compare(CTConfig(init=str(moe), out=str(tmp_path / "par"), jobs=3, **kw))
    a, b = (json.loads((o / "report.json").read_text())["models"] for o in (seq, par))
    keys = ("label", "val_bpb", "val_bpb_start", "compression", "curve")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert sorted(p.name for p in (par / "logs").iterdir()) == ["R2-loop2.log", "R2-topk.log", "moe.log"]


def test_a_failing_run_does_not_stop_the_others(tmp_path, one_thread):
    corpus = make_corpus(tmp_path / "corpus")
    good = TrainConfig(model="moe", **TINY, data=str(corpus), out=str(tmp_path / "good"), max_steps=3)
    bad = TrainConfig(model="moe", **TINY, data=str(tmp_path / "missing"), out=str(tmp_path / "bad"),
                      max_steps=3)
    jobs = [TrainJob("bad run", bad, tmp_path / "logs" / "bad.log"),
            TrainJob("good run", good, tmp_path / "logs" / "good.log")]
    with pytest.raises(UserError, match=r"training bad run failed: .*missing.*\(log: .*bad\.log\)"):
        train_runs(jobs, 2)
    assert (tmp_path / "good" / "eval.json").is_file()  # the other run finished
    assert "missing" in (tmp_path / "logs" / "bad.log").read_text()


def test_bad_jobs_refused(tmp_path):
    with pytest.raises(UserError, match="--jobs must be at least 1"):
        CompareConfig(**SMALL_RUN, seeds=[0], data=str(tmp_path), out=str(tmp_path / "o"), jobs=0)
    r = run_cli("compare", "--jobs", "-2", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == "error: --jobs must be at least 1 (got -2)"
    assert not (tmp_path / "o").exists()


def test_stop_signal_checkpoints_every_running_run_and_resumes(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--data", str(corpus), "--tokens", str(4 * 32 * 150), "--batch-size", "4",
            "--seq-len", "32", "--seeds", "0", "--device", "cpu", "--jobs", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    runs = [out / "moe" / "seed0", out / "topk-R2" / "seed0"]
    deadline = time.time() + 120
    while time.time() < deadline and not all((r / "metrics.jsonl").is_file() for r in runs):
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)  # to the parent only, as a scheduler would: it forwards it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rerun the same command to resume" in err.strip().splitlines()[-1]
    for r in runs:
        assert ck.latest_checkpoint(r) is not None and not (r / "eval.json").exists()
    before = {r: (r / "metrics.jsonl").read_text() for r in runs}
    r = run_cli(*args, timeout=300)  # the same command: both runs resume from their checkpoints
    assert r.returncode == 0, r.stderr
    for run in runs:
        assert (run / "eval.json").is_file()
        assert (run / "metrics.jsonl").read_text().startswith(before[run])  # continued, not restarted


def test_a_stop_while_the_workers_start_loses_no_signal(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--data", str(corpus), "--tokens", str(4 * 32 * 150), "--batch-size", "4",
            "--seq-len", "32", "--seeds", "0", "--device", "cpu", "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("== training 2 runs"):
            break
    proc.send_signal(signal.SIGINT)  # the workers are still importing torch or building their runs
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    # every run stopped (at once, or at a step with a checkpoint): none trained to its end
    assert not list(out.glob("*/seed0/eval.json"))
    assert all("stopped" in (out / "logs" / f"{m}-seed0.log").read_text() for m in ("moe", "topk-R2"))


def _children(pid):
    """Pids of the processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_of_a_killed_compare_stop_within_seconds(tmp_path):
    """SIGKILL to compare (no forwarding possible): its workers notice, checkpoint and exit."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--data", str(corpus), "--tokens", str(4 * 32 * 20000), "--batch-size",
            "4", "--seq-len", "32", "--seeds", "0", "--device", "cpu", "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = [out / "moe" / "seed0", out / "topk-R2" / "seed0"]
    deadline = time.time() + 120
    while time.time() < deadline and not all(r.is_dir() and len(ck.read_metrics(r)) >= 5 for r in runs):
        time.sleep(0.5)
    workers = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert len(workers) == 2 and proc.poll() is None
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.5)
    left = [p for p in workers if _alive(p)]
    for p in left:  # only the workers this test started, by pid
        os.kill(p, signal.SIGKILL)
    assert not left, "orphaned workers kept training"
    for r in runs:  # stopped where it was, checkpoint at its last step, lock released
        last = ck.read_metrics(r)[-1]["step"]
        assert ck.latest_checkpoint(r).name == f"step-{last:08d}" and last < 20000, last
        assert not (r / "eval.json").exists()
        with RunLock(r):  # released: the same command can resume it
            pass


def test_a_stopped_sequential_compare_says_how_to_resume_it(tmp_path):
    """compare has no --resume: the message names what does resume it."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--data", str(corpus), "--tokens", str(4 * 32 * 20000), "--batch-size",
            "4", "--seq-len", "32", "--seeds", "0", "--device", "cpu", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = out / "moe" / "seed0"
    deadline = time.time() + 120
    while time.time() < deadline and not (run.is_dir() and len(ck.read_metrics(run)) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signal.SIGTERM and "--resume" not in err, err
    assert last.startswith("interrupted: stopped by SIGTERM") and "rerun the same command to resume" in last, last
