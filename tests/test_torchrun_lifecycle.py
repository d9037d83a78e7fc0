"""The torchrun agent dies (``kill -9``): every worker notices (parent-death detection), stops
like a SIGTERM stops it (checkpoint, lock released) and exits within seconds (issue 18)."""

import os
import signal
import subprocess
import sys
import time

from conceptmoe.lock import RunLock
from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CONCEPTMOE_DIST_TIMEOUT": "60",
       "CONCEPTMOE_CPU_BF16": "0"}


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an exited orphan may wait for its new parent to reap it


def test_killing_the_agent_stops_every_worker(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_docs=2, chars=3000)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "conceptmoe",
           "train", "--model", "moe", "--preset", "tiny", "--data", str(corpus), "--out", str(out),
           "--max-steps", "100000", "--save-every", "100000", "--batch-size", "4", "--seq-len", "32",
           "--eval-every", "0", "--device", "cpu", "--dtype", "fp32"]
    log = open(tmp_path / "log.txt", "w")
    agent = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=log)
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() or len(ck.read_metrics(out)) < 7:
            assert agent.poll() is None and time.time() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.05)
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        # --save-every 100000: no periodic checkpoint, so one after the kill is the stop path's
        assert ck.latest_checkpoint(out) is None
        agent.kill()  # SIGKILL: the agent cannot pass anything on
        agent.wait()
        t0 = time.time()
        while any(_alive(w) for w in workers) and time.time() - t0 < 30:
            time.sleep(0.1)
        took = time.time() - t0
        assert took < 10, f"workers still running {took:.0f} s after the agent died"
        with RunLock(out):  # released
            pass
        kept = ck.latest_checkpoint(out)
        assert kept is not None, "the workers stopped without the checkpoint of the SIGTERM path"
        state, _, _ = ck.read_checkpoint(kept)
        rows = ck.read_metrics(out)  # the stop path saves the step it logged last
        assert state["step"] >= 7 and state["step"] == rows[-1]["step"] and (out / "model.safetensors").is_file()
    finally:
        for w in workers:  # the workers this test started, should they still run
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
        log.close()
