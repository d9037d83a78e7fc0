"""The machine's measured matmul peak per dtype: the reference for every MFU figure (CONCEPTMOE.md §5).

``measure_peak(...)`` times ``torch.mm`` at large square shapes and at the shapes a training
step of a preset multiplies (attention projections, the shared expert, the LM head, one routed
expert's slice of a 2,048-token batch), in fp32 and bf16, on the threads the process uses. Each
shape is warmed up, then repeated for about ``min_time`` seconds; its rate is the median. The
peak of a dtype is the best shape's rate: MFU = achieved FLOP/s / peak.

On CPU bf16 runs through oneDNN; with AMX-BF16 it is several times the fp32 rate, without it
(no AVX512-BF16 either) it may be slower than fp32: the table says which.

Shape legend: M rows, K inner dimension, N columns (an (M, K) @ (K, N) product: 2·M·K·N FLOPs).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..device import cpu_bf16_feature
from ..model.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SQUARE = (1024, 2048)


def model_shapes(preset: str = "small", tokens: int = 2048) -> list[tuple[str, int, int, int]]:
    """(label, M, K, N) of the matmuls a training step of ``preset`` makes on ``tokens`` tokens."""
    cfg = ModelConfig.from_preset(preset, kind="moe")
    d, qd, kvd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = [("qkv", tokens, d, qd + 2 * kvd), ("attn out", tokens, qd, d),
              ("expert up", max(1, tokens * cfg.top_k // cfg.n_experts), d, cfg.expert_hidden),
              ("lm head", tokens, d, cfg.vocab_size)]
    if cfg.n_shared_experts:
        shapes.insert(2, ("shared up", tokens, d, cfg.shared_size))
    return shapes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(M: int, K: int, N: int, dtype: torch.dtype, device: torch.device,
                min_time: float = 0.2, max_repeats: int = 50) -> dict:
    """Median seconds and GFLOP/s of an (M, K) @ (K, N) product."""
    g = torch.Generator().manual_seed(M * 7 + K * 13 + N)
    a = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(K, N, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(M, N, dtype=dtype, device=device)
    torch.mm(a, b, out=out)  # warm-up: oneDNN builds its kernel for this shape once
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"seconds": t, "gflops": 2 * M * K * N / t / 1e9, "repeats": len(times)}


def measure_peak(dtypes: tuple[str, ...] = ("fp32", "bf16"), preset: str = "small", tokens: int = 2048,
                 square: tuple[int, ...] = SQUARE, device: str = "cpu", min_time: float = 0.2) -> dict:
    """Rows per dtype and shape, and ``peak_gflops`` per dtype (the best row)."""
    dev = torch.device(device)
    shapes = [(f"square {n}", n, n, n) for n in square] + model_shapes(preset, tokens)
    rows = []
    for name in dtypes:
        for label, M, K, N in shapes:
            r = time_matmul(M, K, N, DTYPES[name], dev, min_time)
            rows.append({"dtype": name, "shape": label, "M": M, "K": K, "N": N, **r})
    peak = {name: max(r["gflops"] for r in rows if r["dtype"] == name) for name in dtypes}
    return {"device": dev.type, "threads": torch.get_num_threads(), "preset": preset, "tokens": tokens,
            "bf16_feature": cpu_bf16_feature() if dev.type == "cpu" else dev.type,
            "peak_gflops": peak, "rows": rows}


def format_table(res: dict) -> str:
    feature = res["bf16_feature"] or "no AMX-BF16 / AVX512-BF16"
    lines = [f"matmul peak, {res['device']}, {res['threads']} threads ({feature}); "
             f"model shapes of preset {res['preset']} at {res['tokens']} tokens",
             f"{'dtype':<6}{'shape':<12}{'M':>7}{'K':>7}{'N':>7}{'GFLOP/s':>10}{'ms':>9}"]
    for r in res["rows"]:
        lines.append(f"{r['dtype']:<6}{r['shape']:<12}{r['M']:>7}{r['K']:>7}{r['N']:>7}"
                     f"{r['gflops']:>10.1f}{r['seconds'] * 1e3:>9.2f}")
    peak = res["peak_gflops"]
    lines.append("peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items())
                 + (f" (bf16/fp32 {peak['bf16'] / peak['fp32']:.1f}x)" if {"fp32", "bf16"} <= set(peak) else ""))
    return "\n".join(lines)
