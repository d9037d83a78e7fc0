"""Round 4's background runner: train runs in at most ``jobs`` single-thread lanes, resumably.

``run_lanes(jobs, plan, on_finish)`` asks ``plan()`` for {run directory: train flags} and whether
the plan is complete, starts what is unfinished (a run with checkpoints resumes with ``train
--resume``; a finished run, one with eval.json, is skipped), and asks again as runs end, so a later
phase can depend on an earlier one's results. It stops when the plan is complete and nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def bpb(run: Path) -> float | None:
    f = run / "eval.json"
    return json.loads(f.read_text())["val_bpb"] if f.exists() else None


def command(run: Path, flags: list[str]) -> list[str]:
    if (run / "checkpoints").is_dir():
        return ["conceptmoe", "train", "--resume", "--out", str(run)]
    return ["conceptmoe", "train", *flags, "--out", str(run), "--force"]


def run_lanes(jobs: int, plan, on_finish=lambda: None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: dict[Path, subprocess.Popen] = {}
    while True:
        runs, complete = plan()
        for run, proc in list(running.items()):
            if proc.poll() is not None:
                del running[run]
                print(f"{time.strftime('%H:%M:%S')} {run}: exit {proc.returncode}", flush=True)
                if proc.returncode != 0:
                    sys.exit(f"{run} failed: see {run}.log")
                on_finish()
        todo = [r for r in runs if bpb(r) is None and r not in running]
        if complete and not running and not todo:
            print("complete", flush=True)
            return
        while todo and len(running) < jobs:
            run = todo.pop(0)
            run.parent.mkdir(parents=True, exist_ok=True)
            with open(f"{run}.log", "a") as log:
                running[run] = subprocess.Popen(command(run, runs[run]), stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"{time.strftime('%H:%M:%S')} started {run}", flush=True)
        if not running:  # the next phase waits on nothing that runs
            sys.exit("nothing to run and the plan is not complete")
        time.sleep(10)


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def main(doc: str, plan, report, record: Path) -> None:
    """``SCRIPT run [--jobs N]``: train the plan's runs in lanes, ``report`` after each; ``SCRIPT
    report``: write the record and print its Markdown, ``record``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    if a.what == "run":
        run_lanes(a.jobs, plan, report)
    else:
        report()
        print(record.read_text())
