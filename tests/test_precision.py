"""bf16 on CPUs that multiply it fast: the default-precision detection, `bench peak`, and
`bench train` / `bench latency` / `train` under --dtype (tiny sizes; timings are not asserted)."""

import json
import platform
from pathlib import Path

import pytest
import torch

from conceptmoe import device
from conceptmoe.bench.train import precision
from conceptmoe.cli import main
from conceptmoe.model.config import ModelConfig
from conceptmoe.model.flops import count_flops
from conceptmoe.model.lm import build_model

CPU = torch.device("cpu")


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has these /proc/cpuinfo flags (detection not overridden by the env)."""
    monkeypatch.delenv(device.BF16_ENV, raising=False)

    def set_flags(*names):
        monkeypatch.setattr(device, "_cpu_flags", lambda: frozenset(names))
    return set_flags


def test_default_dtype_follows_the_cpu(flags, monkeypatch):
    flags("fpu", "avx2", "amx_tile", "amx_bf16")
    assert device.cpu_bf16_feature() == "amx_bf16" and device.default_dtype(CPU) == "bf16"
    assert "amx_bf16" in device.dtype_note(CPU, "bf16", None)
    flags("avx512f", "avx512_bf16")
    assert device.default_dtype(CPU) == "bf16"
    flags("avx2", "avx512f", "amx_tile")  # AMX tiles without the bf16 instructions: not enough
    assert device.cpu_bf16_feature() is None and device.default_dtype(CPU) == "fp32"
    assert "no AMX-BF16" in device.dtype_note(CPU, "fp32", None)
    assert device.default_dtype(torch.device("cuda")) == "bf16"
    assert device.dtype_note(CPU, "fp32", "fp32") == "precision: fp32 (--dtype fp32)"
    monkeypatch.setenv(device.BF16_ENV, "1")
    assert device.default_dtype(CPU) == "bf16"
    flags("amx_bf16")
    monkeypatch.setenv(device.BF16_ENV, "0")  # hidden (what the test suite does)
    assert device.default_dtype(CPU) == "fp32"


def test_cpuinfo_is_read():
    """On Linux the flags come from /proc/cpuinfo (a real file, parsed into words)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo here (not Linux)")
    lines = [ln for ln in cpuinfo.read_text().splitlines() if ln.startswith(("flags", "Features"))]
    assert lines, "/proc/cpuinfo lists no flags"
    listed = set(lines[0].split(":", 1)[1].split())
    flags = device._cpu_flags()
    assert listed and listed <= flags, sorted(listed - flags)[:10]
    if platform.machine() in ("x86_64", "AMD64", "i686"):
        assert "fpu" in flags and ("avx2" in flags) == ("avx2" in listed)


