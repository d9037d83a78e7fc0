"""Helpers shared by the training-pipeline tests: a small corpus and tiny-run settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conceptmoe.data.corpus import play_files

# A tiny model and very short sequences: a training step takes milliseconds on CPU.
TINY = dict(preset="tiny", batch_size=4, seq_len=32, lr=3e-3, device="cpu", progress=False)


def make_corpus(folder: Path, n_docs: int = 6, chars: int = 6000) -> Path:
    """``n_docs`` .txt files, each the start of a different play (each gives its last ~5% to
    validation: ``data.split_documents``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in play_files()[:n_docs]:
        (folder / f"{f.stem}.txt").write_text(f.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return folder


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m conceptmoe ARGS`` in a subprocess with one intra-op thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "conceptmoe", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)
