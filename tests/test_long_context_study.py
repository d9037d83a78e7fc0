"""The long-context probes of round 3 (docs/study/round3/long_context.py) on a tiny comparison."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from training_helpers import make_corpus, run_cli

STUDY = Path(__file__).resolve().parent.parent / "docs" / "study" / "round3"
sys.path.insert(0, str(STUDY))
import long_context as lc  # noqa: E402


def test_buckets_needles_and_gaps_follow_the_longest_context():
    assert lc.buckets(2048) == [(1, 64), (64, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert lc.needle_lengths(2048) == (512, 1024, 2048)
    assert lc.copy_gaps(2048) == (64, 1024, 1856)
    assert lc.buckets(256) == [(1, 64), (64, 256)]


def test_reading_a_curve_at_a_time():
    curve = [[10.0, 100, 3.0], [20.0, 200, 2.0], [40.0, 400, 1.5]]
    assert lc.at_time(curve, 15.0) == pytest.approx(2.5)
    assert lc.at_time(curve, 30.0) == pytest.approx(1.75)
    assert lc.at_time(curve, 99.0) == 1.5 and lc.at_time(curve, 1.0) == 3.0


def _fig(val: float, early: float, late: float) -> dict:
    return {"val_bpb": val, "position": {"1-64": early, "1024-2048": late}, "needle": {}, "copy": {}}


def test_contrasts_late_minus_early_and_2048_minus_256():
    """Per seed, differences of paired gaps; negative (the ConceptMoE's gap smaller) is 'smaller'."""
    runs = {2048: {s: {"moe": _fig(2.0, 2.0, 2.0), "cm": _fig(1.9 + d, 2.0, 1.8 + d)}
                   for s, d in ((0, 0.0), (1, 0.01), (2, -0.01))},
            256: {s: {"moe": _fig(1.6, 2.0, 2.1), "cm": _fig(1.6, 2.0, 2.1 + d)} for s, d in ((0, 0.0), (1, 0.02))}}
    runs[256][3] = {"moe": _fig(1.6, 2.0, 2.0)}  # an unpaired seed counts nowhere
    c = lc.contrasts(runs, "cm")
    late = c["late - early gap at 2048"]
    assert late["n"] == 3 and late["mean"] == pytest.approx(-0.2) and late["verdict"].startswith("smaller")
    assert c["late - early gap at 256"]["n"] == 2 and c["late - early gap at 256"]["verdict"] == "unresolved"
    across = c["val_bpb gap at 2048 - at 256"]
    assert across["seeds"] == [0, 1] and across["mean"] == pytest.approx(np.mean([-0.1, -0.09]))
    assert c["position 1024-2048 gap at 2048 - at 256"]["mean"] == pytest.approx(np.mean([-0.2, -0.21]))
    assert lc.contrasts({2048: runs[2048]}, "cm").keys() == {"late - early gap at 2048"}
    flipped = {L: {s: {"moe": m["cm"], "cm": m["moe"]} for s, m in by.items() if len(m) == 2} for L, by in runs.items()}
    assert lc.contrasts(flipped, "cm")["late - early gap at 2048"]["verdict"].startswith("larger")


@pytest.mark.slow
def test_long_context_record_of_a_tiny_comparison(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_docs=4, chars=40000)  # held-out tails of ~500 tokens
    comp = tmp_path / "c128"
    r = run_cli("compare", "--preset", "tiny", "--data", str(corpus), "--tokens", "4096", "--seq-len", "128",
                "--batch-size", "2", "--seeds", "0,1", "--out", str(comp), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("bench", "train", "--preset", "tiny", "--seq-lens", "128", "--repeats", "1", "--threads", "1",
                "--dtype", "fp32", "--out", str(tmp_path / "speed"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(STUDY / "long_context.py"), "lc", str(comp), "--doc-tokens", "256",
                        "--record-dir", str(tmp_path), "--speed", str(tmp_path / "speed" / "train.json")],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "lc.json").read_text())
    runs = rec["runs"]["128"]
    assert sorted(runs) == ["0", "1"] and sorted(runs["0"]) == ["moe", "topk-R2"]
    for seed, models in runs.items():
        for label, fig in models.items():
            assert fig["val_bpb"] == json.loads((comp / label / f"seed{seed}" / "eval.json").read_text())["val_bpb"]
            assert sorted(fig["position"]) == ["1-64", "64-256"]
            assert all(0 <= v["acc"] <= 1 and v["nll"] > 0 for v in fig["needle"].values())
            assert sorted(fig["copy"], key=int) == ["64", "128"]
            assert all(v["gain"] == pytest.approx(v["control"] - v["repeat"]) for v in fig["copy"].values())
            times = [t for t, _, _ in fig["wallclock"]]
            assert times == sorted(times) and times[0] > 0
    gaps = rec["gaps"]["128"]
    want = [runs[s]["topk-R2"]["position"]["64-256"] - runs[s]["moe"]["position"]["64-256"] for s in ("0", "1")]
    assert gaps["position 64-256"]["mean"] == pytest.approx(np.mean(want))
    lo, hi = gaps["position 64-256"]["ci95"]
    assert lo < np.mean(want) < hi
    assert "| position 64-256 |" in (tmp_path / "lc.md").read_text()
    wc = rec["wallclock"]["128"]["0"]
    assert wc["at_seconds"] == min(wc["seconds"].values())
    bench = wc["bench"]  # the faster model's whole budget; the slower one read at tokens / speed
    speed = max(bench["speed"], 1 / bench["speed"])
    assert sorted(bench["tokens"].values()) == pytest.approx(sorted([4096 / speed, 4096]))
    assert "equal wall-clock (bench)" in gaps
    # a later machine carries the runs on from the record alone
    r = subprocess.run([sys.executable, str(STUDY / "long_context.py"), "again", "--keep", str(tmp_path / "lc.json"),
                        "--record-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["runs"] == rec["runs"] and again["gaps"] == rec["gaps"]
    assert again["contrasts"] == rec["contrasts"] and "late - early gap at 128" not in rec["contrasts"]


@pytest.mark.slow
def test_position_buckets_add_up_to_the_documents_bpb(tmp_path):
    """Bytes-weighted over the buckets, the position figures are the BPB of the documents scored
    in the run's windows, as the training loop's validation scores them (training/validation.py)."""
    from conceptmoe.training.checkpoint import load_run
    from conceptmoe.data.tokenizer import byte_lengths
    from conceptmoe.training.validation import evaluate_tokens

    corpus = make_corpus(tmp_path / "corpus", n_docs=2, chars=8000)
    run = tmp_path / "run"
    r = run_cli("train", "--preset", "tiny", "--data", str(corpus), "--tokens", "1024", "--seq-len", "64",
                "--batch-size", "2", "--out", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    model, cfg, tok, _ = load_run(run, "cpu")
    byte_len = byte_lengths(tok, cfg.vocab_size)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab_size, 256) for _ in range(3)]
    pos = lc.position_bpb(model, docs, 64, byte_len, 256)
    nll = nbytes = 0.0
    for d in docs:
        v = evaluate_tokens(model, d, byte_len, 64)
        b = float(byte_len[d[1:]].sum())
        nll += v["val_bpb"] * b
        nbytes += b
    total = {k: 0.0 for k in ("nll", "bytes")}
    for (lo, hi), bpb in zip(lc.buckets(256), pos.values()):
        b = float(sum(byte_len[d[lo:hi]].sum() for d in docs))
        total["nll"] += bpb * b
        total["bytes"] += b
    assert math.isclose(total["nll"] / total["bytes"], nll / nbytes, rel_tol=1e-6)
