"""The machine's measured matmul peak per dtype: the reference for every MFU figure (CONCEPTMOE.md §5).

``measure_peak(...)`` times ``torch.mm`` at large square shapes and at the shapes a training
step of a preset multiplies (attention projections, the shared expert, the LM head, one routed
expert's slice of a 2,048-token batch), in fp32 and bf16, on the threads the process uses. Each
shape is warmed up, then repeated for about ``min_time`` seconds; its rate is the median. The
peak of a dtype is the best shape's rate: MFU = achieved FLOP/s / peak.

On CPU bf16 runs through oneDNN; with AMX-BF16 it is several times the fp32 rate, without it
(no AVX512-BF16 either) it is emulated and far slower than fp32 (a bf16 2048² product took 122 s
on such a CPU): the table says so. The work is sized to a time budget: a probe product gives each
dtype's rate, and a shape whose repeats would not fit its share of the budget is timed on fewer
rows (``rows_cut_from``). The result records the machine (``device.machine``).

Shape legend: M rows, K inner dimension, N columns (an (M, K) @ (K, N) product: 2·M·K·N FLOPs).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..device import cpu_bf16_feature, machine
from ..model.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SQUARE = (1024, 2048)
BUDGET_S = 60.0  # seconds for the whole measurement, about
PROBE = 256  # the probe product (PROBE³) that estimates a dtype's rate before the real shapes
RUNS = 4  # a shape's products at least: one warm-up and three timed


def squares_for(preset: str, tokens: int = 2048) -> tuple[int, ...]:
    """The square shapes worth timing for ``preset``: none larger than its widest weight matrix
    (a tiny model's latency is not measured against a 2048² peak)."""
    top = max(max(K, N) for _, _, K, N in model_shapes(preset, tokens))
    return tuple(n for n in SQUARE if n <= top)


def is_emulated(dtype: str, device: torch.device) -> bool:
    """bf16 on a CPU without AMX-BF16 / AVX512-BF16: oneDNN emulates it, far slower than fp32."""
    return dtype == "bf16" and device.type == "cpu" and cpu_bf16_feature() is None


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
                 square: tuple[int, ...] = SQUARE, device: str = "cpu", min_time: float = 0.2,
                 budget: float = BUDGET_S, progress: bool = False) -> dict:
    """Rows per dtype and shape, and ``peak_gflops`` per dtype (the best row), in about ``budget``
    seconds (see the module docstring); ``progress`` shows a bar on stderr."""
    from tqdm import tqdm

    dev = torch.device(device)
    shapes = [(f"square {n}", n, n, n) for n in square] + model_shapes(preset, tokens)
    rows, start = [], time.perf_counter()
    todo = [(name, shape) for name in dtypes for shape in shapes]
    rate = {name: time_matmul(PROBE, PROBE, PROBE, DTYPES[name], dev, 0.0)["gflops"] * 1e9 for name in dtypes}
    bar = tqdm(todo, desc="bench peak", unit="shape", disable=not progress, leave=False, dynamic_ncols=True)
    for i, (name, (label, M, K, N)) in enumerate(bar):
        bar.set_postfix_str(f"{name} {label}", refresh=True)
        share = max(budget - (time.perf_counter() - start), 0.0) / (len(todo) - i)
        m = max(1, min(M, int(M * share / (RUNS * 2 * M * K * N / rate[name]))))  # rows that fit the share
        r = time_matmul(m, K, N, DTYPES[name], dev, min(min_time, share / RUNS))
        rows.append({"dtype": name, "shape": label, "M": m, "K": K, "N": N, **r,
                     **({"rows_cut_from": M} if m < M else {})})
    bar.close()
    peak = {name: max(r["gflops"] for r in rows if r["dtype"] == name) for name in dtypes}
    return {"device": dev.type, "threads": torch.get_num_threads(), "preset": preset, "tokens": tokens,
            "bf16_feature": cpu_bf16_feature() if dev.type == "cpu" else dev.type,
            "emulated": [name for name in dtypes if is_emulated(name, dev)], "budget_s": budget,
            "machine": machine(), "peak_gflops": peak, "rows": rows}


def format_table(res: dict) -> str:
    feature = res["bf16_feature"] or "no AMX-BF16 / AVX512-BF16"
    cpu = (res.get("machine") or {}).get("cpu_model", "")
    lines = [f"matmul peak, {res['device']}{f' ({cpu})' if cpu else ''}, {res['threads']} threads ({feature}); "
             f"model shapes of preset {res['preset']} at {res['tokens']} tokens"]
    lines += [f"{name}: emulated on this CPU (no AMX-BF16 / AVX512-BF16): its rate is not a hardware peak"
              for name in res.get("emulated", [])]
    cols = [("dtype", 5, "<"), ("shape", 11, "<"), ("M", 6, ">"), ("K", 6, ">"), ("N", 6, ">"),
            ("GFLOP/s", 9, ">"), ("ms", 10, ">")]
    lines.append("  ".join(f"{h:{a}{w}}" for h, w, a in cols))
    for r in res["rows"]:
        cut = f"  (rows cut from {r['rows_cut_from']} to fit the time budget)" if "rows_cut_from" in r else ""
        cells = (r["dtype"], r["shape"], r["M"], r["K"], r["N"], f"{r['gflops']:.3g}", f"{r['seconds'] * 1e3:.4g}")
        lines.append("  ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, cols)) + cut)
    peak = res["peak_gflops"]
    ratio = f" (bf16/fp32 {peak['bf16'] / peak['fp32']:.2g}x)" if {"fp32", "bf16"} <= set(peak) else ""
    lines.append("peak: " + ", ".join(f"{k} {v:.3g} GFLOP/s" for k, v in peak.items()) + ratio)
    return "\n".join(lines)
