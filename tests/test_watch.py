"""Watching a run (training/health.py, training/tblog.py, model/health.py): --log tensorboard writes
every figure of metrics.jsonl as events, eval --json reports the routers' health, and a dead
expert or a collapsed chunk router each raise their warning once."""

import json
import sys

import pytest
import torch

from conceptmoe.cli import build_parser
from conceptmoe.cli.training import train_config_from_args
from conceptmoe.errors import UserError
from conceptmoe.model import chunking, moe
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import resolve_train_config
from conceptmoe.training.train import TrainConfig, train
from conceptmoe.training.validation import windows
from training_helpers import TINY, make_corpus, run_cli

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

LAYERS = ["encoder0", "concept0", "concept1", "decoder0"]  # the tiny ConceptMoE's MoE layers
# metrics.jsonl key -> TensorBoard tag, written out here so that a renamed or dropped figure fails
STEP = {"loss": "train/loss", "bpb": "train/bpb", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "compression": "router/compression",
        "ratio_loss": "router/ratio_loss", "router_z_loss": "experts/z_loss"}
HEALTH = {"compression": "router/interval_compression", "near_threshold": "router/interval_near_threshold"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=3, chars=3000)


def _train(corpus, out, **kw):
    torch.set_num_threads(1)
    base = dict(TINY, data=str(corpus), out=str(out), max_steps=4, eval_every=2, val_tokens=2000, save_every=2)
    return train(TrainConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "watched"
    _train(corpus, out, log="tensorboard")
    # extended by two steps: the events append, each step once
    train(resolve_train_config({"out": str(out), "max_steps": 6, "progress": False}, resume=True))
    return out


def _events(run):
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_event_file_holds_every_scalar_of_the_jsonl(run):
    rows, acc = ck.read_metrics(run), _events(run)
    tags = set(acc.Tags()["scalars"])
    assert [r["step"] for r in rows] == list(range(1, 7))

    def check(tag, want: dict[int, float]):
        assert tag in tags, f"{tag} missing"
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert sorted(got) == sorted(want), tag  # every logged step once, resumed steps not twice
        for s, v in want.items():
            assert got[s] == pytest.approx(v, rel=1e-6, abs=1e-12), (tag, s)

    for key, tag in STEP.items():
        check(tag, {r["step"]: r[key] for r in rows})
    health = [r for r in rows if "health" in r]
    assert [r["step"] for r in health] == [2, 4, 6] and all(r["health"]["steps"] == 2 for r in health)
    check("eval/bpb", {r["step"]: r["val_bpb"] for r in health})
    for key, tag in HEALTH.items():
        check(tag, {r["step"]: r["health"][key] for r in health})
    for layer in LAYERS:
        for key in ("imbalance", "dead", "z_loss"):
            check(f"experts/{layer}/{key}", {r["step"]: r["health"]["experts"][layer][key] for r in health})
    hist = {e.step: e.histogram_value for e in acc.Histograms("router/p")}
    assert [int(c) for c in hist[6].bucket] == health[-1]["health"]["p_histogram"]
    load = {e.step: e.histogram_value for e in acc.Histograms("experts/decoder0/tokens")}
    assert [int(c) for c in load[4].bucket] == health[1]["health"]["experts"]["decoder0"]["tokens"]


def test_health_figures_add_up(run):
    rows = ck.read_metrics(run)
    h = rows[1]["health"]  # steps 1-2: 2 batches of 4 x 32 tokens
    enc = h["experts"]["encoder0"]
    for r in rows[1::2]:  # each interval counts its own 2 steps: every token to top_k = 2 experts at the token rate
        assert sum(r["health"]["experts"]["encoder0"]["tokens"]) == 2 * 4 * 32 * 2
    assert enc["imbalance"] == pytest.approx(max(enc["tokens"]) / (sum(enc["tokens"]) / 8))
    assert sum(h["p_histogram"]) == 2 * 4 * 31  # position 0 of each row (p = 1) left out
    assert 0 <= h["near_threshold"] <= 1 and h["target"] == 2.0 and rows[1]["mfu"] > 0
    for r in rows[1::2]:  # a dead-expert warning names exactly the layers with an expert at zero tokens
        zero = {name for name, e in r["health"]["experts"].items() if 0 in e["tokens"]}
        assert set(_dead_warned(r)) == zero and all(r["health"]["experts"][n]["dead"] >= 1 for n in zero)


def test_eval_json_reports_health(run):
    res = run_cli("eval", str(run), "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    h = out["health"]
    assert set(h["experts"]) == set(LAYERS) and h["compression"] == pytest.approx(out["compression"])
    n_windows = len(windows(out["tokens"] + 1, TINY["seq_len"]))  # one token of each is predicted in the next
    n_positions = out["tokens"] + n_windows
    assert sum(h["experts"]["decoder0"]["tokens"]) == 2 * n_positions  # top_k = 2 at the token rate
    assert sum(h["p_histogram"]) == n_positions - n_windows and h["target"] == 2.0


def _dead_warned(row) -> dict[str, list[int]]:
    """layer -> the experts a row's dead-expert warnings name."""
    out = {}
    for w in row.get("warnings", []):
        if "received no token" in w:
            layer, rest = w.split("layer ")[1].split(": ", 1)
            out[layer] = [int(e) for e in rest.split(" received")[0].removeprefix("experts ").removeprefix("expert ")
                          .split(", ")]
    return out


def test_dead_expert_warns_once(corpus, tmp_path, monkeypatch, capsys):
    route = moe._route

    def never_expert_3(x, weight, top_k, norm_topk_prob):
        logits, _, _, _ = route(x, weight, top_k, norm_topk_prob)
        logits = logits.clone()
        logits[:, 3] = -1e4  # expert 3 never wins a token
        probs = logits.softmax(-1)
        w, idx = probs.topk(top_k, dim=-1)
        return logits, probs, w, idx

    monkeypatch.setattr(moe, "_route", never_expert_3)
    out = _train(corpus, tmp_path / "dead", log="jsonl")
    rows = ck.read_metrics(out)
    for layer in LAYERS:
        assert rows[1]["health"]["experts"][layer]["tokens"][3] == 0
        assert rows[1]["health"]["experts"][layer]["dead"] >= 1
    dead = _dead_warned(rows[1])
    assert set(dead) == set(LAYERS) and all(3 in experts for experts in dead.values())
    assert not any(3 in experts for experts in _dead_warned(rows[3]).values())  # still dead: not repeated
    assert capsys.readouterr().err.count("3 received no token") == len(LAYERS)
    assert not (out / "tensorboard").exists()  # --log jsonl: no events


def test_collapsed_router_warns(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(chunking.ChunkRouter, "forward",
                        lambda self, h, offset=0, shift=None: torch.ones(h.shape[:2], device=h.device))
    out = _train(corpus, tmp_path / "collapsed", log="jsonl")
    rows = ck.read_metrics(out)
    assert rows[1]["health"]["compression"] == 1.0 and rows[1]["health"]["near_threshold"] == 0.0
    warned = rows[1]["warnings"]
    assert any(w.startswith("warning: step 2: training compression 1.00 is -50% off the target R = 2") for w in warned)
    assert any("held-out compression (p >= 0.5) 1.00 is -50%" in w for w in warned)
    assert "warnings" not in rows[3]  # the same event goes on: warned once
    assert capsys.readouterr().err.count("training compression 1.00") == 1


def test_log_flag_and_missing_package(corpus, tmp_path, monkeypatch):
    args = build_parser().parse_args(["train", "--preset", "tiny", "--log", "tensorboard", "--out", str(tmp_path)])
    assert train_config_from_args(args).log == "tensorboard"
    with pytest.raises(UserError, match="--log must be one of"):
        TrainConfig(**TINY, log="wandb")
    assert "log" not in TrainConfig(**TINY).to_dict()  # a plain run's config.json is as before
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(UserError, match=r'pip install -e "\.\[tensorboard\]"'):
        _train(corpus, tmp_path / "no-tb", log="tensorboard")
    assert not (tmp_path / "no-tb").exists()  # refused before anything was written


def test_elastic_run_reports_compression_per_ratio(corpus, tmp_path):
    out = _train(corpus, tmp_path / "elastic", ratios="1.5,3", max_steps=2, log="jsonl")
    h = ck.read_metrics(out)[1]["health"]
    by = h["compression_by_ratio"]
    assert set(by) == {"1.5", "3"} and by["1.5"] < by["3"]  # each row trained towards its own R
    # the per-ratio figures split the interval's boundaries and positions: the total lies between them
    assert min(by.values()) < h["compression"] < max(by.values())


def test_compare_watches_every_run_and_keeps_its_settings(corpus, tmp_path):
    """compare --log passes the watching to each run; it is not a setting of the comparison, so a
    comparison started without it resumes or reruns with it as the same comparison."""
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--data", str(corpus), "--tokens", "256", "--batch-size", "2",
            "--seq-len", "32", "--seeds", "0", "--out", str(out)]
    r = run_cli(*args, "--log", "jsonl", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for label in ("moe", "topk-R2"):
        run = out / label / "seed0"
        assert json.loads((run / "config.json").read_text())["train"]["log"] == "jsonl"
        assert any("mfu" in row for row in ck.read_metrics(run)), label
    assert "log" not in json.loads((out / "compare.json").read_text())
    assert "log" not in (out / "recipe.toml").read_text()
    r = run_cli(*args, timeout=300)  # the same comparison without --log: nothing retrained, no refusal
    assert r.returncode == 0 and "report written" in r.stdout, r.stderr[-2000:]
    r = run_cli(*args, "--log", "wandb", timeout=60)
    assert r.returncode != 0 and "invalid choice: 'wandb'" in r.stderr
