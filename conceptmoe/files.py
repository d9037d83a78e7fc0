"""Files and folders written whole. Shared by every part of the package, like ``errors``.

- ``write_json``, ``write_text``, ``replacing``: one file replaced atomically (a reader sees the
  old file or the new one, never half of either).
- ``building(out, kind, force)``: a folder written whole. The folder is built in a temporary
  sibling ``.<name>.tmp-<kind>-<pid>`` and renamed into place at the end; an exception,
  SIGINT or SIGTERM removes the temporary folder; SIGKILL cannot be caught, so every later
  ``building`` of the same kind in the same parent first removes temporary folders of that kind
  whose process is dead. ``force`` replaces the folder (the old one is moved aside, then
  deleted), never merges into it.
- ``file_mode`` / ``set_modes``: the mode a new file gets under the current umask. safetensors
  writes through a private temporary file (mode 0600); ``set_modes`` gives such files the mode
  of every other file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

from .errors import Interrupted, UserError


def write_json(path: Path, obj: Any) -> None:
    """Write strict JSON (no NaN) atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write a UTF-8 text file atomically: temp file in the same directory, then rename."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """``with replacing(path) as tmp:`` write ``tmp`` (same folder and suffix, for writers that go by
    the extension, e.g. ``savefig``); it replaces ``path`` when the block ends (if written), or is
    removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        if tmp.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----- file modes -----
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file here (0o666 minus the umask)."""
    return 0o666 & ~_umask()


def set_modes(path: Path) -> None:
    """Give ``path`` (a file, or every file under a folder) the mode of a newly created file."""
    mode = file_mode()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for f in files:
        os.chmod(f, mode)


# ----- folders written whole -----
def temp_name(out: Path, kind: str, pid: int | None = None) -> Path:
    """The temporary sibling a ``building(out, kind)`` of process ``pid`` writes into."""
    return out.parent / f".{out.name}.tmp-{kind}-{os.getpid() if pid is None else pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def remove_stale(parent: Path, kind: str) -> list[Path]:
    """Delete the temporary folders of ``kind`` in ``parent`` whose process is dead; returns them."""
    pattern = re.compile(rf"^\..+\.(tmp|old)-{re.escape(kind)}-(\d+)$")
    removed = []
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def check_out(out: Path, force: bool, replaceable: bool) -> None:
    """Refuse an ``out`` that exists and is not an empty folder, unless ``force`` and ``replaceable``
    (the caller recognises it as one of ours: a run, a checkpoint): --force never deletes a
    user's other files."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} exists and is not a directory")
    if not out.is_dir() or not any(p.name != ".lock" for p in out.iterdir()):
        return
    if not force:
        raise UserError(f"--out {out} is not empty; choose another --out or pass --force to replace it")
    if not replaceable:
        raise UserError(f"--out {out} holds files that are not a run or a checkpoint; --force replaces only "
                        "those: choose another --out or empty it yourself")


class _RemoveOnSignal:
    """SIGTERM becomes an exception while a folder is being built, so that it is cleaned up."""

    def __enter__(self) -> "_RemoveOnSignal":
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._raise)
        return self

    def _raise(self, signum, frame) -> None:
        raise Interrupted("stopped by SIGTERM; nothing was written", 128 + signum)

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


@contextlib.contextmanager
def building(out: str | Path, kind: str, force: bool = False, replaceable: bool = False) -> Iterator[Path]:
    """``with building(out, kind, force) as tmp:`` write the folder's files into ``tmp``; at the end
    of the block ``tmp`` becomes ``out`` whole (see the module docstring). ``replaceable``: ``out``
    may be replaced with ``force`` (``check_out``), checked again at the end."""
    out = Path(out)
    check_out(out, force, replaceable)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent, kind)
    tmp = temp_name(out, kind)
    shutil.rmtree(tmp, ignore_errors=True)
    with _RemoveOnSignal():
        try:
            tmp.mkdir()
            yield tmp
            set_modes(tmp)
            _swap(tmp, out, kind, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _swap(tmp: Path, out: Path, kind: str, force: bool) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first, then deleted."""
    old = None
    if out.is_dir():
        if not force and any(p.name != ".lock" for p in out.iterdir()):
            raise UserError(f"--out {out} was written by another process meanwhile; nothing was replaced")
        old = out.parent / f".{out.name}.old-{kind}-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
