"""Issue 59: the long-prompt sweep of ``bench serve --engine vllm --prompt-lens`` without servers: its
loads, the pair's analytic limits, the table and the plot; its refusals (``bench/vllm_long.py``)."""

from __future__ import annotations

import pytest

from conceptmoe.bench.serve import ServeBenchSettings
from conceptmoe.bench.vllm_long import analytic, format_long_table, loads, plot
from conceptmoe.model.config import ModelConfig
from training_helpers import run_cli


def test_every_length_gets_the_same_prompt_tokens():
    s = ServeBenchSettings(runs=["a", "b"], requests=4)
    assert loads(s, [1024, 2048, 4096, 8192]) == {1024: 32, 2048: 16, 4096: 8, 8192: 4}


def test_analytic_limits_of_the_default_pair():
    moe = ModelConfig.from_preset("small", kind="moe")
    cm = ModelConfig.from_preset("small")  # 2 + 4 + 2 layers
    short, long = analytic(moe, cm, 256, 2.0), analytic(moe, cm, 8192, 2.0)
    assert long["kv"] == pytest.approx(1 / 0.75)  # half the layers at concept rate, R = 2
    assert long["prefill"] > short["prefill"] > 0  # attention grows with L; the concept layers' share of it falls by R²
    assert long["decode"] > short["decode"]
    assert analytic(moe, cm, 8192, 4.0)["kv"] > long["kv"]  # a higher realised R: fewer concepts kept


def report(rows):
    machine = {"cpu_model": "x", "cpu_count": 2, "cpu_flags": ["avx2"]}
    return {"rows": rows, "machine": machine, "settings": {"kv_cache_mb": 64, "unbound_kv_cache_mb": None,
                                                           "dtype": "fp32", "repeats": 3}}


def row(L, ttft_m, ttft_c):
    side = lambda ttft, tok: {"ttft_s": ttft, "tpot_s": 0.02, "bound": {"output_tokens_per_s": tok,  # noqa: E731
                                                                     "mean_concurrent": 3.0}}
    return {"prompt_len": L, "realised_R": 2.1, "analytic": {"prefill": 1.3, "decode": 1.2, "kv": 1.33},
            "moe": side(ttft_m, 100.0), "conceptmoe": side(ttft_c, 130.0)}


def test_table_and_plot(tmp_path):
    r = report([row(1024, 1.0, 0.8), row(4096, 5.0, 3.0)])
    table = format_long_table(r)
    assert "| 4096 | 2.10 | 5.00 / 3.00 | 1.67x (1.30x) |" in table
    assert "1.30x (1.33x)" in table  # output tok/s ratio beside the KV limit
    plot(r, tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 1000


def test_refusals(tmp_path):
    r = run_cli("bench", "serve", "a", "b", "--prompt-lens", "1024", "--out", str(tmp_path))
    assert r.returncode != 0 and "apply to --engine vllm" in r.stderr.strip().splitlines()[-1]
    r = run_cli("bench", "serve", "a", "b", "--prompt-lens", "10,x", "--out", str(tmp_path))
    assert r.returncode != 0 and "token counts" in r.stderr
