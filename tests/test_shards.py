"""Prepared token shards: ``conceptmoe prepare`` and training on memory-mapped shards
(conceptmoe/data/prepare.py, shards.py, sources.py)."""

import gzip
import json
import os
import random
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

import conceptmoe.data.prepare as prep_mod
from conceptmoe.errors import UserError
from conceptmoe.training import checkpoint as ck
from conceptmoe.data.corpus import DOC_SEP, BatchSampler, Document, load_corpus, split_documents
from conceptmoe.evaluation.evaluate import evaluate
from conceptmoe.data.prepare import PrepareConfig, prepare
from conceptmoe.data.shards import ShardSampler, TokenView, file_sha256, is_prepared, open_prepared
from conceptmoe.data.tokenizer import (encode_documents, load_tokenizer, pieces, sha256, splits_safely,
                                           train_tokenizer)
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus, run_cli


def _prepare(data, out, **kw):
    return prepare(PrepareConfig(data=str(data), out=str(out), progress=False, **kw))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Long documents (tails held out) and 30 short ones (every 20th held out whole)."""
    folder = make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=4, chars=9000)
    for i in range(30):
        (folder / f"short{i:02d}.md").write_text(f"Note {i}: " + "a line of text ünïcödé\n" * (3 + i % 5))
    return folder


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    return _prepare(corpus, tmp_path_factory.mktemp("prep") / "p", vocab_size=256, shard_tokens=3000)


def test_shards_hold_the_plain_text_token_streams(corpus, prepared):
    p = open_prepared(prepared, verify=True)
    tok = load_tokenizer(p.tokenizer_path)
    c = load_corpus(corpus)
    train_ids = encode_documents(tok, [d.text for d in c.train], DOC_SEP)
    val_ids = encode_documents(tok, [d.text for d in c.val], DOC_SEP)
    assert np.array_equal(p.train_tokens[:], train_ids) and np.array_equal(p.val_tokens[:], val_ids)
    # small corpus: the tokenizer learnt from all training text, as the plain path's does
    assert sha256(tok) == sha256(train_tokenizer([d.text for d in c.train], 256))
    rec, want = p.record(), c.record()
    assert {k: rec[k] for k in want if k not in ("source", "sha256")} == \
        {k: want[k] for k in want if k not in ("source", "sha256")}
    assert set(rec) == set(want) and rec["val_documents"] > 4  # tails and whole short documents


def test_manifest_counts_hashes_and_bytes(prepared):
    p = open_prepared(prepared)
    m = json.loads((prepared / "manifest.json").read_text())
    assert m["format"] == "conceptmoe-prepared" and m["version"] == 1 and m["dtype"] == "<u2"
    assert m["tokenizer"]["sha256"] == sha256(load_tokenizer(prepared / "tokenizer.json"))
    byte_len = p.byte_lengths()
    for split, view in (("train", p.train_tokens), ("val", p.val_tokens)):
        s = m["splits"][split]
        assert s["tokens"] == len(view) == sum(x["tokens"] for x in s["shards"])
        assert s["bytes"] == int(byte_len[view[:]].sum())  # bits per byte stays exact
        for x in s["shards"]:
            assert file_sha256(prepared / x["file"]) == x["sha256"]
    assert len(m["splits"]["train"]["shards"]) >= 3
    assert sorted(f.name for f in prepared.iterdir()) == sorted(
        [".lock", "manifest.json", "tokenizer.json"] + [x["file"] for s in m["splits"].values() for x in s["shards"]])


def test_training_on_shards_equals_training_on_text(corpus, prepared, tmp_path):
    torch.set_num_threads(1)
    kw = dict(**TINY, max_steps=3, eval_every=3, save_every=3)
    a = train(TrainConfig(**kw, data=str(prepared), out=str(tmp_path / "shards")))
    b = train(TrainConfig(**kw, data=str(corpus), tokenizer=str(prepared / "tokenizer.json"),
                          out=str(tmp_path / "text")))
    ma, mb = ck.read_metrics(a), ck.read_metrics(b)
    assert len(ma) == 3 and [r["loss"] for r in ma] == [r["loss"] for r in mb]
    assert ma[-1]["val_loss"] == mb[-1]["val_loss"]
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["data"]["sha256"] == open_prepared(prepared).sha256
    ea, eb = evaluate(a), evaluate(b)
    assert ea == eb and ea.pop("health") and ea == {k: v for k, v in json.loads((a / "eval.json").read_text()).items()
                                                    if k != "step"}
    assert evaluate(b, data=str(prepared)) == evaluate(b)  # eval --data on a prepared directory
    # a resumed run finds the same shards; a re-prepared directory is a changed corpus
    train(TrainConfig(**{**kw, "max_steps": 4}, data=str(prepared), out=str(a), resume=True))
    assert len(ck.read_metrics(a)) == 4


def test_sampler_over_shards_equals_batch_sampler(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    parts = []
    for i, (lo, hi) in enumerate([(0, 333), (333, 334), (334, 1000)]):  # windows straddle shards
        tokens[lo:hi].tofile(tmp_path / f"{i}.bin")
        parts.append(np.memmap(tmp_path / f"{i}.bin", dtype=np.uint16, mode="r"))
    view = TokenView(parts, np.dtype(np.uint16))
    assert len(view) == 1000 and np.array_equal(view[330:340], tokens[330:340]) and view[-1] == 999
    a, b = BatchSampler(tokens, 10, 7, seed=3), ShardSampler(view, 10, 7, seed=3)
    for _ in range(20):  # crosses epochs (100 windows, 7 per batch)
        assert torch.equal(a.next(), b.next())
    pos = b.position
    want = a.next()
    c = ShardSampler(view, 10, 7, seed=3)
    c.set_position(pos)
    assert torch.equal(c.next(), want) and want.dtype == torch.int64


def test_pieces_encode_like_the_whole_text():
    rng = random.Random(0)
    words = ["the", "The", "don't", "it's", "  ", "\t", "\n", "\n\n", "42", "3.14", "ünï", "日本語", "!!", "--",
             "x'", "a", "I", " ", "(b)", "'s", "e-mail", "\r\n", "…"]
    text = "".join(rng.choice(words) + rng.choice([" ", "", "  ", "\n"]) for _ in range(20000))
    tok = train_tokenizer([text[:30000]], 400)
    assert splits_safely(tok)
    parts = list(pieces(text, 64))
    assert len(parts) > 100 and "".join(parts) == text
    assert [i for e in tok.encode_batch(parts) for i in e.ids] == tok.encode(text).ids
    assert list(pieces("x" * 1000, 64)) == ["x" * 1000]  # nowhere safe to cut: stays whole


def test_interrupted_prepare_resumes_where_it_stopped(corpus, prepared, tmp_path, monkeypatch):
    out = tmp_path / "p"
    close = prep_mod.ShardWriter.close
    calls = []

    def crash_on_third(self, *args):
        calls.append(1)
        if len(calls) == 3:
            (out / "train-99999.bin.tmp").write_bytes(b"half")  # a shard being written
            raise KeyboardInterrupt
        close(self, *args)

    monkeypatch.setattr(prep_mod.ShardWriter, "close", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, out, vocab_size=256, shard_tokens=3000)
    monkeypatch.setattr(prep_mod.ShardWriter, "close", close)
    assert not (out / "manifest.json").exists() and (out / "progress.json").exists()
    with pytest.raises(UserError, match="unfinished"):
        is_prepared(out)  # train --data refuses it
    with pytest.raises(UserError, match="different text_field"):
        _prepare(corpus, out, vocab_size=256, shard_tokens=3000, text_field="body")
    first = (out / "train-00000.bin").stat().st_ino
    _prepare(corpus, out, vocab_size=256, shard_tokens=3000)
    assert (out / "train-00000.bin").stat().st_ino == first  # kept, not written again
    assert (out / "manifest.json").read_bytes() == (prepared / "manifest.json").read_bytes()
    assert not (out / "progress.json").exists() and not list(out.glob("*.tmp"))


def test_refusals_and_force(corpus, prepared, tmp_path):
    with pytest.raises(UserError, match="already holds prepared data"):
        _prepare(corpus, prepared, vocab_size=256)
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    r = run_cli("prepare", "--data", str(corpus), "--out", str(other), "--vocab-size", "256")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not empty" in r.stderr
    _prepare(corpus, other, vocab_size=256, force=True)
    assert (other / "notes.txt").read_text() == "keep me" and is_prepared(other)
    with pytest.raises(UserError, match="--tokenizer or --vocab-size"):
        PrepareConfig(data=str(corpus), out=str(tmp_path / "x"), tokenizer="t.json", vocab_size=300)
    with pytest.raises(UserError, match="no text"):
        (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n')
        _prepare(tmp_path / "empty.jsonl", tmp_path / "e", vocab_size=256)
    assert not (tmp_path / "e").exists()
    path = tmp_path / "other.json"
    train_tokenizer(["something else entirely"], 260).save(str(path))
    with pytest.raises(UserError, match="not the tokenizer"):
        train(TrainConfig(**TINY, data=str(prepared), max_steps=1, out=str(tmp_path / "r1"), tokenizer=str(path)))
    wide = _prepare(corpus, tmp_path / "wide", vocab_size=300)
    with pytest.raises(UserError, match="prepare again with --vocab-size 256"):
        train(TrainConfig(**TINY, data=str(wide), max_steps=1, out=str(tmp_path / "r2")))


def _docs(n=60):
    rng = random.Random(1)
    return [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "ω"]) for _ in range(rng.randint(5, 900)))
            for _ in range(n)]


def _jsonl_sources(tmp_path, docs):
    lines = "".join(json.dumps({"content": t, "id": i}) + "\n" for i, t in enumerate(docs))
    (tmp_path / "c.jsonl").write_text(lines)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(lines)
    return tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz"


def test_jsonl_and_jsonl_gz_sources(tmp_path):
    docs = _docs()
    plain, gz = _jsonl_sources(tmp_path, docs)
    kw = dict(vocab_size=300, text_field="content")
    a, b = _prepare(plain, tmp_path / "a", **kw), _prepare(gz, tmp_path / "b", **kw)
    sa, sb = (json.loads((o / "manifest.json").read_text())["splits"] for o in (a, b))
    train, val = split_documents([Document(str(i), t) for i, t in enumerate(docs)])
    assert sa == sb and (sa["train"]["documents"], sa["val"]["documents"]) == (len(train), len(val))
    with pytest.raises(UserError, match="c.jsonl:1: expected an object with a string \"text\" field"):
        _prepare(plain, tmp_path / "e", vocab_size=300)
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match="unreadable"):
        _prepare(tmp_path / "bad.jsonl.gz", tmp_path / "f", vocab_size=300)


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _docs()
    plain, _ = _jsonl_sources(tmp_path, docs)
    pq.write_table(pa.table({"id": list(range(len(docs))), "content": docs}), tmp_path / "c.parquet",
                   row_group_size=16)
    kw = dict(vocab_size=300, text_field="content")
    a, b = _prepare(plain, tmp_path / "a", **kw), _prepare(tmp_path / "c.parquet", tmp_path / "b", **kw)
    assert (json.loads((a / "manifest.json").read_text())["splits"]
            == json.loads((b / "manifest.json").read_text())["splits"])
    with pytest.raises(UserError, match="no column 'text' \\(columns: id, content\\)"):
        _prepare(tmp_path / "c.parquet", tmp_path / "d", vocab_size=300)


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("pyarrow") else real(name, *a, **k))
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"needs pyarrow: pip install 'conceptmoe\[prepare\]'"):
        _prepare(tmp_path / "c.parquet", tmp_path / "o", vocab_size=300)


def test_uint32_ids_for_a_vocabulary_past_65536(tmp_path):
    docs = _docs(30)
    small = json.loads(train_tokenizer(docs, 300).to_str())
    vocab = small["model"]["vocab"]
    shift = 70_000  # merged tokens move past 65535, unused entries fill the gap
    vocab = {t: i if i < 256 else i + shift for t, i in vocab.items()}
    vocab.update({f"<unused{i}>": 256 + i for i in range(shift)})
    small["model"]["vocab"] = vocab
    (tmp_path / "big.json").write_text(json.dumps(small))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = _prepare(tmp_path / "c.jsonl", tmp_path / "o", tokenizer=str(tmp_path / "big.json"))
    p = open_prepared(out, verify=True)
    tok = load_tokenizer(p.tokenizer_path)
    assert p.manifest["dtype"] == "<u4" and tok.get_vocab_size() > 65536
    c = load_corpus(tmp_path / "c.jsonl")
    want = encode_documents(tok, [d.text for d in c.train], DOC_SEP)
    assert want.max() > 65535 and np.array_equal(p.train_tokens[:], want)


def _words_corpus(path, mb, long_line=False):
    rng = random.Random(2)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "and", "so", "forth", "42"]
    chars = 0
    with open(path / "c.jsonl", "w") as f:
        if long_line:  # one ~5 MB line: encoded whole it needs ~1 GB
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(1_000_000))}) + "\n")
        while chars < mb * 1e6:
            t = " ".join(rng.choice(words) for _ in range(rng.randint(50, 3000)))
            f.write(json.dumps({"text": t}) + "\n")
            chars += len(t)
    train_tokenizer([" ".join(words)], 256).save(str(path / "tok.json"))
    return path / "c.jsonl", str(path / "tok.json")


def _peak(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_prepare_never_holds_the_corpus(tmp_path):
    """Python-side peak stays a fraction of a 20 MB corpus (reading it whole would need more)."""
    data, tok = _words_corpus(tmp_path, 20)
    peak = _peak(lambda: _prepare(data, tmp_path / "o", tokenizer=tok, shard_tokens=1 << 18))
    assert peak < 4e6, f"peak {peak / 1e6:.1f} MB"
    assert len(open_prepared(tmp_path / "o").train_tokens) > 18e6


_RSS_SCRIPT = """
import resource, sys
from conceptmoe.data.prepare import PrepareConfig, prepare
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prepare(PrepareConfig(data=sys.argv[1], out=sys.argv[2], tokenizer=sys.argv[3], progress=False))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in kilobytes on Linux")
def test_a_5mb_line_is_encoded_in_pieces(tmp_path, monkeypatch):
    data, tok = _words_corpus(tmp_path, 0.1, long_line=True)
    longest = []
    flush = prep_mod.ShardWriter.flush
    monkeypatch.setattr(prep_mod.ShardWriter, "flush",
                        lambda self: (longest.append(max((len(t) for *_, t in self.pending), default=0)), flush(self)))
    peak = _peak(lambda: _prepare(data, tmp_path / "o", tokenizer=tok))
    assert 0 < max(longest) <= 2 * prep_mod.PIECE_CHARS
    assert peak < 20e6, f"peak {peak / 1e6:.1f} MB"  # the line read, decoded and parsed: 3 copies
    # the tokenizer's own memory (not traced above): encoded whole, this line needs ~1 GB
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(data), str(tmp_path / "o2"), tok],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < 250e6, f"peak RSS grew by {int(r.stdout) / 1e6:.0f} MB"


