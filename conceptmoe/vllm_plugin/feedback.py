"""The channel between vLLM's scheduler and the ConceptMoE's worker: grants one way, reports the
other (CONCEPTMOE.md §4; the managers in ``kv.py``, the model's side in ``cache.py``).

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
the EngineCore process; the "uni" executor inside it). Its name holds the EngineCore's pid and a
random key (``session_key``) that the first process to load the plugin draws and its children
inherit: no other launch, container or user can guess it or share it. The scheduler creates the
file exclusively, mode 0600, and removes it at exit; a file of that name that exists already is
refused with one line, and the model opens only a file of its own user, closed to others.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import stat
import tempfile
from pathlib import Path

import numpy as np

FEEDBACK_DIR = Path(os.environ.get("CONCEPTMOE_VLLM_FEEDBACK_DIR", "/dev/shm" if Path("/dev/shm").is_dir()
                                   else tempfile.gettempdir()))

KEY_ENV = "CONCEPTMOE_VLLM_FEEDBACK_KEY"  # the launch's random key, inherited by the engine's processes
ESTIMATED, HANDLED = 1, 2  # grant mode bits
OVERFLOW, BROKEN = 1, 2  # report flags

# columns: the grant (sequence, epoch, capacity, mode, and a prefix hit's snapshot: its row and its
# writer's epoch), the report (sequence, epoch, T, C, flag), and, keyed by a token block, the
# snapshot at its end (sequence, epoch, T, C: ``prefix.py``)
_G, _R, _S, _WIDTH = 0, 6, 11, 15


class FeedbackError(RuntimeError):
    pass


def session_key() -> str:
    """This launch's key: drawn by the first process that asks (``register``, before vLLM starts
    its engine processes), inherited by them through the environment."""
    if not os.environ.get(KEY_ENV):
        os.environ[KEY_ENV] = secrets.token_hex(16)
    return os.environ[KEY_ENV]


def table_path(engine_pid: int) -> Path:
    return FEEDBACK_DIR / f"conceptmoe-vllm-{session_key()}-{engine_pid}.feedback"


class FeedbackTable:
    """Grants and reports per key (a block id), in a file both engine processes map."""

    def __init__(self, engine_pid: int, num_blocks: int = 0, fresh: bool = False) -> None:
        """``fresh``: create it for ``num_blocks`` keys (the scheduler's side, before any request
        runs), exclusively and zeroed; else open the scheduler's, at its size. Raises ``FeedbackError`` with one line when the file
        cannot be made or opened, or is not this user's alone: without it the concept cache
        cannot be served."""
        self.path = table_path(engine_pid)
        self.num_blocks = max(num_blocks, 1)
        size = self.num_blocks * _WIDTH * 8
        try:
            fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if fresh else 0) | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise FeedbackError(f"ConceptMoE in vLLM: its scheduler-worker table {self.path} exists already (another "
                                f"engine's, or left by a killed one): refusing to share it; remove it, or start "
                                f"from a new shell") from None
        except OSError as e:
            raise FeedbackError(f"ConceptMoE in vLLM: cannot open its scheduler-worker table {self.path} ({e}); "
                                f"set CONCEPTMOE_VLLM_FEEDBACK_DIR to a writable folder on a memory file "
                                f"system") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise FeedbackError(f"ConceptMoE in vLLM: its scheduler-worker table {self.path} belongs to another "
                                    f"user or is open to others (mode {stat.S_IMODE(st.st_mode):o}): refused")
            if fresh:
                os.ftruncate(fd, size)
            else:  # the scheduler's size: its keys are blocks in its units
                self.num_blocks = st.st_size // (_WIDTH * 8)
                size = self.num_blocks * _WIDTH * 8
            if not size:
                raise FeedbackError(f"ConceptMoE in vLLM: its scheduler-worker table {self.path} is empty: refused")
            self._map = mmap.mmap(fd, size)
        except OSError as e:
            raise FeedbackError(f"ConceptMoE in vLLM: cannot map its scheduler-worker table {self.path} ({e})") from None
        finally:
            os.close(fd)
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

    def grant(self, key: int, epoch: int, capacity: int, mode: int, snapshot: tuple[int, int] = (0, 0)) -> None:
        self._store(key, _G, [epoch, capacity, mode, *snapshot])

    def grants(self, keys: np.ndarray) -> np.ndarray:
        """(K, 5): epoch, capacity, mode, a hit's snapshot row and its writer's epoch, per key; a torn or
        missing grant reads as epoch 0."""
        vals, ok = self._load(keys, _G, 5)
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

    # -- snapshots: model -> scheduler, keyed by the token block a prefix ends with ---------------

    def snapshot_many(self, keys: np.ndarray, epochs, tokens, concepts) -> None:
        self._store(keys, _S, [epochs, tokens, concepts])

    def snapshots(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """((K, 3): the writer's epoch, T, C per key; (K,) whether each read is whole)."""
        return self._load(keys, _S, 3)

    def clear(self, key: int) -> None:
        self._store(key, _G, [0, 0, 0, 0, 0])
        self._store(key, _R, [0, 0, 0, 0])


_TABLES: dict[int, FeedbackTable] = {}


def shared_table(num_blocks: int) -> FeedbackTable:
    """This scheduler process's table: created once (several concept groups share it), removed at exit."""
    pid = os.getpid()
    if pid not in _TABLES:
        _TABLES[pid] = table = FeedbackTable(pid, num_blocks, fresh=True)
        atexit.register(lambda: table.path.unlink(missing_ok=True))
    return _TABLES[pid]
