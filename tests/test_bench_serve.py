"""``conceptmoe bench serve``: the same requests to each run's own server, figures side by side."""

from __future__ import annotations

import json

import pytest
from hf_helpers import concept_run

from conceptmoe.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-serve")
    concept_run(root / "moe", seed=1, kind="moe", seq_len=64)
    concept_run(root / "elastic", seed=2, seq_len=64, elastic_ratios=[1.5, 2.0, 3.0], ratio_embedding="router+concept")
    return root


def test_bench_serve_reports_runs_side_by_side(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    code = main(["bench", "serve", str(runs / "moe"), str(runs / "elastic"), "--requests", "6", "--prompt-len", "8",
                 "--output-len", "6", "--len-spread", "0.5", "--kv-cache-mb", "0.05", "--max-batch", "4",
                 "--concept-ratios", "1.5,3", "--threads", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "serve.json").read_text())  # strict JSON: Infinity would not parse back as such
    rows = report["rows"]
    assert [r["label"] for r in rows] == ["moe", "elastic R=1.5", "elastic R=3"]
    assert len({r["output_tokens"] for r in rows}) == 1  # EOS ignored: every run makes the same tokens
    for r in rows:
        assert r["requests"] == 6 and 1 <= r["peak_concurrent"] <= 4 and r["output_tokens_per_s"] > 0
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["kv_bytes_per_token"] > 0
        assert 0 < r["peak_kv_ledger_bytes"] <= r["kv_budget_bytes"] and r["peak_kv_tensor_bytes"] > 0
        assert r["peak_rss_bytes"] is None or r["peak_rss_bytes"] > r["peak_kv_tensor_bytes"]
    assert rows[0]["compression"] == 1.0 and rows[2]["compression"] > rows[1]["compression"] > 1
    assert rows[2]["kv_bytes_per_token"] < rows[1]["kv_bytes_per_token"] < rows[0]["kv_bytes_per_token"]
    assert report["machine"]["cpu_flags"] is not None and "| elastic R=3 |" in (out / "serve.md").read_text()


def test_bench_serve_refusals(runs, tmp_path, capsys):
    assert main(["bench", "serve", str(runs / "moe"), "--concept-ratios", "2,2", "--out", str(tmp_path)]) == 2
    assert "twice" in capsys.readouterr().err
    assert main(["bench", "serve", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    for bad, why in (("0", "--repeats must be >= 1"), ("3", "--repeats applies to --engine vllm")):
        assert main(["bench", "serve", str(runs / "moe"), "--repeats", bad, "--out", str(tmp_path)]) == 2
        assert why in capsys.readouterr().err


def test_vllm_bench_reports_the_median_repeat():
    """Repeats on one server: the row is the median repeat's (its figures together), all repeats listed."""
    from conceptmoe.bench import vllm_serve

    row = vllm_serve.median_repeat([{
        "label": "x", "output_tokens_per_s": v, "mean_concurrent": v / 10, "peak_concurrent": 4,
        "preemptions": 0.0, "seconds": 1.0, "request_throughput": 1.0, "ttft_s": {"mean": 0.1, "p50": 0.1, "p99": 0.1},
        "tpot_s": {"mean": None, "p50": None, "p99": None}, "kv_cache_tokens": 5} for v in (300.0, 100.0, 200.0)])
    assert row["output_tokens_per_s"] == 200.0 and row["mean_concurrent"] == 20.0
    assert [r["output_tokens_per_s"] for r in row["repeats"]] == [300.0, 100.0, 200.0]
    report = {"rows": [row], "settings": {"repeats": 3, "kv_cache_mb": 1, "dtype": "fp32"},
              "machine": {"cpu_model": "c", "cpu_count": 2, "cpu_flags": [], "cpu_bf16": None}}
    assert "| 200.0 (100–300) |" in vllm_serve.format_table(report) and "median of 3" in vllm_serve.format_table(report)


def test_a_metric_is_read_from_its_own_lines_only():
    """``_metric`` sums one metric over its labels: not its HELP/TYPE lines, not a longer name
    that starts with it."""
    from conceptmoe.bench.vllm_serve import _metric

    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="cm"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="cm"} 2.0',
        'vllm:num_requests_running_max{engine="0"} 40.0',
        "vllm:num_preemptions_total 7.0",
    ])

    class Http:
        def get(self, url, timeout):
            assert url == "http://x/metrics"
            return type("R", (), {"text": text})()

    assert _metric("http://x", "vllm:num_requests_running", Http()) == 5.0
    assert _metric("http://x", "vllm:num_preemptions_total", Http()) == 7.0
    assert _metric("http://x", "vllm:absent", Http()) == 0.0
