"""`conceptmoe bench train`: the table and train.json (tiny sizes; timings are not asserted)."""

import json

import torch

from conceptmoe.bench.train import run_train_bench
from conceptmoe.cli import main


def test_bench_train_rows_and_json(tmp_path, capsys):
    assert main(["bench", "train", "--preset", "tiny", "--seq-lens", "16,32", "--tokens", "64", "--repeats", "1",
                 "--strategies", "topk,loop", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "train.json").read_text())
    assert res["device"] == "cpu"
    assert [(r["model"], r["seq_len"]) for r in res["rows"]] == [
        (m, t) for t in (16, 32) for m in ("MoE", "topk-R2", "loop-R2")]
    for r in res["rows"]:
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["batch"] * r["seq_len"] == 64
        if r["model"] == "MoE":
            assert r["ratio_vs_moe"] == 1.0 and r["compression"] == 1.0
        else:  # timed at exactly round(T / R) boundaries per row
            assert r["compression"] == r["seq_len"] / round(r["seq_len"] / 2)
    assert "vs MoE" in capsys.readouterr().out


def test_bench_train_matched_models():
    res = run_train_bench("tiny", (1.5,), ("layers",), (16,), 32, 1)
    assert res["models"]["layers-R1.5"].startswith("ConceptMoE-")


def test_bench_train_profile_forward_and_backward(tmp_path, capsys):
    assert main(["bench", "train", "--preset", "tiny", "--seq-lens", "32", "--tokens", "64", "--repeats", "1",
                 "--profile", "40", "--out", str(tmp_path)]) == 0
    prof = json.loads((tmp_path / "train.json").read_text())["profile"]
    assert sorted(prof) == ["MoE@32", "topk-R2@32"]
    for phases in prof.values():
        assert sorted(phases) == ["backward", "forward"]
        for ops in phases.values():
            assert 4 <= len(ops) <= 40 and all(o["op"] and o["self_ms"] >= 0 and o["calls"] >= 1 for o in ops)
            shares = [o["share"] for o in ops]
            assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    # The backward of the MoE runs the attention backward kernel; its forward does not.
    assert any("backward" in o["op"].lower() for o in prof["MoE@32"]["backward"])
    assert not any("backward" in o["op"].lower() for o in prof["MoE@32"]["forward"])
    assert "MoE@32 forward:" in capsys.readouterr().out
    assert main(["bench", "train", "--preset", "tiny", "--profile", "-1"]) == 2
    assert main(["bench", "train", "--preset", "tiny", "--concept-bucket", "0"]) == 2


def test_bench_train_device(capsys):
    """--device: a bad name, or CUDA where there is none, is one line and exit 2 (the GPU study
    passes --device cuda; its timing on CUDA synchronises around each phase)."""
    import torch

    assert main(["bench", "train", "--preset", "tiny", "--device", "tpu"]) == 2
    assert "--device must be" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "train", "--preset", "tiny", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_bench_train_router_draws_fresh_noise_every_step(monkeypatch):
    """--router: the untrained router with new boundary noise each step (C changes as in training)."""
    import conceptmoe.bench.train as bt

    seen, step = [], bt._step

    def record(model, x, u, dtype="fp32"):
        if model.cfg.is_concept:
            seen.append(u.clone())
        return step(model, x, u, dtype)
    monkeypatch.setattr(bt, "_step", record)
    res = run_train_bench("tiny", (2.0,), ("topk",), (32,), 128, 3, exact=False, peak={"fp32": 1.0},
                          concept_bucket=8)
    assert res["concept_bucket"] == 8
    assert len(seen) == 4 and seen[0].dtype == torch.float32  # warm-up + 3 repeats, noise uniforms
    assert all(not torch.equal(seen[i], seen[i + 1]) for i in range(1, 3))
    assert res["rows"][1]["compression"] > 1.0
