"""The GPU study script (docs/study/gpu/run_gpu_study.py) end to end on the CPU at a tiny budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from training_helpers import make_corpus

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "study" / "gpu" / "run_gpu_study.py"


@pytest.mark.slow
def test_gpu_study_runs_on_cpu_at_a_tiny_budget(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_docs=12, chars=4000)
    out = tmp_path / "study"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--tiny", "--device", "cpu", "--dtype", "fp32",
                        "--data", str(corpus), "--minutes", "1"], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    budget = json.loads((out / "budget.json").read_text())
    assert budget["tokens"] % budget["batch_tokens"] == 0 and budget["tokens"] > 0
    assert budget["tokens_per_s"]["moe"] > 0 and budget["tokens_per_s"]["cm"] > 0
    s = json.loads((out / "summary.json").read_text())
    assert s["gap_bpb"] == pytest.approx(s["conceptmoe"]["val_bpb"] - s["moe"]["val_bpb"])
    assert s["conceptmoe"]["compression"] > 1 and s["latency"]
    assert "| ConceptMoE" in (out / "summary.md").read_text()