def test_bench_prepare_reports_speed_and_memory(tmp_path):
    from conceptmoe.bench.prepare import format_table, run_prepare_bench

    res = run_prepare_bench([0.3], tmp_path, vocab_size=300, log=lambda msg: None)
    row = res["rows"][0]
    assert row["tokens"] > 50_000 and row["mb_per_s"] > 0 and row["peak_rss_mb"] > row["rss_over_imports_mb"] >= 0
    assert "MB/s" in format_table(res)


def test_a_held_out_shard_changed_in_place_is_refused(corpus, tmp_path):
    """Same size, valid ids, another text: eval (and every reader of the shards) refuses it."""
    prep = _prepare(corpus, tmp_path / "p", vocab_size=256, shard_tokens=3000)
    run = train(TrainConfig(**TINY, data=str(prep), max_steps=2, out=str(tmp_path / "run"), eval_every=0))
    assert run_cli("eval", str(run), "--json").returncode == 0
    shard = prep / json.loads((prep / "manifest.json").read_text())["splits"]["val"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=np.uint16)
    np.flip(ids).tofile(shard)  # the same ids, reversed
    for cmd in (["eval", str(run), "--json"], ["frontier", str(run), "--json"]):
        res = run_cli(*cmd)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "does not match its hash in the manifest" in res.stderr
    with pytest.raises(UserError, match="does not match its hash"):
        open_prepared(prep)
