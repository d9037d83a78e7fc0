"""Train several runs of a comparison at once: one process per run, the machine split between them.

``train_runs(tasks, jobs)`` trains ``TrainJob``s (a label, a ``TrainConfig`` and a log file).
With ``jobs == 1`` they train one after another in this process, as before. With more, a pool of
``jobs`` worker processes (spawned: no state inherited from the parent) trains them, each run's
output (progress bar, warnings) going to its own log file; this process prints one line when a
run starts and one when it ends. Each worker takes its share of the machine: on CPU
``cores / jobs`` torch threads unless ``OMP_NUM_THREADS`` is set (then that), on CUDA one visible
GPU per worker, round-robin over ``CUDA_VISIBLE_DEVICES`` (or all GPUs). A run's result does not
depend on which worker trains it or when: every run is seeded by its own config, and the runs of
one seed still read the same batches.

A run that fails does not stop the others; once all have ended, the first failure is raised
(a ``UserError`` as one line naming the run and its log). Finished runs stay finished, so the
same command resumes. SIGINT or SIGTERM to this process (Ctrl-C, a scheduler) is forwarded to
every worker: a run inside its training steps writes a checkpoint and stops (signals.py), a run
still starting stops at once, queued runs never start, and ``Interrupted`` is raised. Workers
ignore signals between runs: one dying there would break the pool and kill the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..errors import Interrupted, UserError
from ..parallel.distributed import watch_parent
from .config import TrainConfig
from .signals import SIGNALS, StopOnSignal


@dataclass
class TrainJob:
    label: str  # shown to the user, e.g. "topk-R2 seed 1"; "== LABEL -> OUT" starts its output
    config: TrainConfig
    log: Path  # the worker's stdout and stderr while it trains this run (jobs > 1)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_jobs(jobs: int) -> None:
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1 (got {jobs})")


# How a stopped comparison continues: it has no --resume (finished runs are reused, stopped ones resume).
RERUN = "rerun the same command to resume (the same --out)"


def train_runs(tasks: list[TrainJob], jobs: int = 1) -> None:
    """Train every task, ``jobs`` at a time (see the module docstring)."""
    from .train import train

    check_jobs(jobs)
    if jobs == 1 or len(tasks) <= 1:
        for t in tasks:
            print(f"== {t.label} -> {t.config.out}", flush=True)
            try:
                train(t.config)
            except Interrupted as e:
                raise e.resumed_by(RERUN) from None
        return
    jobs = min(jobs, len(tasks))
    ctx = mp.get_context("spawn")
    slots, pids, stopping = ctx.Queue(), ctx.Queue(), ctx.Event()
    for i in range(jobs):
        slots.put(i)
    failures: list[tuple[TrainJob, str]] = []
    with StopOnSignal() as stop, cf.ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_init_worker,
            initargs=(slots, pids, stopping, _threads_per_job(jobs), _gpus(tasks))) as pool:
        running = {}
        for t in tasks:
            t.log.parent.mkdir(parents=True, exist_ok=True)
            running[pool.submit(_train_one, t)] = t
        print(f"== training {len(tasks)} runs, {jobs} at a time; logs in {tasks[0].log.parent}", flush=True)
        pending, workers, signalled = set(running), [], set()
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            with contextlib.suppress(queue.Empty):
                while True:
                    workers.append(pids.get_nowait())
            for fut in (f for f in done if not f.cancelled()):
                t = running[fut]
                status, message, seconds = _outcome(fut)
                if status == "ok":
                    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
                    print(f"== done {t.label} in {took} -> {t.config.out}", flush=True)
                else:
                    print(f"== {status.upper()} {t.label}: {message} (log: {t.log})", flush=True)
                    failures.append((t, message))
            if stop.signum is not None:  # stop: no new runs; running ones checkpoint (signals.py)
                stopping.set()  # a worker between runs, or still starting one, sees this instead
                for fut in pending:
                    fut.cancel()
                for pid in set(workers) - signalled:
                    signalled.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, stop.signum)
    if stop.signum is not None:
        raise Interrupted(f"stopped on {stop.name}", 128 + stop.signum, resume=RERUN)
    if failures:
        t, message = failures[0]
        others = f" ({len(failures) - 1} more failed)" if len(failures) > 1 else ""
        raise UserError(f"training {t.label} failed: {message} (log: {t.log}){others}")


def _outcome(fut: cf.Future) -> tuple[str, str, float]:
    """A finished run's (status, message, seconds), also when its worker did not return one."""
    try:
        return fut.result()
    except KeyboardInterrupt:  # a stop signal in the instant after the worker reset its handlers
        return "stopped", "stopped", 0.0
    except Exception as e:  # the worker process itself died (killed, out of memory)
        return "error", f"its worker process died ({type(e).__name__}: {e})", 0.0


def _threads_per_job(jobs: int) -> int | None:
    """None when the user chose (OMP_NUM_THREADS is inherited by the workers)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, usable_cores() // jobs)


def _gpus(tasks: list[TrainJob]) -> list[str]:
    """The GPUs to spread the workers over; empty when the runs train on CPU."""
    if all(t.config.device == "cpu" for t in tasks):
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    return ids or [str(i) for i in range(torch.cuda.device_count())]


_STOPPING = None  # the parent's stop event, in a worker
_IN_RUN = threading.Event()  # set while a worker is inside ``_train_one``


def _init_worker(slots, pids, stopping, threads: int | None, gpus: list[str]) -> None:
    global _STOPPING
    _STOPPING = stopping
    _ignore_signals()  # between runs: a worker that died here would break the pool (and kill the others)
    watch_parent(on_orphan=_stop_orphan)
    slot = slots.get()
    pids.put(os.getpid())
    if gpus:  # before the worker's first CUDA call
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


def _train_one(task: TrainJob) -> tuple[str, str, float]:
    """("ok" | "error" | "stopped", message, seconds); never raises (exceptions may not pickle)."""
    from .train import train

    t0 = time.time()
    sys.stdout.flush()
    sys.stderr.flush()
    _IN_RUN.set()
    with open(task.log, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        print(f"== {task.label} -> {task.config.out}", flush=True)
        try:
            for s in SIGNALS:  # until training installs its own handlers (and after): stop at once
                signal.signal(s, _raise_interrupt)
            if _STOPPING is not None and _STOPPING.is_set():
                raise KeyboardInterrupt
            train(task.config)
            return "ok", "", time.time() - t0
        except KeyboardInterrupt:
            print("stopped outside the training steps (nothing new to checkpoint)", file=sys.stderr)
            return "stopped", "stopped outside the training steps", time.time() - t0
        except Interrupted as e:
            print(f"stopped: {e}", file=sys.stderr)
            return "stopped", str(e), time.time() - t0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return "error", str(e), time.time() - t0
        except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback in the log
            traceback.print_exc()
            return "error", f"{type(e).__name__}: {e}", time.time() - t0
        finally:
            _ignore_signals()
            sys.stdout.flush()
            sys.stderr.flush()
            _IN_RUN.clear()


def _stop_orphan() -> None:
    """The comparison's process died (SIGKILL, out of memory): stop the run this worker trains
    as SIGTERM stops it (checkpoint kept, lock released), then exit. Nothing would ever collect
    its result or hand it another run: the pool's queues would keep it waiting for ever."""
    while _IN_RUN.is_set():  # again each second: the first may land where signals are ignored
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10):
            if not _IN_RUN.is_set():
                break
            time.sleep(0.1)
    os._exit(128 + signal.SIGTERM)


def _ignore_signals() -> None:
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
