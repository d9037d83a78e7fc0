"""Prepared token shards on disk: their format, and reading them without loading them.

Supports CONCEPTMOE.md §5 at scale: ``conceptmoe prepare`` (prepare.py) tokenizes a corpus
once; ``conceptmoe train --data DIR`` then memory-maps it. A prepared directory holds

- ``train-00000.bin``, ... and ``val-00000.bin``, ...: raw little-endian token ids (``uint16``
  when the vocabulary fits, else ``uint32``), no header. The shards of a split, in manifest
  order, are one token stream: exactly ``encode_documents(tok, split_texts, DOC_SEP)`` of
  the plain-text path (documents joined by the ids of ``DOC_SEP``, held-out rule of
  ``data.split_documents``);
- ``tokenizer.json``: the tokenizer those ids belong to;
- ``manifest.json``, written last: format version, source, the source's fingerprint (and a
  recipe's record: ``recipes.describe``), tokenizer hash, dtype, and per split
  the documents, tokens, characters and UTF-8 bytes, and the shard list with SHA-256 hashes.

``open_prepared(dir)`` gives ``Prepared``: ``train_tokens`` / ``val_tokens`` are ``TokenView``
(concatenated memory maps; a slice copies out only what it covers), ``record()`` the same keys
as ``data.Corpus.record()`` with the manifest's hash as the fingerprint. ``ShardSampler`` is
``data.BatchSampler`` (same windows, order and position) over a ``TokenView``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ..errors import UserError
from .corpus import SPLIT_RULE, BatchSampler
from .tokenizer import byte_lengths, load_tokenizer, sha256

FORMAT = "conceptmoe-prepared"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # present while a prepare is unfinished (prepare.py)
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
UINT16_VOCAB = 1 << 16


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def is_prepared(data: str | Path | None) -> bool:
    """Whether ``data`` is a prepared directory; a one-line error for a half-written one."""
    if data is None:
        return False
    path = Path(data)
    if (path / MANIFEST).is_file():
        return True
    if (path / PROGRESS).is_file():
        raise UserError(f"{path} holds an unfinished `conceptmoe prepare`; run the same command again to finish it")
    return False


class TokenView:
    """Read-only concatenation of 1-D token arrays (memory maps): ``len`` and ``[a:b]`` slices.

    ``limit``: the vocabulary the ids belong to; a slice holding an id >= ``limit`` (a damaged
    shard) is a one-line error naming ``where``, never an index error inside the model."""

    def __init__(self, parts: list[np.ndarray], dtype: np.dtype, limit: int | None = None, where: str = "") -> None:
        self.parts = [p for p in parts if len(p)]
        self.dtype = dtype
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        self.limit, self.where = limit, where

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key: slice | int) -> np.ndarray | int:
        if not isinstance(key, slice):
            i = int(key) + (len(self) if int(key) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(key)
            return int(self[i:i + 1][0])
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenView slices take step 1")
        first, out = start, []
        k = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            begin = int(self.ends[k]) - len(self.parts[k])
            take = self.parts[k][start - begin:min(stop, int(self.ends[k])) - begin]
            out.append(take)
            start += len(take)
            k += 1
        ids = np.concatenate(out) if out else np.zeros(0, dtype=self.dtype)
        if self.limit is not None and len(ids) and int(ids.max()) >= self.limit:
            raise UserError(f"{self.where}: token id {int(ids.max())} in positions {first:,}+ is outside the "
                            f"tokenizer's {self.limit} entries; the shards are damaged: prepare the data again")
        return ids


@dataclass
class Prepared:
    """A prepared directory, opened (see the module doc)."""

    dir: Path
    manifest: dict
    sha256: str  # of manifest.json: the corpus fingerprint
    train_tokens: TokenView
    val_tokens: TokenView

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER

    def record(self) -> dict:
        """Source and fingerprint, the keys of ``data.Corpus.record()`` (stored in config.json)."""
        s = self.manifest["splits"]
        return {"source": str(self.dir), "sha256": self.sha256,
                "chars": s["train"]["chars"] + s["val"]["chars"],
                "train_documents": s["train"]["documents"], "val_documents": s["val"]["documents"],
                "split": SPLIT_RULE, **({"recipe": self.manifest["recipe"]} if self.manifest.get("recipe") else {})}

    def tokenizer(self, given: str | Path | None = None, vocab_size: int | None = None) -> Tokenizer:
        """The shards' tokenizer; a one-line error when ``given`` differs or it exceeds ``vocab_size``."""
        tok = load_tokenizer(self.tokenizer_path)
        if sha256(tok) != self.manifest["tokenizer"]["sha256"]:
            raise UserError(f"{self.tokenizer_path} changed since the shards were made; prepare {self.dir} again")
        if given is not None and sha256(load_tokenizer(given)) != sha256(tok):
            raise UserError(f"--tokenizer {given} is not the tokenizer {self.dir} was prepared with; leave it out")
        if vocab_size is not None and tok.get_vocab_size() > vocab_size:
            raise UserError(f"{self.dir} was prepared with {tok.get_vocab_size()} tokens but the model's vocab_size "
                            f"is {vocab_size}; prepare again with --vocab-size {vocab_size} or pick a larger model")
        return tok

    def byte_lengths(self, size: int | None = None) -> np.ndarray:
        """(size,) UTF-8 bytes of each token id (``tokenizer.byte_lengths``)."""
        return byte_lengths(self.tokenizer(), size)


