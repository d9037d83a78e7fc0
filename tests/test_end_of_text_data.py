"""Issue 19: training separates documents with end-of-text (a vocabulary with room for it).

``conceptmoe prepare`` and the plain-text path put ``<|endoftext|>`` between documents, count it
as zero bytes (bits per byte stays exact) and train the same; a 256-entry vocabulary keeps
``DOC_SEP`` (covered by test_shards.py), so old runs and prepared folders are unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from conceptmoe.data.corpus import DOC_SEP, load_corpus
from conceptmoe.data.prepare import PrepareConfig, prepare
from conceptmoe.data.shards import open_prepared
from conceptmoe.data.tokenizer import EOT, encode_documents, load_tokenizer
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus


def test_prepared_and_plain_streams_separate_documents_with_end_of_text(tmp_path):
    torch.set_num_threads(1)
    corpus = make_corpus(tmp_path / "corpus", n_docs=4, chars=5000)
    out = prepare(PrepareConfig(data=str(corpus), out=str(tmp_path / "p"), vocab_size=300, progress=False))
    p = open_prepared(out, verify=True)
    tok = load_tokenizer(p.tokenizer_path)
    eot = tok.token_to_id(EOT)
    assert eot is not None
    c = load_corpus(corpus)
    m = json.loads((out / "manifest.json").read_text())
    for split, docs, view in (("train", c.train, p.train_tokens), ("val", c.val, p.val_tokens)):
        ids = encode_documents(tok, [d.text for d in docs], DOC_SEP)
        assert np.array_equal(view[:], ids)
        assert int((ids == eot).sum()) == len(docs) - 1  # one end-of-text between two documents
        assert m["splits"][split]["bytes"] == sum(len(d.text.encode()) for d in docs)  # it stands for no bytes
        assert m["splits"][split]["bytes"] == int(p.byte_lengths()[view[:]].sum())
    kw = dict(**TINY, max_steps=2, eval_every=2, save_every=2, overrides={"vocab_size": 300})
    a = train(TrainConfig(**kw, data=str(out), out=str(tmp_path / "shards")))
    b = train(TrainConfig(**kw, data=str(corpus), tokenizer=str(out / "tokenizer.json"), out=str(tmp_path / "text")))
    assert [r["loss"] for r in ck.read_metrics(a)] == [r["loss"] for r in ck.read_metrics(b)]
    own = train(TrainConfig(**kw, data=str(corpus), out=str(tmp_path / "own")))  # its own tokenizer: EOT too
    assert load_tokenizer(own / "tokenizer.json").token_to_id(EOT) is not None
