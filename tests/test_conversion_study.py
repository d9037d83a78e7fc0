"""Round 3's conversion table (docs/study/round3/conversion.py) from per-seed `compare --init` records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parent.parent / "docs" / "study" / "round3"


def _ct(path: Path, seed: int, moe: float, r15: float, r2: float) -> Path:
    def model(label, bpb, ratio, flops):
        return {"label": label, "name": label, "seeds": [seed], "val_bpb": bpb, "ratio": ratio,
                "activated_flops_per_token": flops, "compression": ratio}
    rep = {"init": f"runs/pre-s{seed}", "settings": {"seed": seed, "tokens": 1200000},
           "models": [model("moe", moe, 1.0, 10.0), model("R1.5-loop2", r15, 1.5, 12.0),
                      model("R2-topk", r2, 2.0, 10.0)]}
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps(rep))
    return path


def test_conversion_table_pairs_each_seed_with_its_own_continued_moe(tmp_path):
    cts = [_ct(tmp_path / f"ct{s}", s, 1.60 + s / 100, 1.62 + s / 100 + e, 1.65 + s / 100)
           for s, e in ((0, 0.0), (1, 0.002), (2, -0.002))]
    scratch = []
    for seed, full, part in ((1, 1.45, 1.55), (2, 1.46, 1.57)):
        run = tmp_path / f"scratch{seed}"
        run.mkdir()
        (run / "eval.json").write_text(json.dumps({"val_bpb": full}))  # the whole held-out split
        (run / "eval-slice-32768.json").write_text(json.dumps({"val_bpb": part}))  # the conversions' slice
        (run / "config.json").write_text(json.dumps({"name": "cm", "train": {"seed": seed, "tokens": 3600000}}))
        scratch.append(str(run))
    r = subprocess.run([sys.executable, str(STUDY / "conversion.py"), "conv", *map(str, cts), "--scratch",
                        *scratch, "--record-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "conv.json").read_text())
    assert rec["seeds"] == [0, 1, 2] and [row["label"] for row in rec["rows"]] == ["R1.5-loop2", "R2-topk"]
    loop, topk = rec["rows"]
    assert loop["gaps"] == pytest.approx([0.02, 0.022, 0.018]) and loop["mean"] == pytest.approx(0.02)
    assert loop["verdict"] == "MoE ahead" and loop["flops_vs_moe"] == pytest.approx(1.2)
    assert topk["gaps"] == pytest.approx([0.05] * 3)
    sc = rec["scratch"]
    assert sc["bpb"] == {"1": 1.55, "2": 1.57} and sc["bpb_heldout"] == {"1": 1.45, "2": 1.46}
    assert sc["vs_continued_moe"]["gaps"] == pytest.approx([1.55 - 1.61, 1.57 - 1.62])
    assert "| R1.5-loop2 | 3 | 1.20x |" in (tmp_path / "conv.md").read_text()
    twice = subprocess.run([sys.executable, str(STUDY / "conversion.py"), "x", str(cts[0]), str(cts[0]),
                            "--record-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert twice.returncode != 0 and "a seed given twice" in twice.stderr
