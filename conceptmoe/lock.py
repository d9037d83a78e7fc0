"""One writer per run directory: an OS file lock held for the life of the process.

``RunLock(run_dir)`` takes an exclusive, non-blocking lock on ``run_dir/.lock`` (``flock`` on
POSIX, ``msvcrt.locking`` on Windows) and writes the holder's pid into it. The kernel releases
the lock when the process dies, SIGKILL included, so a crashed run never leaves a stale lock;
the file itself stays (deleting a lock file races with the next locker). A second writer gets
a one-line ``UserError`` naming the directory and the holder's pid. Readers (eval, generate,
boundaries, bench) take no lock: every file a run writes is replaced atomically.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .errors import UserError

LOCK_NAME = ".lock"

try:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
except ImportError:  # Windows
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False


class RunLock:
    """``with RunLock(path):`` creates ``path`` if needed and holds its lock for the block.

    If the directory was created here and the block ends with an exception while it holds
    nothing but the lock file (a refused run), the directory is removed again.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.fd: int | None = None
        self.created = False

    def __enter__(self) -> "RunLock":
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"{self.dir} exists and is not a directory")
        self.created = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.dir} is in use by another conceptmoe process (pid {holder}); "
                            f"wait for it to finish or choose another directory")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
        if exc_type is not None and self.created and [p.name for p in self.dir.iterdir()] == [LOCK_NAME]:
            (self.dir / LOCK_NAME).unlink(missing_ok=True)
            self.dir.rmdir()


def held(run_dir: Path) -> contextlib.AbstractContextManager:
    """``RunLock(run_dir)`` if the folder exists, else nothing: the lock a command takes on an
    ``--out`` it replaces whole (``files.building``), so that a run still being written there is
    never swapped away under its writer; a new folder needs no lock (and gets no lock file)."""
    return RunLock(run_dir) if Path(run_dir).is_dir() else contextlib.nullcontext()


def holds_only_lock(run_dir: Path) -> bool:
    """True when the folder is empty apart from a lock file."""
    return all(p.name == LOCK_NAME for p in run_dir.iterdir())
