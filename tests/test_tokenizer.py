"""Byte-level BPE: exact round trip on any UTF-8, exact byte accounting (conceptmoe/tokenizer.py)."""

import numpy as np
import pytest

from conceptmoe.data.corpus import DOC_SEP
from conceptmoe.errors import UserError
from conceptmoe.data.tokenizer import (EOT, PAD, byte_lengths, encode, encode_documents, load_tokenizer,
                                       save_tokenizer, splits_safely, train_tokenizer)

SAMPLE = ("To be, or not to be, that is the question:\n"
          "Whether 'tis nobler in the mind to suffer\n") * 20
ODD = "naïve café — 你好, мир! 🎉🧪 e\u0301 \t tabs\r\nCRLF \x00 nul"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([SAMPLE], vocab_size=300)


def test_round_trip_any_utf8(tok):
    for text in (SAMPLE, ODD, "", " ", "\n\n\n"):
        assert tok.decode(tok.encode(text).ids) == text


def test_merges_learned_and_vocab_bounded(tok):
    assert 256 < tok.get_vocab_size() <= 300
    assert len(encode(tok, SAMPLE)) < 0.6 * len(SAMPLE.encode())


def test_byte_lengths_are_exact(tok):
    lengths = byte_lengths(tok, 300)
    for text in (SAMPLE, ODD):
        assert lengths[encode(tok, text)].sum() == len(text.encode("utf-8"))
    assert lengths.shape == (300,) and lengths[tok.get_vocab_size():].sum() == 0


def test_save_load_same_ids(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.encode(ODD).ids == tok.encode(ODD).ids
    assert not (tmp_path / "tokenizer.json.tmp").exists()


def test_training_is_deterministic():
    a = train_tokenizer([SAMPLE, ODD], 290).to_str()
    assert train_tokenizer([SAMPLE, ODD], 290).to_str() == a


def test_vocab_256_is_pure_bytes():
    t = train_tokenizer([SAMPLE], 256)
    assert len(encode(t, ODD)) == len(ODD.encode("utf-8"))


def test_documents_joined_by_end_of_text(tok):
    """Room for special tokens: <|endoftext|> and <|pad|> inside the vocabulary, end-of-text between
    documents (no bytes); a 256-entry (pure bytes) tokenizer separates with DOC_SEP as before."""
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    assert {eot, pad} == {0, 1} and tok.get_vocab_size() <= 300
    ids = encode_documents(tok, ["first doc", "second"], DOC_SEP)
    assert ids.tolist() == [*tok.encode("first doc").ids, eot, *tok.encode("second").ids]
    assert tok.decode(ids.tolist()) == "first docsecond"  # special tokens stand for no text
    assert byte_lengths(tok, 300)[[eot, pad]].tolist() == [0, 0] and ids.dtype == np.int32
    assert splits_safely(tok)
    pure = train_tokenizer([SAMPLE], 256)
    assert pure.token_to_id(EOT) is None and pure.get_vocab_size() == 256
    ids = encode_documents(pure, ["first doc", "second"], DOC_SEP)
    assert pure.decode(ids.tolist()) == "first doc" + DOC_SEP + "second"


def test_too_small_vocab_and_bad_file(tmp_path):
    with pytest.raises(UserError, match="below the 256"):
        train_tokenizer([SAMPLE], 100)
    (tmp_path / "t.json").write_text("{broken")
    with pytest.raises(UserError, match="unreadable"):
        load_tokenizer(tmp_path / "t.json")
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
