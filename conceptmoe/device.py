"""Which device a command runs on (``--device auto|cpu|cuda[:N]``) and its default precision (bf16
where the hardware multiplies bf16 fast: CUDA, AMX-BF16 / AVX512-BF16 CPUs). Shared by every part
of the package, like ``errors``."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from .errors import UserError


def resolve_device(name: str | None) -> torch.device:
    """``auto`` picks CUDA when available; asking for CUDA without it is a UserError."""
    name = name or "auto"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"--device must be auto, cpu or cuda (got {name!r})")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda requested but CUDA is not available")
    return torch.device(name)


# CPU features under which oneDNN runs bf16 matmuls in hardware (AMX tiles, AVX512-BF16 dot products).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_ENV = "CONCEPTMOE_CPU_BF16"  # "0" / "1": override the detection (tests pin it to "0")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = {w for line in text.splitlines() if line.startswith(("flags", "Features")) for w in line.split()}
    if not flags:  # not Linux: ask torch (a private helper; absent on some builds)
        try:
            flags = {k for k, v in torch._C._cpu._get_cpu_capability().items() if v is True}
        except AttributeError:
            pass
    return frozenset(flags)


# The CPU flags a benchmark records: the vector and matrix units its matmuls may use.
SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "bf16", "i8mm")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what ``platform`` says)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    """Which machine a benchmark ran on (its JSON records it: machines differ, e.g. AMX-BF16 vs
    AVX2-only): CPU model, cores, its vector/matrix flags, and whether bf16 matmuls run in
    hardware (``cpu_bf16``: the flag) or are emulated; the GPU when there is one."""
    out = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
           "cpu_flags": sorted(f for f in _cpu_flags() if f.startswith(SIMD_PREFIXES)),
           "cpu_bf16": cpu_bf16_feature() or "emulated", "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def cpu_bf16_feature() -> str | None:
    """The first of ``BF16_CPU_FLAGS`` this CPU has, or None: no fast bf16 matmul here.
    ``CONCEPTMOE_CPU_BF16=0`` hides it, ``=1`` assumes one."""
    forced = os.environ.get(BF16_ENV)
    if forced in ("0", "1"):
        return f"{BF16_ENV}={forced}" if forced == "1" else None
    if forced is not None and forced.strip():  # a typo must not fall back to detection silently
        from .errors import UserError

        raise UserError(f"{BF16_ENV}={forced!r}: use 0 (no fast bf16 on this CPU) or 1 (assume one), or unset it")
    return next((f for f in BF16_CPU_FLAGS if f in _cpu_flags()), None)


def default_dtype(device: torch.device) -> str:
    """``fp32`` or ``bf16`` when no ``--dtype`` is given: bf16 autocast on CUDA and on CPUs with
    AMX-BF16 or AVX512-BF16 (7-8x the fp32 matmul rate through oneDNN), fp32 elsewhere."""
    if device.type == "cuda":
        return "bf16"
    return "bf16" if device.type == "cpu" and cpu_bf16_feature() else "fp32"


def dtype_note(device: torch.device, dtype: str, asked: str | None) -> str:
    """One line saying which precision a run uses and why (printed once at the start)."""
    if asked:
        return f"precision: {dtype} (--dtype {asked})"
    if device.type != "cpu":
        return f"precision: {dtype} autocast on {device.type}"
    feature = cpu_bf16_feature()
    why = f"detected {feature}" if feature else "no AMX-BF16 / AVX512-BF16 on this CPU"
    return f"precision: {dtype} ({why}; --dtype fp32|bf16 to choose)"
