"""Training throughput of the MoE baseline and its compute-matched ConceptMoE (CONCEPTMOE.md §3, §5).

``run_train_bench(...)`` builds the MoE of a preset and the ConceptMoE that ``match_config``
gives for each ratio and strategy, and times a training step (forward, then backward) on random
tokens at each sequence length. Models are interleaved inside every repeat so machine noise hits
them alike; medians are reported. Boundary noise is on as in training. ``ratio`` columns are the
ConceptMoE's tokens/s over the MoE's (>= 1: at least as fast).

Shape legend: B batch rows, T tokens per row.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..model.config import ModelConfig
from ..model.lm import build_model
from ..model.match import match_config


def exact_boundaries(B: int, T: int, ratio: float, g: torch.Generator) -> torch.Tensor:
    """(B, T) bool with round(T / R) boundaries per row at random positions, position 0 included."""
    n = max(1, round(T / ratio))
    b = torch.zeros(B, T, dtype=torch.bool)
    for r in range(B):
        b[r, 0] = True
        b[r, 1 + torch.randperm(T - 1, generator=g)[:n - 1]] = True
    return b


def _boundary_kwargs(model, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """A ConceptMoE takes exact boundaries (bool u: the router still runs) or noise uniforms."""
    if not model.cfg.is_concept:
        return {}
    return {"boundaries_override": u} if u.dtype == torch.bool else {"boundary_noise": u}


def _step(model, x: torch.Tensor, u: torch.Tensor) -> tuple[float, float]:
    kwargs = _boundary_kwargs(model, u)
    t0 = time.perf_counter()
    out = model(x, labels=x, **kwargs)
    t1 = time.perf_counter()
    out.loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def run_train_bench(preset: str = "small", ratios: tuple[float, ...] = (2.0,), strategies: tuple[str, ...] = ("topk",),
                    seq_lens: tuple[int, ...] = (256, 2048), tokens: int = 2048, repeats: int = 5,
                    seed: int = 0, exact: bool = True, profile: int = 0) -> dict:
    """Per sequence length and model: median forward / backward seconds and tokens/s.

    ``exact``: ConceptMoEs take exactly round(T/R) boundaries per row (random positions), so the
    comparison is at the target compression; else the boundaries come from the untrained router
    with boundary noise (compression reported either way). ``profile`` > 0: also the top
    ``profile`` operators by self CPU time of one forward and one backward per model and length
    (torch.profiler), under ``profile`` in the result."""
    base = ModelConfig.from_preset(preset, kind="moe")
    cfgs = [("MoE", base)] + [(f"{s}-R{r:g}", match_config(base, r, s).config) for r in ratios for s in strategies]
    torch.manual_seed(seed)
    models = {name: build_model(cfg).train() for name, cfg in cfgs}
    rows, profiles = [], {}
    for T in seq_lens:
        B = max(1, tokens // T)
        g = torch.Generator().manual_seed(seed + T)
        x = torch.randint(0, base.vocab_size, (B, T), generator=g)
        u = torch.rand(B, T, generator=g)
        inputs = {name: (exact_boundaries(B, T, m.cfg.compression_ratio, g) if exact and m.cfg.is_concept else u)
                  for name, m in models.items()}
        for name, m in models.items():  # warm-up
            _step(m, x, inputs[name])
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in models}
        for _ in range(repeats):
            for name, m in models.items():
                times[name].append(_step(m, x, inputs[name]))
        base_tps = None
        for name, t in times.items():
            fwd = statistics.median(a for a, _ in t)
            bwd = statistics.median(b for _, b in t)
            tps = B * T / (fwd + bwd)
            base_tps = base_tps or tps
            rows.append({"model": name, "seq_len": T, "batch": B, "forward_s": fwd, "backward_s": bwd,
                         "tokens_per_s": tps, "ratio_vs_moe": tps / base_tps,
                         "compression": _compression(models[name], x, inputs[name])})
        if profile:
            for name, m in models.items():
                profiles[f"{name}@{T}"] = profile_step(m, x, inputs[name], profile)
    return {"profile": profiles, "preset": preset, "threads": torch.get_num_threads(), "repeats": repeats, "exact_compression": exact,
            "rows": rows,
            "models": {n: cfg.name for n, cfg in cfgs}}


def profile_step(model, x: torch.Tensor, u: torch.Tensor, top: int = 12) -> dict[str, list[dict]]:
    """Top ``top`` operators by self CPU time in one forward and, separately, one backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as fwd:
        out = model(x, labels=x, **_boundary_kwargs(model, u))
    with profile(activities=[ProfilerActivity.CPU]) as bwd:
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    return {"forward": _top_ops(fwd, top), "backward": _top_ops(bwd, top)}


def _top_ops(prof, top: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:top]]


def format_profile(res: dict) -> str:
    lines = []
    for key, phases in res.get("profile", {}).items():
        for phase, ops in phases.items():
            lines.append(f"{key} {phase}: " + ", ".join(f"{o['op']} {o['share']:.0%}" for o in ops))
    return "\n".join(lines)


@torch.no_grad()
def _compression(model, x: torch.Tensor, u: torch.Tensor) -> float:
    if not model.cfg.is_concept:
        return 1.0
    b = u if u.dtype == torch.bool else model(x, boundary_noise=u).boundaries
    return b.numel() / int(b.sum())


def format_table(res: dict) -> str:
    lines = [f"training step, preset {res['preset']}, {res['threads']} threads, median of {res['repeats']}",
             f"{'model':<12}{'T':>6}{'B':>4}{'R':>6}{'fwd (s)':>10}{'bwd (s)':>10}{'tok/s':>9}{'vs MoE':>8}"]
    for r in res["rows"]:
        lines.append(f"{r['model']:<12}{r['seq_len']:>6}{r['batch']:>4}{r['compression']:>6.2f}"
                     f"{r['forward_s']:>10.3f}{r['backward_s']:>10.3f}"
                     f"{r['tokens_per_s']:>9.0f}{r['ratio_vs_moe']:>8.2f}")
    return "\n".join(lines)
