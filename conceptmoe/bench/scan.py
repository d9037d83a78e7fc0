"""Benchmark of the dechunk EMA: parallel blockwise scan vs the sequential loop (CONCEPTMOE.md §2.5).

    conceptmoe bench scan --concepts 4096 --dim 512 --out bench_out/scan

Both paths run interleaved in one process on the same inputs (median of ``repeats``); the
speedup is a ratio measured side by side, so machine noise largely cancels. Also checks that
the two agree (max abs difference) and times forward+backward.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..device import machine
from ..model.scan import ema_scan, ema_scan_reference
from ..files import write_text


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run_scan_bench(concepts: int = 4096, dim: int = 512, batch: int = 1, repeats: int = 5,
                   device: str = "cpu", seed: int = 0) -> dict:
    """Median seconds of scan and loop (forward, forward+backward) and their ratio."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(batch, concepts, generator=g)
    p[:, 0] = 1
    p[:, 1::9] = 0.0
    p[:, 2::13] = 1.0
    c = torch.randn(batch, concepts, dim, generator=g)
    p, c = p.to(device), c.to(device)
    err = (ema_scan(p, c) - ema_scan_reference(p, c)).abs().max().item()

    def fwd(fn):
        return lambda: fn(p, c)

    def fwd_bwd(fn):
        def run():
            cc = c.clone().requires_grad_()
            fn(p, cc).sum().backward()
        return run

    res = {"concepts": concepts, "dim": dim, "batch": batch, "repeats": repeats,
           "device": device, "threads": torch.get_num_threads(), "max_abs_diff": err, "machine": machine()}
    for name, wrap in (("forward", fwd), ("forward_backward", fwd_bwd)):
        fns = {"scan": wrap(ema_scan), "loop": wrap(ema_scan_reference)}
        for f in fns.values():
            f()  # warm-up
        times = {k: [] for k in fns}
        for _ in range(repeats):  # interleave the two paths
            for k, f in fns.items():
                times[k] += _time(f, 1)
        med = {k: statistics.median(v) for k, v in times.items()}
        res[name] = {"scan_s": med["scan"], "loop_s": med["loop"], "speedup": med["loop"] / med["scan"]}
    return res


def format_table(res: dict) -> str:
    lines = [f"dechunk EMA, {res['concepts']} concepts x d={res['dim']} (batch {res['batch']}, "
             f"{res['threads']} threads, max |diff| {res['max_abs_diff']:.2e})",
             f"{'pass':<18}{'scan (ms)':>12}{'loop (ms)':>12}{'speedup':>10}"]
    for name in ("forward", "forward_backward"):
        r = res[name]
        lines.append(f"{name:<18}{r['scan_s'] * 1e3:>12.2f}{r['loop_s'] * 1e3:>12.2f}{r['speedup']:>9.1f}x")
    return "\n".join(lines)


def run_and_report(concepts: int, dim: int, batch: int, repeats: int, device: str,
                   out: str | None) -> dict:
    res = run_scan_bench(concepts, dim, batch, repeats, device)
    print(format_table(res))
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        write_text(path / "scan.json", json.dumps(res, indent=2, allow_nan=False) + "\n")
        print(f"wrote {path / 'scan.json'}")
    return res
