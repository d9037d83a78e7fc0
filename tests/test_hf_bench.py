"""Our MoE block and MoE model equal the Hugging Face implementations at copied weights."""

import json
import pytest

pytest.importorskip("transformers")

from conceptmoe.cli import main  # noqa: E402
from conceptmoe.bench.moe import ARCHS, compare  # noqa: E402


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_match_transformers(arch):
    results = compare(arch, preset="tiny", n_layers=2, batch=2, seq_len=24, repeats=1)
    assert [r.part for r in results] == ["moe_block", "model"]
    for r in results:
        assert r.max_abs_diff < 1e-4
        assert r.ours_fwd_s > 0 and r.hf_fwdbwd_s > 0


def test_bench_moe_cli(tmp_path, capsys):
    assert main(["bench", "moe", "--arch", "qwen2_moe", "--preset", "tiny", "--seq-len", "16",
                 "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert "qwen2_moe" in capsys.readouterr().out
    doc = json.loads((tmp_path / "moe_bench.json").read_text())
    assert doc["machine"]["cpu_model"] and "cpu_bf16" in doc["machine"] and doc["threads"] == 1
    assert {r["arch"] for r in doc["rows"]} == {"qwen2_moe"} and {r["part"] for r in doc["rows"]} == {"moe_block", "model"}
    assert main(["bench", "moe", "--arch", "mixtral"]) == 2
