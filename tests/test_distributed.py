"""torchrun on CPU with gloo: grad accumulation, FSDP with grad accumulation, resume across world
sizes after a real SIGTERM, a killed worker, expert-parallel gradients. Real multi-process jobs
(two processes, one thread each). Every mode against one process at the default settings, the
resume matrix and expert parallelism's clipping: test_distributed_modes.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus, run_cli

STEPS = 20
TOL = 1e-4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CONCEPTMOE_DIST_TIMEOUT": "60"}


def _args(corpus, out, model="conceptmoe", steps=STEPS, *extra):
    return ["train", "--model", model, "--preset", "tiny", "--data", str(corpus), "--out", str(out),
            "--max-steps", str(steps), "--save-every", "5", "--batch-size", "8", "--seq-len", "32",
            "--eval-every", "10", "--device", "cpu", "--seed", "3", "--lr", "1e-3",
            *(["--strategy", "none"] if model == "conceptmoe" else []), *extra]  # tiny's 8 experts: EP-divisible


def _torchrun_cmd(n, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
            "-m", "conceptmoe", *args]


def _torchrun(n, args, timeout=300):
    return subprocess.run(_torchrun_cmd(n, args), env=ENV, capture_output=True, text=True, timeout=timeout)


def _losses(out):
    return [r["loss"] for r in ck.read_metrics(out)]


def _close(a, b, tol=TOL):
    assert len(a) == len(b), (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= tol, f"max |loss difference| {worst:.2e} > {tol:g}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The 1-process reference run (2-vs-1 equality of every mode: test_distributed_modes.py)."""
    runs = {}
    for model in ("conceptmoe",):
        out = tmp_path_factory.mktemp("single") / model
        res = run_cli(*_args(corpus, out, model))
        assert res.returncode == 0, res.stderr
        runs[model] = out
    return runs


@pytest.mark.parametrize("model", ["conceptmoe", "moe"])
def test_grad_accum_equals_one_batch(corpus, tmp_path, model):
    # CE accumulates exactly; the ratio, balance and z-loss statistics of the whole batch are
    # summed first (collect_stats), so every loss term equals the one-batch run's.
    runs = {}
    for k in (1, 2):
        runs[k] = tmp_path / f"k{k}"
        res = run_cli(*_args(corpus, runs[k], model, STEPS, "--grad-accum", str(k)))
        assert res.returncode == 0, res.stderr
    _close(_losses(runs[2]), _losses(runs[1]))
    rows = [ck.read_metrics(runs[k]) for k in (1, 2)]
    for key in ("compression", "balance_loss", "ratio_loss"):
        assert [r[key] for r in rows[1]] == pytest.approx([r[key] for r in rows[0]], rel=1e-4, abs=1e-6), key


def test_fsdp_with_grad_accum_equals_one_process(corpus, single, tmp_path):
    out = tmp_path / "run"
    res = _torchrun(2, _args(corpus, out, "conceptmoe", STEPS, "--parallel", "fsdp", "--grad-accum", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    _close(_losses(out), _losses(single["conceptmoe"]))


def _interrupt(cmd, out, rows=4, timeout=120):
    """Start a job, SIGTERM it once ``rows`` steps are logged; returns its exit code."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while len(ck.read_metrics(out)) < rows:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc.returncode


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_with_another_world_size(corpus, single, tmp_path, first, then):
    out = tmp_path / "run"
    args = _args(corpus, out, "conceptmoe", STEPS, "--parallel", "fsdp")
    cmd = _torchrun_cmd(first, args) if first > 1 else [sys.executable, "-m", "conceptmoe", *args]
    code = _interrupt(cmd, out)
    assert code != 0 and 0 < len(ck.read_metrics(out)) < STEPS
    assert ck.latest_checkpoint(out) is not None
    resume = ["train", "--out", str(out), "--resume"]
    res = _torchrun(then, resume) if then > 1 else run_cli(*resume)
    assert res.returncode == 0, res.stderr[-3000:]
    _close(_losses(out), _losses(single["conceptmoe"]))


def _children(pid: int) -> list[str]:
    """Child process ids of ``pid`` (from /proc: no pgrep needed)."""
    out = []
    for stat in sorted(os.listdir("/proc")):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(stat)
    return out


def test_a_killed_worker_ends_the_job(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_torchrun_cmd(2, _args(corpus, out, "moe", 100_000)), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while ck.latest_checkpoint(out) is None or len(ck.read_metrics(out)) < 7:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)
    t0 = time.time()
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 60
    kept = ck.latest_checkpoint(out)
    assert kept is not None and (kept / "state.json").is_file()
    ev = run_cli("eval", str(out), "--json")
    assert ev.returncode == 0, ev.stderr


def test_bf16_autocast_trains_with_fp32_islands(corpus, tmp_path):
    # CPU bf16 is slow but works: autocast matmuls; router, cosine, ratio loss and the scan stay fp32
    out = tmp_path / "run"
    res = run_cli(*_args(corpus, out, "conceptmoe", 3, "--dtype", "bf16"))
    assert res.returncode == 0, res.stderr
    rows = ck.read_metrics(out)
    assert len(rows) == 3 and all(r["loss"] < 10 for r in rows)
    assert ck.read_run_config(out)["train"]["dtype"] == "bf16"


@pytest.mark.parametrize("model", ["conceptmoe", "moe"])
def test_expert_parallel_forward_and_gradients(model):
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "ep_grads.py")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          script, model], env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count("max diff") == 2
