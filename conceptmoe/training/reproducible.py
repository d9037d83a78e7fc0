"""Bit-identical reruns: what a run's numbers depend on besides its recipe and seed.

Every random draw of training is a pure function of the seed and a position (the data order of
``data/corpus.py`` and ``data/shards.py``, the boundary uniforms of ``loop.boundary_uniforms``
keyed by the batches drawn, skipped steps included, the initial weights of ``torch.manual_seed``),
and a checkpoint holds the optimizer, the data position and the skip count. So two runs of one
recipe and seed give the same bytes, resumed or not, as long as the arithmetic is the same:
the same torch build, the same number of threads (a CPU reduction splits its sum by thread: one
thread against two differs by ~5e-7 in the loss after a few steps, and boundary sampling then
amplifies the difference, see docs/training.md) and the same machine's kernels (AVX2 against
AVX-512, AMX bf16 against emulated). On CUDA the scatter-adds of the expert dispatch and the
attention backward are not deterministic by default: ``make_deterministic`` asks torch for its
deterministic kernels. Strictly by default: with ``warn_only=True`` torch only warns for flash and
cuDNN attention and runs their non-deterministic backward (seen on an H200); strict mode makes
flash attention's backward deterministic and keeps SDPA off the backends that have none.
``CONCEPTMOE_CUDA_DETERMINISM=warn`` relaxes it (faster, not bit-identical; an op with no
deterministic kernel then warns instead of stopping the run).

``environment()`` is recorded in config.json at the start of a run; a resumed session on another
environment is named in one line (its numbers go on, but are no longer bit-identical to an
uninterrupted run) and appended to the record.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from ..device import machine
from ..errors import UserError

# What changes the arithmetic of a run: compared on --resume.
ARITHMETIC = ("torch", "threads", "world", "cpu_model", "cpu_flags", "gpu", "deterministic")


def code_commit(where: Path = Path(__file__).resolve().parents[1]) -> str:
    """The git commit of the package's checkout, "+dirty" when its files differ from it; "unknown"
    outside a checkout. Not part of ``ARITHMETIC``: a study record names it beside each run."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(world: int, device: torch.device) -> dict[str, Any]:
    """The machine, torch build, thread count, process count and code commit of this session."""
    env = {**machine(), "threads": torch.get_num_threads(), "world": world, "device": device.type,
           "commit": code_commit()}
    if device.type == "cuda":
        env["deterministic"] = ("off" if not torch.are_deterministic_algorithms_enabled() else
                                "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "strict")
    return env


CUDA_DETERMINISM_ENV = "CONCEPTMOE_CUDA_DETERMINISM"


def cuda_determinism() -> str:
    """``strict`` (default) or ``warn``: the ``CONCEPTMOE_CUDA_DETERMINISM`` setting."""
    mode = os.environ.get(CUDA_DETERMINISM_ENV, "strict").strip().lower() or "strict"
    if mode not in ("strict", "warn"):
        raise UserError(f"{CUDA_DETERMINISM_ENV}={mode!r}: expected strict or warn")
    return mode


def make_deterministic(device: torch.device) -> None:
    """On CUDA: deterministic kernels (index_add / scatter_add through sorting, flash attention's
    deterministic backward, cuBLAS with a fixed workspace). ``strict`` (default): an op with no
    deterministic kernel stops the run with torch's error; ``warn``: it warns and runs (attention
    backward then is not deterministic). CPU kernels are deterministic for a fixed thread count
    already, so nothing changes there."""
    mode = cuda_determinism()  # a bad setting is refused on any device
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")


def differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The arithmetic settings that differ between two sessions, as 'name a -> b'."""
    out = []
    for key in ARITHMETIC:
        if before.get(key) != now.get(key):
            a, b = before.get(key), now.get(key)
            if key == "cpu_flags":
                a, b = f"{len(a or [])} flags", f"{len(b or [])} flags (another instruction set)"
            out.append(f"{key} {a} -> {b}")
    return out


def resumed_environment(stored: dict[str, Any] | None, now: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the environment record to write, a one-line note or None) for a session continuing a run
    whose config.json is ``stored`` (None or without a record: a fresh start, or a run from
    before the record)."""
    record = (stored or {}).get("environment")
    if not record:
        return {"start": now, "resumed_on": []}, None
    first = record["start"]
    last = record["resumed_on"][-1] if record.get("resumed_on") else first
    diff = differences(last, now)
    if not diff:
        return record, None
    note = ("resumed on another environment (" + "; ".join(diff) + "): training goes on, but from here its "
            "numbers are not bit-identical to an uninterrupted run")
    return {**record, "resumed_on": [*record.get("resumed_on", []), now]}, note
