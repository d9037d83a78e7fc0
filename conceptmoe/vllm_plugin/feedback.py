"""The channel between vLLM's scheduler and the ConceptMoE's worker: grants one way, reports the
other (CONCEPTMOE.md §4; the managers in ``kv.py``, the model's side in ``ConceptCache``).

Concepts are decided by the model, after the scheduler has allocated a step's blocks. So:

- the scheduler's concept manager **grants** each request its concept slots before a step:
  (epoch, capacity in slots, mode). The epoch names one life of a request in its blocks: a new
  one is drawn each time a request gets its first concept block (admitted, or recomputed after
  preemption), so nothing written for an earlier owner of the block, or an earlier life of the
  request, is ever read as this one's. The mode says whether the capacity rests on an estimate
  (``ESTIMATED``: the model may find more concepts than that) and whether the scheduler handles
  the flags below (``HANDLED``).
- the model **reports** after the step: (epoch it was granted under, tokens processed T, concepts
  C, flag). ``OVERFLOW``: the step made more concepts than an estimated grant held; nothing of
  that request's concepts was written, and the scheduler recomputes it at the safe bound.
  ``BROKEN``: more concepts than a bound grant held (a bug): the scheduler ends the request with
  an error. Without a scheduler that handles flags, the model raises instead.

Each entry is one request (keyed by its first concept block, in the scheduler's block units),
written under a sequence lock: the sequence number is odd while a write is under way, and a read
that sees it odd or changed is discarded, so a torn entry is never used. The table is a file in
shared memory that both engine processes map (vLLM's "mp" executor runs the model in a child of
the EngineCore process; the "uni" executor inside it), named after the EngineCore's pid.
"""

from __future__ import annotations

import atexit
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

FEEDBACK_DIR = Path(os.environ.get("CONCEPTMOE_VLLM_FEEDBACK_DIR", "/dev/shm" if Path("/dev/shm").is_dir()
                                   else tempfile.gettempdir()))

ESTIMATED, HANDLED = 1, 2  # grant mode bits
OVERFLOW, BROKEN = 1, 2  # report flags

# columns: the grant (sequence, epoch, capacity, mode), the report (sequence, epoch, T, C, flag)
_G, _R, _WIDTH = 0, 4, 9


class FeedbackError(RuntimeError):
    pass


class FeedbackTable:
    """Grants and reports per key (a block id), in a file both engine processes map."""

    def __init__(self, engine_pid: int, num_blocks: int, fresh: bool = False) -> None:
        """``fresh``: zero it (the scheduler's side, before any request runs: a file left by an
        earlier process of the same pid must not be read). Raises ``FeedbackError`` with one line
        when the file cannot be made: without it the concept cache cannot be served."""
        self.path = FEEDBACK_DIR / f"conceptmoe-vllm-{engine_pid}.feedback"
        self.num_blocks = max(num_blocks, 1)
        size = self.num_blocks * _WIDTH * 8
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as e:
            raise FeedbackError(f"ConceptMoE in vLLM: cannot open its scheduler-worker table {self.path} ({e}); "
                                f"set CONCEPTMOE_VLLM_FEEDBACK_DIR to a writable folder on a memory file "
                                f"system") from None
        self.table = np.ndarray((self.num_blocks, _WIDTH), dtype=np.int64, buffer=self._map)
        if fresh:
            self.table[:] = 0

    # -- sequence-locked stores and loads ---------------------------------------------------------
    # Few numpy calls each: the model reads and writes every request's entry once a step, the
    # scheduler reads it per request, and at a few rows a step's Python is what costs.

    def _store(self, keys, col: int, values: list) -> None:
        t = self.table
        t[keys, col] += 1  # odd: a write under way
        t[keys, col + 1:col + 1 + len(values)] = np.stack(values, -1) if np.ndim(keys) else values
        t[keys, col] += 1

    def _load(self, keys, col: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(values (K, n), whether each read is whole)."""
        t = self.table
        got = t[keys, col:col + 1 + n]  # the sequence number first, then the values: a copy
        ok = (t[keys, col] == got[..., 0]) & (got[..., 0] % 2 == 0)
        return got[..., 1:], ok

    # -- grants: scheduler -> model ---------------------------------------------------------------

    def grant(self, key: int, epoch: int, capacity: int, mode: int) -> None:
        self._store(key, _G, [epoch, capacity, mode])

    def grants(self, keys: np.ndarray) -> np.ndarray:
        """(K, 3): epoch, capacity, mode per key; a torn or missing grant reads as epoch 0."""
        vals, ok = self._load(keys, _G, 3)
        vals[~ok] = 0
        return vals

    # -- reports: model -> scheduler --------------------------------------------------------------

    def report_many(self, keys: np.ndarray, epochs, tokens, concepts, flags) -> None:
        self._store(keys, _R, [epochs, tokens, concepts, flags])

    def reports(self, keys, epochs) -> tuple[np.ndarray, np.ndarray]:
        """((K, 3): T, C, flag per key; (K,) whether each is a whole report made under that key's
        epoch: not torn, not another epoch's (an earlier owner of the block, an earlier life))."""
        vals, ok = self._load(keys, _R, 4)
        epochs = np.asarray(epochs)
        return vals[..., 1:], ok & (epochs > 0) & (vals[..., 0] == epochs)

    def report(self, key: int, epoch: int) -> tuple[int, int, int] | None:
        """(T, C, flag) reported under ``epoch`` for ``key`` (None: none that ``reports`` accepts)."""
        t = self.table
        seq, got, tokens, concepts, flag = t[key, _R:_R + 5].tolist()
        if seq % 2 or int(t[key, _R]) != seq or epoch <= 0 or got != epoch:
            return None
        return tokens, concepts, flag

    def clear(self, key: int) -> None:
        self._store(key, _G, [0, 0, 0])
        self._store(key, _R, [0, 0, 0, 0])


_TABLES: dict[int, FeedbackTable] = {}


def shared_table(num_blocks: int) -> FeedbackTable:
    """This scheduler process's table: zeroed once (several concept groups share it), removed at exit."""
    pid = os.getpid()
    if pid not in _TABLES:
        _TABLES[pid] = table = FeedbackTable(pid, num_blocks, fresh=True)
        atexit.register(lambda: table.path.unlink(missing_ok=True))
    return _TABLES[pid]
