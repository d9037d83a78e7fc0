"""Concept-boundary display: spans cover the text exactly and match the model (conceptmoe/boundaries.py)."""

import pytest
import torch

from conceptmoe.evaluation.boundaries import find_boundaries, render_html, render_terminal
from conceptmoe.training.checkpoint import load_run
from conceptmoe.training.train import TrainConfig, train
from training_helpers import TINY, make_corpus

TEXT = ("But, soft! what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun. naïve 🎉 <tag> & done\n") * 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("b")
    return train(TrainConfig(**TINY, data=str(make_corpus(tmp / "c")), out=str(tmp / "run"), max_steps=3))


def test_spans_cover_text_and_match_model(run):
    res = find_boundaries(run, TEXT, "cpu")
    assert "".join(c.text for c in res.concepts) == TEXT
    assert sum(c.n_tokens for c in res.concepts) == res.n_tokens
    model, _, tok, _ = load_run(run, "cpu")
    ids = tok.encode(TEXT).ids
    # The tiny run trains with seq_len 32: windows of 32 tokens, each starting a concept.
    want = 0
    with torch.no_grad():
        for s in range(0, len(ids), 32):
            want += int(model(torch.tensor([ids[s:s + 32]])).boundaries.sum())
    assert len(res.concepts) == want
    assert res.compression == pytest.approx(len(ids) / want)
    assert all(0.0 <= c.p <= 1.0 for c in res.concepts)


def test_renderings(run):
    res = find_boundaries(run, TEXT, "cpu")
    coloured = render_terminal(res, color=True)
    assert coloured.count("\x1b[0m") == len(res.concepts) and res.summary() in coloured
    plain = render_terminal(res, color=False)
    assert plain.split("\n\n" + res.summary())[0].replace("|", "") == TEXT.replace("|", "")
    page = render_html(res)
    assert page.count("<span ") == len(res.concepts)
    assert "&lt;" in page and "&amp;" in page
    assert "<script" not in page and "<tag>" not in page
