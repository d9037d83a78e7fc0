"""Documents streamed from a corpus on disk, one at a time (for ``conceptmoe prepare``).

Supports the data side of CONCEPTMOE.md §5 at scale: a corpus larger than memory is read
document by document, never whole. Sources:

- a UTF-8 text file (one document), or a folder of ``.txt``/``.md`` files (one document each,
  sorted paths, searched recursively): the same documents as ``data.read_documents``;
- ``.jsonl`` or ``.jsonl.gz``: one JSON object per line, the text in ``text_field``;
- ``.parquet``: the string column ``text_field``, read in record batches (needs ``pyarrow``,
  the optional extra ``conceptmoe[prepare]``);
- a recipe name (``python-stdlib``, ``kjv``: recipes.py): its documents in their fixed order.

Empty and whitespace-only documents are skipped, as ``data.read_documents`` does.
``fingerprint`` identifies a source by names, sizes and modification times: a resumed prepare
checks it instead of re-reading everything. A recipe's fingerprint is its content hash
(``recipes.describe``): it reads the text, but is the same on every machine holding that text.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Iterator

from ..errors import UserError
from . import recipes
from .corpus import TEXT_SUFFIXES, Document, read_text_file

PARQUET_BATCH = 1024  # rows per record batch


def kind(path: Path) -> str:
    name = path.name.lower()
    if recipes.is_recipe(path):
        return "recipe"
    if path.is_dir():
        return "folder"
    for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
        if name.endswith(suffix):
            return suffix[1:]
    return "text"


def files(data: str | Path) -> list[Path]:
    """The files a source reads, in order; a one-line error when there are none."""
    path = Path(data)
    if not path.exists():
        raise UserError(f"data path {str(data)!r} does not exist")
    if not path.is_dir():
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not found:
        raise UserError(f"data folder {str(data)!r} holds no .txt or .md files")
    return found


def fingerprint(data: str | Path) -> str:
    """SHA-256 over the source's file names, sizes and modification times (a recipe: its content)."""
    if recipes.is_recipe(data):
        return recipes.describe(str(data))["sha256"]
    h = hashlib.sha256()
    for f in files(data):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def iter_documents(data: str | Path, text_field: str = "text") -> Iterator[Document]:
    """Non-empty documents of a source, in order, one in memory at a time."""
    path = Path(data)
    k = kind(path)
    if k == "recipe":
        docs = (Document(name, text) for name, text in recipes.documents(str(data)))
    elif k == "folder":
        docs = (Document(str(f.relative_to(path)), read_text_file(f)) for f in files(path))
    elif k in ("jsonl", "jsonl.gz"):
        docs = _jsonl(path, text_field)
    elif k == "parquet":
        docs = _parquet(path, text_field)
    else:
        docs = iter([Document(path.name, read_text_file(path))])
    for d in docs:
        if d.text.strip():
            yield d


def _jsonl(path: Path, field: str) -> Iterator[Document]:
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist or is not a file")
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                doc = _json_line(path, n, raw, field)
                del raw  # not held while the caller works on a long line
                yield doc
    except (OSError, EOFError) as e:  # gzip: truncated or not gzip at all
        raise UserError(f"{path}: unreadable ({e})") from None


def _json_line(path: Path, n: int, raw: bytes, field: str) -> Document:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}:{n}: not UTF-8 text (invalid byte at offset {e.start} of the line)") from None
    if not line.strip():
        return Document(f"{path.name}:{n}", "")
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
        raise UserError(f"{path}:{n}: expected an object with a string {json.dumps(field)} field")
    return Document(f"{path.name}:{n}", rec[field])


def _parquet(path: Path, field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading .parquet needs pyarrow: pip install 'conceptmoe[prepare]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise UserError(f"{path}: no column {field!r} (columns: {', '.join(names)}); pass --text-field")
    row = 0
    for values in _columns(pf, path, field):
        for value in values:
            row += 1
            if value is None:
                continue  # a missing text is an empty document
            if not isinstance(value, str):
                raise UserError(f"{path}: row {row}: column {field!r} holds {type(value).__name__}, not text")
            yield Document(f"{path.name}:{row}", value)


def _columns(pf, path: Path, field: str) -> Iterator[list]:
    """The values of column ``field``, one record batch at a time; a damaged page (bad header,
    truncated or undecodable data) is a one-line error naming the rows read so far."""
    batches, rows = pf.iter_batches(batch_size=PARQUET_BATCH, columns=[field]), 0
    while True:
        try:
            values = next(batches).column(0).to_pylist()
        except StopIteration:
            return
        except Exception as e:  # pyarrow: OSError (thrift, end of stream), ArrowInvalid; bad UTF-8
            msg = "".join(c for c in (str(e).splitlines() or [type(e).__name__])[0] if c.isprintable()).strip()
            raise UserError(f"{path}: damaged parquet data after row {rows} ({msg})") from None
        rows += len(values)
        yield values
