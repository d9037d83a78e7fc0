"""``bench latency --input held-out``: a trained run is timed on its own held-out text, so its
router places the boundaries it places on text (issue 22: latency beside quality)."""

import json

import pytest
import torch

import conceptmoe.bench.latency as latency
from conceptmoe.cli import main
from conceptmoe.evaluation.evaluate import held_out_tokens
from conceptmoe.training.checkpoint import load_run
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lat")
    return train(TrainConfig(**TINY, data=str(make_corpus(tmp / "corpus")), out=str(tmp / "cm"), max_steps=4))


def _held_out(run):
    _, cfg, tok, run_cfg = load_run(run, "cpu")
    return torch.as_tensor(held_out_tokens(run_cfg, cfg, tok)[0], dtype=torch.long)


def test_prompts_and_decoded_tokens_are_the_held_out_text(run, tmp_path, monkeypatch):
    seen = {"prefill": [], "decode": []}
    real_prefill, real_decode = latency.prefill, latency.decode_step

    def spy_prefill(model, ids, **kw):
        seen["prefill"].append(ids.clone())
        return real_prefill(model, ids, **kw)

    def spy_decode(model, st, t, **kw):
        seen["decode"].append(t.clone())
        return real_decode(model, st, t, **kw)

    monkeypatch.setattr(latency, "prefill", spy_prefill)
    monkeypatch.setattr(latency, "decode_step", spy_decode)
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--preset", "tiny", "--strategies", "topk", "--run", str(run), "--input",
                 "held-out", "--prefill-lens", "40,64", "--prefill-batch", "2", "--kv-lens", "48", "--batch", "3",
                 "--decode-steps", "5", "--repeats", "1", "--threads", "1", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    text = _held_out(run)
    rows = torch.arange(2 * 64) % text.numel()
    want = text[rows].view(2, 64)
    timed = [ids for ids in seen["prefill"] if ids.shape[1] in (40, 64)]
    assert timed and all(torch.equal(ids, want[:, :ids.shape[1]]) for ids in timed)
    steps = torch.stack(seen["decode"][-5:])  # the last timed repeat of the last model: (steps, batch)
    assert torch.equal(steps, text[torch.arange(3 * 5) % text.numel()].view(3, 5).T)
    res = json.loads((out / "latency.json").read_text())
    assert res["settings"]["input"] == "held-out"
    trained = [r for r in res["prefill"] if r["model"].endswith(f"[{run.name}]")]
    assert len(trained) == 2 and all(r["compression"] >= 1 for r in trained)


def test_held_out_input_needs_a_run(capsys):
    assert main(["bench", "latency", "--preset", "tiny", "--input", "held-out", "--kv-lens", "none",
                 "--prefill-lens", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --input held-out takes the held-out text of the first --run: give one"


def test_random_input_is_unchanged_by_default(run, monkeypatch, tmp_path):
    seen = []
    real_prefill = latency.prefill
    monkeypatch.setattr(latency, "prefill", lambda model, ids, **kw: (seen.append(ids.clone()),
                                                                       real_prefill(model, ids, **kw))[1])
    assert main(["bench", "latency", "--preset", "tiny", "--strategies", "topk", "--run", str(run),
                 "--prefill-lens", "40", "--kv-lens", "none", "--repeats", "1", "--threads", "1", "--dtype", "fp32",
                 "--out", str(tmp_path)]) == 0
    g = torch.Generator().manual_seed(0)
    V = min(m["config"]["vocab_size"] for m in json.loads((tmp_path / "latency.json").read_text())["models"])
    assert torch.equal(seen[-1], torch.randint(0, V, (1, 40), generator=g))
