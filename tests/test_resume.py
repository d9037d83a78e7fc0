"""Kill-and-resume: a run SIGKILLed mid-training and resumed equals an uninterrupted one.

Real subprocesses and a real SIGKILL (CPU, same seed): the resumed run's metrics must equal the
uninterrupted run's step for step (wall-clock fields aside), and so must its final weights.
"""

import json
import os
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file

from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus, run_cli

TIMING = ("tokens_per_s",)
STEPS = 36


def _args(corpus, out):
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--max-steps", str(STEPS),
            "--save-every", "5", "--batch-size", "4", "--seq-len", "32", "--eval-every", "8",
            "--device", "cpu", "--seed", "7"]


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _kill_after(corpus, out, min_rows):
    """Start training, SIGKILL it once metrics.jsonl has ``min_rows`` rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    resume = ["--resume"] if ck.is_run(out) else []
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", *_args(corpus, out), *resume], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(ck.read_metrics(out)) < min_rows:
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return len(ck.read_metrics(out))


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    ref = run_cli(*_args(corpus, tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    want = _strip(ck.read_metrics(tmp_path / "ref"))
    assert len(want) == STEPS

    out = tmp_path / "killed"
    seen = _kill_after(corpus, out, 13)  # past the step-10 checkpoint, before the end
    assert seen < STEPS
    ckpt = ck.latest_checkpoint(out)
    assert ckpt is not None and int(ckpt.name.split("-")[1]) % 5 == 0

    # Resume with only --out and --resume: everything else comes from the stored run.
    res = run_cli("train", "--out", str(out), "--resume")
    assert res.returncode == 0, res.stderr
    assert _strip(ck.read_metrics(out)) == want
    a, b = load_file(tmp_path / "ref" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert json.loads((out / "eval.json").read_text()) == json.loads((tmp_path / "ref" / "eval.json").read_text())


def test_kill_at_many_moments_never_damages_the_run(tmp_path):
    """Kill repeatedly at arbitrary moments (including mid-checkpoint); every resume succeeds."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    for rows in (3, 17):
        _kill_after(corpus, out, rows)
        assert ck.is_run(out)
    res = run_cli(*_args(corpus, out), "--resume")
    assert res.returncode == 0, res.stderr
    rows = ck.read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
