"""Corpus loading, the train/validation split and the resumable batch order (conceptmoe/data.py)."""

import json

import numpy as np
import pytest
import torch

from conceptmoe.errors import UserError
from conceptmoe.data.corpus import (DOC_SEP, HELD_OUT_PLAYS, BatchSampler, Corpus, Document, check_record,
                                      load_corpus, play_files, read_documents, split_documents,
                                      split_documents_legacy)
from training_helpers import make_corpus


def test_default_corpus_holds_out_fixed_plays():
    c = load_corpus()
    assert sorted(d.name for d in c.val) == sorted(HELD_OUT_PLAYS)
    train_names = {d.name for d in c.train}
    assert not train_names & set(HELD_OUT_PLAYS)
    assert len(train_names) + len(c.val) == len(play_files()) >= 30
    assert len(c.val_text) < 0.15 * len(c.train_text)
    assert c.train_text.startswith(c.train[0].text) and DOC_SEP + c.train[1].text in c.train_text


def test_folder_corpus_recurses_and_filters_suffixes(tmp_path):
    make_corpus(tmp_path / "a", n_docs=3)
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "extra.md").write_text("more text\n")
    (tmp_path / "a" / "skip.csv").write_text("x,y\n")
    docs = read_documents(tmp_path / "a")
    assert len(docs) == 4 and not any(d.name.endswith(".csv") for d in docs)


def test_legacy_split_every_tenth_document():
    docs = [Document(str(i), f"doc {i}") for i in range(23)]
    train, val = split_documents_legacy(docs)
    assert [d.name for d in val] == ["1", "11", "21"]
    assert len(train) == 20


def test_split_holds_out_a_bounded_share_of_every_source():
    # two very different sources: both must reach training, validation stays ~5% of the text
    docs = [Document("code.txt", "".join(f"x = {i}\n" for i in range(20000))),
            Document("plays.txt", "".join(f"line {i} of a play\n" for i in range(3000)))]
    train, val = split_documents(docs)
    assert {d.name for d in train} == {"code.txt:train", "plays.txt:train"}
    assert {d.name for d in val} == {"code.txt:val", "plays.txt:val"}
    total = sum(len(d.text) for d in docs)
    assert 0.04 < sum(len(d.text) for d in val) / total < 0.07
    for d in docs:  # head + tail give the document back
        assert next(t for t in train if t.name.startswith(d.name)).text + \
            next(v for v in val if v.name.startswith(d.name)).text == d.text


def test_split_many_short_documents_holds_out_whole_ones():
    docs = [Document(str(i), f"record {i}") for i in range(100)]
    train, val = split_documents(docs)
    assert len(val) == 5 and len(train) == 95 and all(":" not in d.name for d in val)


def test_split_caps_validation_text(monkeypatch):
    import conceptmoe.data.corpus as data

    monkeypatch.setattr(data, "MAX_VAL_CHARS", 1000)
    train, val = data.split_documents([Document("big.txt", "".join(f"{i}\n" for i in range(20000)))])
    assert sum(len(d.text) for d in val) <= 1100


def test_record_fingerprint_follows_the_text():
    a = Corpus("src", [Document("a", "one")], [Document("b", "two")])
    b = Corpus("src", [Document("a", "one")], [Document("b", "two!")])
    assert a.record()["sha256"] == Corpus("src", [Document("a", "one")], [Document("b", "two")]).record()["sha256"]
    assert a.record()["sha256"] != b.record()["sha256"]
    check_record(a.record(), a.record())
    with pytest.raises(UserError, match="data changed since the run started"):
        check_record(a.record(), b.record())


def test_single_file_splits_at_a_line(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    c = load_corpus(f)
    assert c.train[0].text + c.val[0].text == f.read_text()
    assert c.train[0].text.endswith("\n") and c.val[0].text.startswith("line ")
    assert 0.04 < len(c.val[0].text) / len(f.read_text()) < 0.10


def test_jsonl_reads_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"record {i}", "id": i}) for i in range(5)) + "\n\n")
    docs = read_documents(f)
    assert [d.text for d in docs] == [f"record {i}" for i in range(5)]


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    (b"", "empty"),
    (b"  \n\n", "empty"),
    (b"ok text\n\xff\xfe bad bytes", "not UTF-8"),
])
def test_bad_data_paths(tmp_path, content, match):
    f = tmp_path / "data.txt"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(UserError, match=match):
        load_corpus(f)


@pytest.mark.parametrize("lines, match", [
    (['{"text": "a"}', "{not json"], r"d.jsonl:2: not valid JSON"),
    (['{"body": "a"}'], r"d.jsonl:1: expected an object"),
    (['["text"]'], r"expected an object"),
])
def test_bad_jsonl(tmp_path, lines, match):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines))
    with pytest.raises(UserError, match=match):
        read_documents(f)


def test_folder_without_text_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00")
    with pytest.raises(UserError, match="no .txt or .md"):
        read_documents(tmp_path)


def test_sampler_position_resumes_exactly():
    tokens = np.arange(1000, dtype=np.int32)
    a = BatchSampler(tokens, seq_len=10, batch_size=7, seed=3)
    first = [a.next() for _ in range(20)]  # 140 windows: crosses an epoch boundary (100)
    b = BatchSampler(tokens, seq_len=10, batch_size=7, seed=3)
    for _ in range(9):
        b.next()
    pos = b.position
    c = BatchSampler(tokens, seq_len=10, batch_size=7, seed=3)
    c.set_position(pos)
    for want in first[9:]:
        assert torch.equal(c.next(), want)
    # An epoch visits every window exactly once, in a seed-dependent order.
    seen = torch.cat([x[:, 0] for x in first])[:100]
    assert sorted(seen.tolist()) == list(range(0, 1000, 10))
    other = BatchSampler(tokens, seq_len=10, batch_size=7, seed=4)
    assert not torch.equal(other.next(), first[0])


def test_sampler_needs_one_window():
    with pytest.raises(UserError, match="fewer than --seq-len"):
        BatchSampler(np.arange(5, dtype=np.int32), seq_len=10, batch_size=2, seed=0)
