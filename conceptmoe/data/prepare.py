"""``prepare(PrepareConfig) -> Path``: tokenize a corpus once into token shards (CONCEPTMOE.md §5).

The corpus is streamed (sources.py), one document in memory at a time, in four passes:

1. scan: non-empty documents, characters, UTF-8 bytes and short documents. These fix the
   held-out rule (``data.SplitRule``), exactly as ``data.split_documents`` would on the whole.
2. tokenizer: ``--tokenizer`` as given, or a byte-level BPE trained on the first
   ``sample_mb`` million characters of training text (all of it for a small corpus, in the
   order the plain-text path trains on, so both give the same tokenizer).
3. the documents that give their tail: head to ``train``, tail to ``val``;
4. the short documents: to ``train``, or held out whole.

Passes 3 and 4 are the order of ``split_documents``, so each split's shards hold the token
stream the plain-text path would encode. Documents are cut into pieces at pre-tokenizer
boundaries (``tokenizer.pieces``) and encoded in batches by ``encode_batch_fast``, which uses
every core; peak memory is one document plus one batch, whatever the corpus size.

Crash safety: a shard is written to ``NAME.tmp`` and renamed when complete; ``progress.json``
(atomic) records the completed shards and the source position after each group of shards;
``manifest.json`` is written last and ``progress.json`` then removed. A rerun of the same command
continues from the last recorded position; with other options it refuses (``--force`` starts
over).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from ..errors import UserError
from ..files import write_json
from .corpus import DOC_SEP, MIN_TAIL_CHARS, SPLIT_RULE, SplitRule
from ..lock import LOCK_NAME, RunLock
from .shards import (FORMAT, MANIFEST, PROGRESS, SPLITS, TOKENIZER, VERSION, dtype_for, file_sha256, read_progress,
                     shard_name)
from .tokenizer import BYTE_ALPHABET
from . import recipes
from .sources import fingerprint, iter_documents
from .tokenizer import load_tokenizer, pieces, save_tokenizer, sha256, splits_safely, train_tokenizer
from .tokenizer import byte_lengths, separator_ids

DEFAULT_VOCAB = 4096  # the small preset's vocabulary
MAX_VOCAB = 1 << 24  # a trained tokenizer's largest vocabulary (the largest released ones hold ~256k)
SHARD_TOKENS = 1 << 26  # ~67M tokens, 128 MiB as uint16
SAMPLE_MB = 32.0  # million characters of training text the tokenizer learns from
PIECE_CHARS = 1 << 14  # characters per encoded piece
BATCH_CHARS = 1 << 19  # characters per encode_batch call (~100 bytes per token while encoding)
PASSES = ("long", "short")
TEXT_PROBE = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer 42 times"


@dataclass
class PrepareConfig:
    """What ``conceptmoe prepare`` does: source, output directory, tokenizer, shard size."""

    data: str
    out: str
    tokenizer: str | None = None  # tokenizer.json to use; None: train one
    vocab_size: int | None = None  # of the tokenizer trained here (default DEFAULT_VOCAB)
    text_field: str = "text"  # .jsonl / .parquet: where the text is
    shard_tokens: int = SHARD_TOKENS  # train shards close once past this many tokens
    sample_mb: float = SAMPLE_MB
    force: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.tokenizer and self.vocab_size is not None:
            raise UserError("give --tokenizer or --vocab-size, not both")
        if self.vocab_size is not None and not BYTE_ALPHABET <= self.vocab_size <= MAX_VOCAB:
            raise UserError(f"--vocab-size must be in [{BYTE_ALPHABET}, {MAX_VOCAB}]: a byte-level BPE holds the "
                            f"{BYTE_ALPHABET} byte symbols (got {self.vocab_size})")
        if self.shard_tokens < 1 or not self.sample_mb > 0:
            raise UserError("--shard-tokens and --sample-mb must be positive")
        if not self.text_field:
            raise UserError("--text-field must not be empty")


def check_text_tokenizer(tok: Tokenizer, path: str) -> None:
    """Refuse a tokenizer that turns ordinary text into its unknown token (a word-level
    vocabulary such as a vision-language run's): every document would become ``<unk>``."""
    unk = (json.loads(tok.to_str()).get("model") or {}).get("unk_token")
    unk_id = tok.token_to_id(unk) if isinstance(unk, str) else None
    if unk_id is not None and unk_id in tok.encode(TEXT_PROBE).ids:
        raise UserError(f"tokenizer {path} encodes ordinary text as its unknown token {unk!r} (a fixed word "
                        "vocabulary, e.g. a vision-language run's): use a byte-level tokenizer or leave out --tokenizer")


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def scan(cfg: PrepareConfig) -> dict[str, int]:
    """Pass 1: counts of the non-empty documents (all the held-out rule needs)."""
    counts = {"documents": 0, "chars": 0, "bytes": 0, "short": 0}
    with tqdm(desc="scanning", unit="B", unit_scale=True, disable=not cfg.progress, dynamic_ncols=True) as bar:
        for d in iter_documents(cfg.data, cfg.text_field):
            n = _utf8_len(d.text)
            counts["documents"] += 1
            counts["chars"] += len(d.text)
            counts["bytes"] += n
            counts["short"] += len(d.text) < MIN_TAIL_CHARS
            bar.update(n)
    if not counts["documents"]:
        raise UserError(f"data path {cfg.data!r} holds no text (it is empty)")
    return counts


def walk(cfg: PrepareConfig, rule: SplitRule, start: dict) -> Iterator[tuple[dict, str | None, str | None, int]]:
    """Passes 3 and 4 from ``start``: (position after the document, training text, held-out text, bytes)."""
    first = PASSES.index(start["pass"])
    for pass_ in PASSES[first:]:
        if pass_ == "short" and rule.tails_only:
            return  # every document gave its tail in the first pass
        skip, short_index = (start["docs"], start["short_index"]) if pass_ == start["pass"] else (0, 0)
        for n, d in enumerate(iter_documents(cfg.data, cfg.text_field), 1):
            if n <= skip or rule.gives_tail(d) != (pass_ == "long"):
                continue
            if pass_ == "long":
                head, tail = rule.tail_split(d)
                train, val = head.text, tail.text if tail is not None else None
            else:
                held = rule.holds_out(short_index)
                short_index += 1
                train, val = (None, d.text) if held else (d.text, None)
            yield {"pass": pass_, "docs": n, "short_index": short_index}, train, val, _utf8_len(d.text)


def training_sample(cfg: PrepareConfig, rule: SplitRule) -> Iterator[str]:
    """The first ``sample_mb`` million characters of training text, in training order."""
    budget = int(cfg.sample_mb * 1e6)
    for _, text, _, _ in walk(cfg, rule, {"pass": "long", "docs": 0, "short_index": 0}):
        if text is not None:
            yield text[:budget]
            budget -= len(text)
            if budget <= 0:
                return


class ShardWriter:
    """Both splits' token streams: pending pieces, the open shard files, the running counts."""

    def __init__(self, out: Path, tok: Tokenizer, state: dict, batch_chars: int = BATCH_CHARS) -> None:
        self.out, self.tok, self.state, self.batch_chars = out, tok, state, batch_chars
        self.dtype = np.dtype(state["dtype"])
        self.cut = splits_safely(tok)  # else documents are encoded whole
        self.sep = np.asarray(separator_ids(tok, DOC_SEP), dtype=self.dtype)  # end-of-text, or DOC_SEP's
        self.sep_bytes = int(byte_lengths(tok)[self.sep].sum())  # 0 for end-of-text
        self.pending: list[tuple[str, bool, str]] = []  # (split, after a separator, text)
        self.pending_chars = 0
        self.open: dict[str, tuple] = {}  # split -> (file, sha256, tokens)

    def add(self, split: str, text: str) -> None:
        """One document (or piece of one) appended to a split's stream."""
        s = self.state["splits"][split]
        sep = s["documents"] > 0
        s["documents"] += 1
        s["chars"] += len(text)
        s["bytes"] += _utf8_len(text) + (self.sep_bytes if sep else 0)
        for i, piece in enumerate(pieces(text, PIECE_CHARS) if self.cut else [text]):
            self.pending.append((split, sep and i == 0, piece))
            self.pending_chars += len(piece)
            if self.pending_chars >= self.batch_chars:
                self.flush()

    def flush(self) -> None:
        """Encode the pending pieces (in parallel) and append their ids to the open shards."""
        if not self.pending:
            return
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        encodings = encode([text for _, _, text in self.pending])
        for (split, sep, _), enc in zip(self.pending, encodings):
            if sep:
                self._write(split, self.sep)
            self._write(split, np.asarray(enc.ids, dtype=self.dtype))
        self.pending, self.pending_chars = [], 0

    def _write(self, split: str, ids: np.ndarray) -> None:
        if split not in self.open:
            index = len(self.state["splits"][split]["shards"])
            f = open(self.out / (shard_name(split, index) + ".tmp"), "wb")
            self.open[split] = (f, hashlib.sha256(), 0)
        f, h, n = self.open[split]
        f.write(memoryview(ids))
        h.update(memoryview(ids))
        self.open[split] = (f, h, n + len(ids))

    def open_tokens(self) -> int:
        return max((n for _, _, n in self.open.values()), default=0)

    def close(self, position: dict, bytes_done: int) -> None:
        """Flush, complete the open shards (fsync, rename) and record the position."""
        self.flush()
        for split, (f, h, n) in self.open.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            s = self.state["splits"][split]
            name = shard_name(split, len(s["shards"]))
            os.replace(self.out / (name + ".tmp"), self.out / name)
            s["shards"].append({"file": name, "tokens": n, "sha256": h.hexdigest()})
            s["tokens"] += n
        self.open = {}
        self.state.update(position=position, bytes_done=bytes_done)
        write_json(self.out / PROGRESS, self.state)


def _ours(p: Path) -> bool:
    """Files a prepare writes (removed by --force, or when a resume drops unfinished ones)."""
    return p.name in (MANIFEST, PROGRESS, TOKENIZER) or p.name.endswith((".bin", ".tmp"))


def _start(out: Path, options: dict, force: bool) -> dict | None:
    """The state to resume from, None for a fresh start, or a one-line refusal."""
    if force:
        for p in out.iterdir():
            if p.is_file() and _ours(p):
                p.unlink()
        return None
    if (out / MANIFEST).exists():
        raise UserError(f"{out} already holds prepared data; pass --force to prepare it again")
    if not (out / PROGRESS).exists():
        if any(p.name != LOCK_NAME for p in out.iterdir()):
            raise UserError(f"{out} is not empty and holds no prepared data; choose another --out or pass --force")
        return None
    state = read_progress(out)
    diff = sorted(k for k in set(options) | set(state["options"]) if options.get(k) != state["options"].get(k))
    if diff:
        raise UserError(f"{out} holds an unfinished prepare with different {', '.join(diff)}; rerun it with "
                        f"the same options, or pass --force to start over")
    done = {s["file"] for split in SPLITS for s in state["splits"][split]["shards"]}
    for p in out.iterdir():  # shards written after the last recorded position are made again
        if p.is_file() and p.name.endswith((".bin", ".tmp")) and p.name not in done:
            p.unlink()
    for split in SPLITS:  # the shards already made are read again only by their hashes: check them
        for s in state["splits"][split]["shards"]:
            f = out / s["file"]
            if not f.is_file() or f.stat().st_size != s["tokens"] * np.dtype(state["dtype"]).itemsize \
                    or file_sha256(f) != s["sha256"]:
                raise UserError(f"{out}: shard {s['file']} of the unfinished prepare is missing or changed; "
                                "pass --force to start over")
    return state


def prepare(cfg: PrepareConfig) -> Path:
    """Tokenize ``cfg.data`` into shards under ``cfg.out`` (or finish an interrupted run); returns it."""
    out = Path(cfg.out)
    given = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if given is not None:
        check_text_tokenizer(given, cfg.tokenizer)
    about = recipes.describe(cfg.data) if recipes.is_recipe(cfg.data) else None  # reads a recipe's text once
    options = {"source": cfg.data if about else str(Path(cfg.data).resolve()),
               "fingerprint": about["sha256"] if about else fingerprint(cfg.data), "recipe": about,
               "text_field": cfg.text_field, "shard_tokens": cfg.shard_tokens,
               "tokenizer": sha256(given) if given else None,
               "vocab_size": None if given else cfg.vocab_size or DEFAULT_VOCAB,
               "sample_mb": None if given else cfg.sample_mb}
    with RunLock(out):
        state = _start(out, options, cfg.force)
        if state is None:
            counts = scan(cfg)
            state = {"format": FORMAT, "version": VERSION, "options": options, "scan": counts, "tokenizer": None,
                     "dtype": None, "position": {"pass": PASSES[0], "docs": 0, "short_index": 0}, "bytes_done": 0,
                     "splits": {s: {"documents": 0, "tokens": 0, "chars": 0, "bytes": 0, "shards": []}
                                for s in SPLITS}}
            write_json(out / PROGRESS, state)
        rule = SplitRule.of(state["scan"]["chars"], state["scan"]["short"])
        if state["tokenizer"] is None:
            tok = given or train_tokenizer(training_sample(cfg, rule), options["vocab_size"])
            save_tokenizer(tok, out / TOKENIZER)
            state.update(tokenizer={"file": TOKENIZER, "sha256": sha256(tok), "vocab_size": tok.get_vocab_size()},
                         dtype=dtype_for(tok.get_vocab_size()).str)
            write_json(out / PROGRESS, state)
        tok = load_tokenizer(out / TOKENIZER)
        if sha256(tok) != state["tokenizer"]["sha256"]:
            raise UserError(f"{out / TOKENIZER} changed during the unfinished prepare; pass --force to start over")
        _tokenize(cfg, out, tok, rule, state)
        _finish(out, state, rule)
    return out


def _tokenize(cfg: PrepareConfig, out: Path, tok: Tokenizer, rule: SplitRule, state: dict) -> None:
    # A token covers at least one character's byte, so shards close near shard_tokens.
    writer = ShardWriter(out, tok, state, min(BATCH_CHARS, cfg.shard_tokens))
    position, done = state["position"], state["bytes_done"]
    with tqdm(total=state["scan"]["bytes"], initial=done, desc="tokenizing", unit="B", unit_scale=True,
              disable=not cfg.progress, dynamic_ncols=True, mininterval=1.0) as bar:
        for position, train, val, n in walk(cfg, rule, state["position"]):
            for split, text in (("train", train), ("val", val)):
                if text is not None:
                    writer.add(split, text)
            done += n
            bar.update(n)
            if writer.open_tokens() >= cfg.shard_tokens:
                writer.close(position, done)
        writer.close(position, done)


def _finish(out: Path, state: dict, rule: SplitRule) -> None:
    """Write the manifest (last), then drop progress.json; refuse a corpus with an empty split."""
    if not all(state["splits"][s]["tokens"] for s in SPLITS):
        for p in out.iterdir():
            if p.is_file() and _ours(p):
                p.unlink()
        raise UserError("the data is too short to hold out validation text; give more text")
    opts = state["options"]
    write_json(out / MANIFEST, {
        "format": FORMAT, "version": VERSION, "source": opts["source"], "fingerprint": opts["fingerprint"],
        **({"recipe": opts["recipe"]} if opts.get("recipe") else {}), "text_field": opts["text_field"],
        "tokenizer": state["tokenizer"], "dtype": state["dtype"],
        "split": {"rule": SPLIT_RULE, "frac": rule.frac, "every": rule.every, "tails_only": rule.tails_only},
        "splits": state["splits"]})
    (out / PROGRESS).unlink()