def test_bench_peak_json(tmp_path, capsys, monkeypatch):
    # A machine whose matmuls run at a known rate: a clock that only the timed product advances,
    # by 2·M·K·N / rate (50 GFLOP/s in fp32, 400 in bf16). The report must read those rates back
    # for every shape (not a rate re-derived from its own seconds), and each dtype's peak its own.
    from types import SimpleNamespace

    from conceptmoe.bench import peak

    rate = {torch.float32: 50e9, torch.bfloat16: 400e9}
    clock = [0.0]
    monkeypatch.setattr(peak, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def mm(a, b, out=None):  # no arithmetic: the product's time is the clock's
        clock[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate[a.dtype]
        return out
    monkeypatch.setattr(torch, "mm", mm)
    assert main(["bench", "peak", "--preset", "tiny", "--tokens", "64", "--min-time", "0.001", "--threads", "1",
                 "--json", "--out", str(tmp_path)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res == json.loads((tmp_path / "peak.json").read_text())
    assert res["threads"] == 1 and res["peak_gflops"] == pytest.approx({"fp32": 50.0, "bf16": 400.0}, rel=1e-6)
    for dt, want in (("fp32", 50.0), ("bf16", 400.0)):
        rows = [r for r in res["rows"] if r["dtype"] == dt]
        assert [r["shape"] for r in rows][:2] == ["square 1024", "square 2048"] and len(rows) >= 6
        for r in rows:
            assert r["gflops"] == pytest.approx(want, rel=1e-6), r  # a float clock: sums round
            assert r["seconds"] == pytest.approx(2 * r["M"] * r["K"] * r["N"] / (want * 1e9), rel=1e-6), r
    assert main(["bench", "peak", "--threads", "-1"]) == 2
    assert main(["bench", "peak", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def _peak_file(tmp_path, fp32=100.0, bf16=800.0):
    path = tmp_path / "peak.json"
    path.write_text(json.dumps({"peak_gflops": {"fp32": fp32, "bf16": bf16}}))
    return str(path)


def test_bench_train_dtypes_side_by_side_with_mfu(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "train", "--preset", "tiny", "--seq-lens", "32", "--tokens", "64", "--repeats", "1",
                 "--dtype", "fp32,bf16", "--peak", _peak_file(tmp_path), "--profile", "6", "--out", str(out)]) == 0
    res = json.loads((out / "train.json").read_text())
    assert [(r["model"], r["dtype"]) for r in res["rows"]] == [
        ("MoE", "fp32"), ("topk-R2", "fp32"), ("MoE", "bf16"), ("topk-R2", "bf16")]
    assert res["peak_gflops"] == {"fp32": 100.0, "bf16": 800.0}
    cfgs = {"MoE": ModelConfig.from_preset("tiny", kind="moe")}
    tps = {(r["model"], r["dtype"]): r["tokens_per_s"] for r in res["rows"]}
    for r in res["rows"]:
        peak = res["peak_gflops"][r["dtype"]]
        if r["model"] == "MoE":  # forward FLOPs: activated linear layers + attention maps, per token
            f = count_flops(cfgs["MoE"], 32)
            assert r["forward_flops"] == (f["activated_flops_per_token"] + f["attention_map_flops_per_token"]) * 64
        assert r["forward_mfu"] == pytest.approx(r["forward_flops"] / r["forward_s"] / 1e9 / peak)
        assert r["backward_mfu"] == pytest.approx(2 * r["forward_flops"] / r["backward_s"] / 1e9 / peak)
        assert r["vs_fp32"] == pytest.approx(r["tokens_per_s"] / tps[r["model"], "fp32"])
        assert r["ratio_vs_moe"] == pytest.approx(r["tokens_per_s"] / tps["MoE", r["dtype"]])
    assert sorted(res["profile"]) == ["MoE@32 bf16", "MoE@32 fp32", "topk-R2@32 bf16", "topk-R2@32 fp32"]
    text = capsys.readouterr().out
    assert "bwd MFU" in text and "topk-R2@32 bf16 forward:" in text
    assert main(["bench", "train", "--preset", "tiny", "--dtype", "fp16"]) == 2
    assert main(["bench", "train", "--preset", "tiny", "--dtype", ","]) == 2
    assert main(["bench", "train", "--preset", "tiny", "--peak", str(tmp_path / "missing.json")]) == 2
    assert "--peak" in capsys.readouterr().err


def test_bench_train_default_dtype_follows_the_cpu(tmp_path, flags):
    flags("amx_bf16")
    assert main(["bench", "train", "--preset", "tiny", "--seq-lens", "32", "--tokens", "32", "--repeats", "1",
                 "--strategies", "topk", "--peak", _peak_file(tmp_path), "--out", str(tmp_path)]) == 0
    assert {r["dtype"] for r in json.loads((tmp_path / "train.json").read_text())["rows"]} == {"bf16"}


def test_bf16_step_computes_in_bf16():
    """The timed step runs the model's matmuls in bf16 (the loss stays fp32)."""
    m = build_model(ModelConfig.from_preset("tiny")).train()
    x = torch.randint(0, 256, (2, 16))
    with precision("bf16"):
        out = m(x, labels=x)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    with precision("fp32"):
        assert m(x).logits.dtype == torch.float32


def test_bench_latency_bf16_caches_and_mfu(tmp_path, capsys):
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--preset", "tiny", "--prefill-lens", "64", "--kv-lens", "48", "--batch", "2",
                 "--repeats", "1", "--decode-steps", "2", "--strategies", "topk", "--threads", "1", "--dtype", "bf16",
                 "--peak", _peak_file(tmp_path), "--out", str(out)]) == 0
    res = json.loads((out / "latency.json").read_text())
    assert res["dtype"] == "bf16" and res["settings"]["dtype"] == "bfloat16" and res["peak_gflops"] == 800.0
    cfg = ModelConfig.from_preset("tiny", kind="moe")
    moe = res["prefill"][0]
    # bf16 caches: 2 bytes per element, K and V of every layer
    assert moe["kv_bytes"] == 2 * 2 * cfg.n_kv_heads * cfg.head_dim * cfg.n_layers * 64
    for r in res["prefill"] + res["decode"]:
        assert r["mfu"] == pytest.approx(r["flops"] / r["median_s"] / 1e9 / 800.0) and r["flops"] > 0
    assert "MFU" in capsys.readouterr().out


def test_train_default_precision_is_printed_and_used(tmp_path, monkeypatch, capsys):
    from conceptmoe.training import loop
    from conceptmoe.training.train import TrainConfig, train
    from training_helpers import TINY, make_corpus

    seen = []
    real = loop.forward_backward

    def spy(lp, batch, u):
        seen.append(lp.dtype)
        return real(lp, batch, u)

    monkeypatch.setattr(loop, "forward_backward", spy)
    monkeypatch.setenv(device.BF16_ENV, "1")
    corpus = make_corpus(tmp_path / "corpus", n_docs=2, chars=3000)
    tc = TrainConfig(**{**TINY, "progress": True}, data=str(corpus), out=str(tmp_path / "run"), max_steps=2)
    train(tc)
    assert seen == ["bf16", "bf16"]
    assert "precision: bf16 (detected CONCEPTMOE_CPU_BF16=1" in capsys.readouterr().err
    seen.clear()
    train(TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "run32"), max_steps=1, dtype="fp32"))
    assert seen == ["fp32"]


def test_compile_flag_compiles_every_block(tmp_path, monkeypatch):
    """--compile reaches torch.compile for every block (bench train) and for the dense modules of
    every block (bench latency); compiling itself is too slow for a unit test, so it is recorded."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    assert main(["bench", "train", "--preset", "tiny", "--seq-lens", "16", "--tokens", "32", "--repeats", "1",
                 "--dtype", "fp32", "--compile", "--peak", _peak_file(tmp_path), "--out", str(tmp_path)]) == 0
    cfg = ModelConfig.from_preset("tiny")
    n_blocks = cfg.n_layers + cfg.n_layers  # the MoE's blocks and the matched ConceptMoE's (1 + 2 + 1)
    assert compiled == [("Block", {"dynamic": True})] * n_blocks
    assert json.loads((tmp_path / "train.json").read_text())["compile"] is True
    compiled.clear()
    assert main(["bench", "latency", "--preset", "tiny", "--prefill-lens", "32", "--kv-lens", "none", "--repeats", "1",
                 "--strategies", "topk", "--dtype", "fp32", "--compile", "--peak", _peak_file(tmp_path),
                 "--out", str(tmp_path / "lat")]) == 0
    names = [n for n, _ in compiled]
    assert names.count("RMSNorm") == 2 * n_blocks + 2 and names.count("SwiGLU") == n_blocks
