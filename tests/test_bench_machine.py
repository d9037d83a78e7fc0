"""`bench peak` on a machine where bf16 is emulated (issue 41: machines differ): the work fits a
time budget, progress shows, the table's columns stay apart and say the dtype is emulated, and
every benchmark's JSON names the machine (CPU model and flags)."""

import json
from types import SimpleNamespace

import pytest
import torch

from conceptmoe.bench import peak
from conceptmoe.cli import main
from conceptmoe.device import BF16_ENV, machine


@pytest.fixture
def slow_bf16(monkeypatch):
    """A clock only the timed products advance: fp32 at 50 GFLOP/s, bf16 emulated at 0.14
    (a 2048² product: 122 s, as measured on an AVX512 CPU without AVX512-BF16)."""
    rate = {torch.float32: 50e9, torch.bfloat16: 0.14e9}
    clock = [0.0]
    monkeypatch.setattr(peak, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def mm(a, b, out=None):
        clock[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate[a.dtype]
        return out
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setenv(BF16_ENV, "0")
    return clock


def test_peak_fits_its_budget_and_says_bf16_is_emulated(slow_bf16, tmp_path, capsys):
    assert main(["bench", "peak", "--budget", "20", "--min-time", "0.3", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert slow_bf16[0] < 20 * 1.3  # without the budget: > 500 s of products
    out, err = capsys.readouterr()
    assert "bench peak" in err  # the progress bar
    res = json.loads((tmp_path / "peak.json").read_text())
    assert res["emulated"] == ["bf16"] and res["machine"] == machine() and res["machine"]["cpu_model"]
    cut = [r for r in res["rows"] if "rows_cut_from" in r]
    assert cut and all(r["dtype"] == "bf16" and r["M"] < r["rows_cut_from"] for r in cut)
    for r in res["rows"]:  # the rates still read back right on the rows timed
        assert r["gflops"] == pytest.approx(50.0 if r["dtype"] == "fp32" else 0.14, rel=1e-6)
    lines = out.splitlines()
    assert any(ln.startswith("bf16: emulated on this CPU") for ln in lines)
    rows = [ln for ln in lines if ln.startswith(("fp32 ", "bf16 "))]
    assert len(rows) == len(res["rows"])
    for ln, r in zip(rows, res["rows"]):  # columns apart: every field reads back
        cells = ln.split("(rows cut")[0].split()
        assert int(cells[-5]) == r["M"] and int(cells[-3]) == r["N"] and float(cells[-2]) == pytest.approx(
            r["gflops"], rel=1e-2), ln
    assert "bf16/fp32 0.0028x" in lines[-2] or "bf16/fp32 0.0028x" in lines[-1]


def test_peak_with_hardware_bf16_is_not_called_emulated(monkeypatch):
    monkeypatch.setenv(BF16_ENV, "1")
    res = peak.measure_peak(("bf16",), "tiny", 16, square=(), min_time=0.001, budget=5)
    assert res["emulated"] == [] and res["machine"]["cpu_bf16"] == f"{BF16_ENV}=1"


def test_latency_peak_times_only_the_presets_shapes(monkeypatch, tmp_path, capsys):
    assert peak.squares_for("tiny") == () and peak.squares_for("small") == peak.SQUARE
    from conceptmoe.bench import latency

    seen = []
    real = latency.measure_peak

    def spy(*args, **kw):
        seen.append(kw.get("square"))
        return real(*args, **{**kw, "budget": 2})
    monkeypatch.setattr(latency, "measure_peak", spy)
    assert main(["bench", "latency", "--preset", "tiny", "--prefill-lens", "16", "--kv-lens", "none", "--repeats", "1",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert seen == [()]
    res = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert res["machine"]["cpu_model"] and "cpu_flags" in res["machine"]
