"""Elastic training (issue 21) in every parallel mode: 2 processes equal 1.

Each sequence's R is a function of (seed, sample index) and the per-sequence ratio loss is a mean
over equal-sized micro-batches, so DDP, FSDP2, expert parallelism and --grad-accum must train the
one-process run. Two launches (one process, two) of ``dist_scripts/train_runs.py``, gloo with one
thread per process.
"""

import os
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus

STEPS = 8
TOL = 1e-4
SCRIPT = Path(__file__).parent / "dist_scripts" / "train_runs.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CONCEPTMOE_DIST_TIMEOUT": "60",
       "CONCEPTMOE_CPU_BF16": "0"}
MODES = {"ddp": {"parallel": "ddp"}, "fsdp": {"parallel": "fsdp"}, "ep": {"expert_parallel": 2},
         "ddp-accum": {"parallel": "ddp", "grad_accum": 2}}


def _launch(n: int, runs: list[dict], folder: Path, name: str) -> subprocess.CompletedProcess:
    spec = folder / f"{name}.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, str(SCRIPT), str(spec)] if n == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), str(SCRIPT), str(spec)]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic-modes")
    corpus = make_corpus(root / "corpus", n_docs=3, chars=4000)
    base = dict(preset="tiny", data=str(corpus), max_steps=STEPS, batch_size=8, seq_len=32, seed=4, save_every=10,
                eval_every=0, val_tokens=500, dtype="fp32", ratios="1.5:1,2:2,3:1,4:1", strategy=None)
    one = _launch(1, [{**base, "out": str(root / "one")}], root, "one")
    two = _launch(2, [{**base, **flags, "out": str(root / mode)} for mode, flags in MODES.items()], root, "two")
    return root, {"one": one, "two": two}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_elastic_two_processes_equal_one(runs, mode):
    root, logs = runs
    for name, res in logs.items():
        assert "FAILED" not in res.stdout, f"{name}: {res.stdout}{res.stderr[-2000:]}"
    assert f"OK {root / mode}" in logs["two"].stdout, logs["two"].stdout + logs["two"].stderr[-2000:]
    ref, rows = ck.read_metrics(root / "one"), ck.read_metrics(root / mode)
    assert len(rows) == len(ref) == STEPS
    for key in ("loss", "ratio_loss", "compression"):
        worst = max(abs(a[key] - b[key]) for a, b in zip(rows, ref))
        assert worst <= TOL * max(1.0, abs(ref[0][key])), f"{key}: {worst:.2e}"
    worst = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(rows, ref))
    assert worst <= TOL, f"grad_norm: {worst:.2e}"
