"""Issue 60: installing this package never stops vLLM from serving another model.

vLLM runs every ``vllm.general_plugins`` entry point in every process, for every model, with no
``try``. On a vLLM the plugin was not tested with (forced here with CONCEPTMOE_VLLM_PRETEND_VERSION),
the plugin logs one warning and registers nothing: a Qwen2-MoE export still serves, in the same
environment, token for token; ``conceptmoe serve --engine vllm`` refuses with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from vllm_helpers import complete, need_vllm, plain_vllm_server

need_vllm()

from hf_helpers import concept_run  # noqa: E402

from conceptmoe import load_run  # noqa: E402
from conceptmoe.interop import export_hf  # noqa: E402

PRETEND = {"CONCEPTMOE_VLLM_PRETEND_VERSION": "0.99.0"}


def test_on_another_vllm_the_plugin_registers_nothing():
    code = ("from conceptmoe.vllm_plugin import register, MODEL_CLASS\n"
            "register()\n"
            "from vllm import ModelRegistry\n"
            "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
            "print(MODEL_CLASS in ModelRegistry.get_supported_archs(), hasattr(GPUModelRunner, '_conceptmoe_seeded'))")
    out = lambda env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                     env=dict(os.environ, **env), timeout=300)
    other = out(PRETEND)
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.split() == ["False", "False"]
    assert "supports vLLM 0.32.0" in other.stderr and "other models are served as usual" in other.stderr
    tested = out({})
    assert tested.returncode == 0, tested.stderr[-2000:]
    assert tested.stdout.split() == ["True", "True"]  # on the tested vLLM: registered, the CPU fix applied


def test_another_model_still_serves_and_serve_refuses_with_one_line(tmp_path):
    run = tmp_path / "moe"
    concept_run(run, kind="moe", seq_len=128, d_model=64, n_heads=2, n_kv_heads=2, expert_hidden=32)
    refused = subprocess.run([sys.executable, "-m", "conceptmoe", "serve", str(run), "--engine", "vllm", "--port",
                              "8999"], capture_output=True, text=True, env=dict(os.environ, **PRETEND), timeout=300)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].count("supports vLLM 0.32.0") == 1
    folder = tmp_path / "export"
    export_hf(run, folder)
    model, *_ = load_run(run, "cpu")
    model.eval()
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 20)]
    want = [model.generate(torch.tensor([p]), 8, temperature=0)[0, len(p):].tolist() for p in ps]
    with plain_vllm_server(folder, tmp_path / "vllm.log", "--dtype", "float32", "--max-model-len", "128",
                           "--kv-cache-memory-bytes", str(8 * 2 ** 20), "--enforce-eager", env=PRETEND) as url:
        assert complete(url, ps, 8) == want
    assert "other models are served as usual" in (tmp_path / "vllm.log").read_text()


def test_serve_starts_on_a_used_machine_without_a_kv_size(tmp_path):
    """No --kv-cache-mb: the launcher chooses a KV size from what the machine can give (page cache
    counted as reclaimable) and passes it as bytes, so vLLM's CPU start-up check (92% of the node
    free) never refuses. Here after filling the page cache and while another process holds a
    quarter of the RAM."""
    import psutil

    from vllm_helpers import vllm_server

    run = tmp_path / "moe"
    concept_run(run, kind="moe", seq_len=128, d_model=64, n_heads=2, n_kv_heads=2, expert_hidden=32)
    big = tmp_path / "pages.bin"
    with open(big, "wb") as f:  # 2 GiB written and read back: in the page cache
        for _ in range(64):
            f.write(os.urandom(2 ** 25))
    with open(big, "rb") as f:
        while f.read(2 ** 25):
            pass
    quarter = psutil.virtual_memory().total // 4
    holder = subprocess.Popen([sys.executable, "-c", f"import numpy as np, sys, time; a = np.ones({quarter}, "
                               "dtype=np.uint8); print('held', flush=True); time.sleep(900)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with vllm_server(run, tmp_path / "serve.log", "--vllm-args", "--enforce-eager --max-model-len 128") as url:
            got = complete(url, [[5, 6, 7]], 4)
        assert len(got[0]) == 4
    finally:
        holder.kill()
        big.unlink()
    lines = (tmp_path / "serve.log").read_text().splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith("KV cache: ") and "chosen" in ln]
    vllm = [i for i, ln in enumerate(lines) if "(APIServer" in ln]
    assert said and vllm and said[0] < vllm[0]  # the launcher's first word, before vLLM starts
