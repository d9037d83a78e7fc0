"""Skipped steps (``--skip-bad-steps``, issue 41): a skipped step has drawn its batch, so the next
batch draws its own boundary noise and ratios (R stays a pure function of the sample index), and
the count of skipped steps survives a resume (the flag bounds the whole run)."""

import json
import math
import signal

import pytest
import torch

from conceptmoe.errors import Interrupted, UserError
from conceptmoe.training import checkpoint as ck
from conceptmoe.training import loop
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus

FORWARD_BACKWARD, GRAD_NORM = loop.forward_backward, loop._grad_norm


@pytest.fixture
def corpus(tmp_path):
    return make_corpus(tmp_path / "c", n_docs=3, chars=3000)


def _spy(monkeypatch, bad_calls=(), stop_call=None):
    """Record (batch ids, ratios, boundary noise) of every forward; a non-finite gradient norm at
    the given calls (1-based, counted from this spy's start); a SIGTERM during ``stop_call``."""
    seen, fb, norm = [], FORWARD_BACKWARD, GRAD_NORM

    def forward_backward(lp, batch, u):
        seen.append((batch["input_ids"].clone(), batch.get("ratio"), u))
        if len(seen) == stop_call:
            signal.raise_signal(signal.SIGTERM)
        return fb(lp, batch, u)

    def grad_norm(model, clip):
        n = norm(model, clip)
        return math.nan if len(seen) in bad_calls else n

    monkeypatch.setattr(loop, "forward_backward", forward_backward)
    monkeypatch.setattr(loop, "_grad_norm", grad_norm)
    return seen


def _tc(corpus, out, **kw):
    return TrainConfig(**{**TINY, "data": str(corpus), "out": str(out), "max_steps": 3, "ratios": "1.5,2,3,4",
                          "eval_every": 0, "val_tokens": 200, "seed": 5, "dtype": "fp32", **kw})


def test_a_skipped_step_does_not_lend_its_draws_to_the_next_batch(corpus, tmp_path, monkeypatch):
    ref = _spy(monkeypatch)
    train(_tc(corpus, tmp_path / "ref", max_steps=4))
    got = _spy(monkeypatch, bad_calls=(2,))
    train(_tc(corpus, tmp_path / "skip", skip_bad_steps=1))
    assert len(got) == len(ref) == 4  # 3 steps and a skipped one: the same 4 batches drawn
    for (x, r, u), (x0, r0, u0) in zip(got, ref):
        assert torch.equal(x, x0)
        assert torch.equal(r, r0) and torch.equal(u, u0)  # the draws of the sample, not of the step
    assert len(ck.read_metrics(tmp_path / "skip")) == 3


def test_the_skip_count_survives_a_resume(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _spy(monkeypatch, bad_calls=(2,), stop_call=3)  # skip at the 2nd batch; SIGTERM during the 3rd
    with pytest.raises(Interrupted):
        train(_tc(corpus, out, max_steps=4, skip_bad_steps=1))
    assert len(ck.read_metrics(out)) == 2
    assert json.loads((ck.latest_checkpoint(out) / "state.json").read_text())["skipped"] == 1
    _spy(monkeypatch, bad_calls=(1,))  # another bad step: the run's one skip is spent
    with pytest.raises(UserError, match="training diverged at step 3"):
        train(_tc(corpus, out, max_steps=4, skip_bad_steps=1, resume=True))
