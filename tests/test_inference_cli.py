"""`conceptmoe generate`, `conceptmoe bench latency` (tiny sizes) and the router calibration."""

import json

import pytest
import torch
from safetensors.torch import save_model

from conceptmoe import ModelConfig, build_model
from conceptmoe.training import checkpoint as ck
from conceptmoe.cli import main
from conceptmoe.inference.text import MARK, render
from conceptmoe.bench.calibrate import calibrate_router
from conceptmoe.data.tokenizer import save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `conceptmoe train` writes it: config.json, weights, tokenizer."""
    out = tmp_path_factory.mktemp("run")
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    save_model(build_model(cfg), str(out / "model.safetensors"))
    save_tokenizer(train_tokenizer(["To be, or not to be, that is the question."], 256),
                   out / "tokenizer.json")
    ck.write_json(out / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION,
                                        "model": cfg.to_dict(), "train": {}})
    return out


def test_generate_streams_text_and_marks_concepts(run_dir, capsys):
    args = ["generate", str(run_dir), "--prompt", "To be", "--max-new-tokens", "12", "--seed", "0",
            "--device", "cpu"]
    assert main(args + ["--show-concepts"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(MARK + "T")  # the first token always starts a concept
    assert "12 tokens" in err and "concepts over 17 tokens" in err  # 5 prompt bytes + 12 new
    assert main(args) == 0
    plain, err2 = capsys.readouterr()
    assert plain.startswith("To be") and "12 tokens" in err2


def test_render_marks_concept_starts(run_dir):
    tok = ck.load_run(run_dir, "cpu")[2]
    ids = tok.encode("abcd").ids
    assert render(tok, ids, {0, 2}, True) == f"{MARK}ab{MARK}cd"
    assert render(tok, ids, {0, 2}, False) == "abcd"


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-p", "1.5"], "--top-p"),
    (["--prompt", ""], "no tokens"),
])
def test_generate_bad_input_is_one_line_error(run_dir, capsys, extra, message):
    args = ["generate", str(run_dir), "--prompt", "To be", "--device", "cpu"] + extra
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_generate_missing_run(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_calibrated_router_hits_the_ratio_exactly():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny", compression_ratio=1.5)).eval()
    ids = torch.randint(0, 256, (2, 300))
    h = model.encode(ids)[0]
    n = 2 * (round(300 / 1.5) - 1)
    calibrate_router(model, h[:, 1:].flatten(0, 1), h[:, :-1].flatten(0, 1), n)
    out = model(ids)
    assert int(out.boundaries.sum()) == 2 * round(300 / 1.5)


def test_bench_latency_tiny(tmp_path, capsys):
    out_dir = tmp_path / "lat"
    args = ["bench", "latency", "--preset", "tiny", "--prefill-lens", "64,96", "--kv-lens", "48",
            "--batch", "3", "--repeats", "1", "--decode-steps", "4", "--strategies", "topk,layers",
            "--ratios", "2", "--threads", "1", "--out", str(out_dir)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "prefill" in table and "decode" in table and "KV cache vs MoE" in table
    result = json.loads((out_dir / "latency.json").read_text())
    assert (out_dir / "latency.png").stat().st_size > 10_000
    names = [m["name"] for m in result["models"]]
    assert len(names) == 3 and names[0].startswith("MoE")
    for row in result["prefill"] + result["decode"]:
        assert row["median_s"] > 0
        assert abs(row["compression"] / row["target_compression"] - 1) <= 0.10  # compresses at R
        if row["model"] == names[0]:
            assert row["speedup_pct"] == 0
        assert row["kv_bytes"] == pytest.approx(row["kv_bytes_analytic"], rel=0.05)
    for c in result["kv_check"]:
        assert abs(c["rel_error"]) <= 0.05
    assert {r["tokens"] for r in result["prefill"]} == {64, 96}


def test_bench_latency_rejects_bad_lengths(tmp_path, capsys):
    assert main(["bench", "latency", "--preset", "tiny", "--prefill-lens", "none", "--kv-lens", "none",
                 "--out", str(tmp_path)]) == 2
    assert "nothing to do" in capsys.readouterr().err


def test_bench_moe_without_transformers_is_one_line_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    assert main(["bench", "moe", "--preset", "tiny"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "transformers" in err and err.count("\n") == 1
    assert out == ""
