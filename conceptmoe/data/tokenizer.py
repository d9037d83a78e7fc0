"""Byte-level BPE tokenizer, trained locally with Hugging Face ``tokenizers``.

Supports the training pipeline of CONCEPTMOE.md §5: both models of a comparison share one
tokenizer, so their bits-per-byte figures are comparable.

Byte-level means every UTF-8 string encodes (no unknown token) and decodes back exactly. Each
vocabulary entry is a string over the 256-symbol byte alphabet, one symbol per byte, so
``byte_lengths`` gives the exact number of UTF-8 bytes every token stands for; bits per byte is
then the summed negative log-likelihood in bits over the summed byte lengths of the predicted
tokens.

Special tokens (issue 19): a tokenizer trained here with room for them (``vocab_size`` >= 258)
holds ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1) inside its vocabulary. Training puts
end-of-text between documents (``separator_ids``), ``conceptmoe generate`` stops at it and
exports name it as EOS. They stand for no bytes (``byte_lengths`` 0). A 256-entry vocabulary
(pure bytes, the ``tiny`` preset) has no room: it, and every tokenizer made before special
tokens existed, separates documents with the plain text ``DOC_SEP`` as before, so old runs and
prepared folders keep their token streams.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import UserError

BYTE_ALPHABET = 256
EOT, PAD = "<|endoftext|>", "<|pad|>"
SPECIAL = (EOT, PAD)
# A place where the byte-level pre-tokenizer always splits: a space after a printable ASCII
# character and before an ASCII letter (its regex has no lookbehind, so a token never spans it).
_SAFE_CUT = re.compile(r"[!-~] [A-Za-z]")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` entries (>= 256) on ``texts``."""
    if vocab_size < BYTE_ALPHABET:
        raise UserError(f"vocab_size {vocab_size} is below the {BYTE_ALPHABET} byte symbols a byte-level BPE needs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = list(SPECIAL) if vocab_size >= BYTE_ALPHABET + len(SPECIAL) else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write ``tokenizer.json`` atomically (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer {path} not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"tokenizer {path} is unreadable ({str(e).splitlines()[0]})") from None


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    """Token ids of one text as int32."""
    return np.asarray(tok.encode(text).ids, dtype=np.int32)


def separator_ids(tok: Tokenizer, sep: str) -> list[int]:
    """Ids between two documents: end-of-text if the tokenizer has it, else the text ``sep``'s."""
    eot = tok.token_to_id(EOT)
    if eot is not None:
        return [eot]
    return tok.encode(sep).ids if sep else []


def encode_documents(tok: Tokenizer, texts: list[str], sep: str) -> np.ndarray:
    """Token ids of the documents joined by ``separator_ids(tok, sep)`` (tokenized in parallel)."""
    sep_ids = separator_ids(tok, sep)
    parts: list[int] = []
    for i, enc in enumerate(tok.encode_batch(texts)):
        if i:
            parts.extend(sep_ids)
        parts.extend(enc.ids)
    return np.asarray(parts, dtype=np.int32)


def byte_lengths(tok: Tokenizer, size: int | None = None) -> np.ndarray:
    """(size,) int64: UTF-8 bytes each token id stands for (0 for ids the tokenizer lacks)."""
    n = size or tok.get_vocab_size()
    out = np.zeros(n, dtype=np.int64)
    special = {t for t in SPECIAL if tok.token_to_id(t) is not None}
    for piece, i in tok.get_vocab().items():
        if i < n and piece not in special:
            out[i] = len(piece)  # one byte-alphabet symbol per byte
    return out


def sha256(tok: Tokenizer) -> str:
    """Fingerprint of a tokenizer: its canonical serialization, not the file's formatting."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def splits_safely(tok: Tokenizer) -> bool:
    """Whether ``pieces`` leaves this tokenizer's ids unchanged: a plain byte-level BPE like
    ``train_tokenizer``'s (no normalizer, added tokens other than its special ones, prefix space or
    post-processing). The special tokens hold no space, so ``pieces`` never cuts through one."""
    d = json.loads(tok.to_str())
    pre = d.get("pre_tokenizer") or {}
    added = {t.get("content") for t in d.get("added_tokens") or []}
    return (added <= set(SPECIAL) and d.get("normalizer") is None and d.get("truncation") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space")
            and (d.get("post_processor") or {"type": "ByteLevel"}).get("type") == "ByteLevel")


def pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut into pieces of about ``size`` characters at pre-tokenizer boundaries.

    Encoding the pieces one by one gives the ids of the whole text (for ``splits_safely``
    tokenizers), in bounded memory and in parallel: a 5 MB line encoded whole needs ~1 GB.
    Text with no safe place to cut stays whole.
    """
    start = 0
    while len(text) - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        yield text[start:m.start() + 1]
        start = m.start() + 1
    yield text[start:]