def read_manifest(path: Path) -> tuple[dict, str]:
    """The manifest and the SHA-256 of its bytes; one-line errors for anything unexpected."""
    try:
        raw = (path / MANIFEST).read_bytes()
        m = json.loads(raw)
    except (OSError, ValueError) as e:
        raise UserError(f"{path / MANIFEST} is unreadable ({e}); prepare {path} again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"{path / MANIFEST} is not a conceptmoe prepared-data manifest")
    if m.get("version") != VERSION:
        raise UserError(f"{path} was prepared in format version {m.get('version')}; this conceptmoe reads "
                        f"version {VERSION}: prepare it again")
    return m, hashlib.sha256(raw).hexdigest()


def read_progress(path: Path) -> dict:
    """The state of an unfinished prepare (prepare.py); one-line errors for anything unexpected."""
    try:
        state = json.loads((path / PROGRESS).read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"{path / PROGRESS} is unreadable ({e}); pass --force to start over") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise UserError(f"{path / PROGRESS} is not from this conceptmoe version; pass --force to start over")
    return state


def open_prepared(data: str | Path, verify: bool = False) -> Prepared:
    """Open a prepared directory: shards memory-mapped, sizes checked, the held-out shards' hashes
    always (small, and every command that reads shards reads them: a shard changed in place, same
    size and valid ids, would give another loss; issue 41), the training shards' with ``verify``;
    every slice read later checks its ids against the tokenizer's vocabulary (``TokenView``)."""
    path = Path(data).resolve()
    m, digest = read_manifest(path)
    dtype = np.dtype(m["dtype"])
    limit = (m.get("tokenizer") or {}).get("vocab_size")
    views = {}
    for split in SPLITS:
        parts = []
        for s in m["splits"][split]["shards"]:
            f = path / s["file"]
            if not f.is_file() or f.stat().st_size != s["tokens"] * dtype.itemsize:
                raise UserError(f"shard {f} is missing or has the wrong size; prepare {path} again")
            if (verify or split == "val") and file_sha256(f) != s["sha256"]:
                raise UserError(f"shard {f} does not match its hash in the manifest; prepare {path} again")
            parts.append(np.memmap(f, dtype=dtype, mode="r"))
        views[split] = TokenView(parts, dtype, limit, f"{path} ({split} shards)")
    return Prepared(path, m, digest, views["train"], views["val"])


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class ShardSampler(BatchSampler):
    """``data.BatchSampler`` over a ``TokenView``: the same batches, read window by window.

    Only the window order, (n_windows,) int64, is held in memory; a window that straddles two
    shards is read from both.
    """

    def __init__(self, tokens: TokenView, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise UserError(f"training text has {len(tokens)} tokens, fewer than --seq-len {seq_len}")
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _window(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[i * self.seq_len:(i + 1) * self.seq_len].astype(np.int64))  # (T,)
