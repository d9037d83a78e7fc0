"""Training throughput of the MoE baseline and its compute-matched ConceptMoE (CONCEPTMOE.md §3, §5).

``run_train_bench(...)`` builds the MoE of a preset and the ConceptMoE that ``match_config``
gives for each ratio and strategy, and times a training step (forward, then backward) on random
tokens at each sequence length. Models are interleaved inside every repeat so machine noise hits
them alike; medians are reported. Boundary noise is on as in training. ``ratio`` columns are the
ConceptMoE's tokens/s over the MoE's (>= 1: at least as fast).

``dtypes``: ``fp32`` and/or ``bf16`` (bf16 autocast around the forward, as ``conceptmoe train``
runs it); several are interleaved in the same repeats, so ``vs_fp32`` (tokens/s over the same
model's in fp32) is a side-by-side ratio. ``compile``: ``torch.compile`` each block, as ``train
--compile`` does (the data-dependent expert dispatch stays eager).

FLOP/s and MFU: a step's forward FLOPs are ``flops.count_flops`` (activated linear layers plus
the attention maps, at the realised compression) times the tokens; its backward does twice as
many. MFU = FLOP/s over the measured matmul peak of the dtype (``peak.py``, at the threads of
the run, measured in the same process unless given).

Shape legend: B batch rows, T tokens per row.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..model.config import ModelConfig
from ..model.flops import count_flops
from ..model.lm import build_model
from ..model.match import match_config
from ..parallel.distributed import blocks
from ..device import machine
from .peak import measure_peak, squares_for

DTYPES = ("fp32", "bf16")


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


def precision(dtype: str, device_type: str = "cpu"):
    """The context a forward runs in: bf16 autocast, or nothing for fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, x: torch.Tensor, u: torch.Tensor, dtype: str = "fp32") -> tuple[float, float]:
    """Forward and backward seconds of one step (on CUDA, synchronised around each phase)."""
    kwargs = _boundary_kwargs(model, u)
    _sync(x.device)
    t0 = time.perf_counter()
    with precision(dtype, x.device.type):
        out = model(x, labels=x, **kwargs)
    _sync(x.device)
    t1 = time.perf_counter()
    out.loss.backward()
    _sync(x.device)
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def run_train_bench(preset: str = "small", ratios: tuple[float, ...] = (2.0,), strategies: tuple[str, ...] = ("topk",),
                    seq_lens: tuple[int, ...] = (256, 2048), tokens: int = 2048, repeats: int = 5,
                    seed: int = 0, exact: bool = True, profile: int = 0, dtypes: tuple[str, ...] = ("fp32",),
                    compile: bool = False, peak: dict[str, float] | None = None, device: str = "cpu",
                    concept_bucket: int | None = None) -> dict:
    """Per sequence length, dtype and model: median forward / backward seconds, tokens/s, FLOP/s, MFU.

    ``exact``: ConceptMoEs take exactly round(T/R) boundaries per row (random positions), so the
    comparison is at the target compression; else the boundaries come from the untrained router
    with fresh boundary noise at every step, so that the number of concepts changes from step to
    step as in training (compression reported either way, of the last step's noise). ``profile`` > 0: also the top
    ``profile`` operators by self CPU time of one forward and one backward per model and length
    (torch.profiler), under ``profile`` in the result (keys ``model@T``, plus `` dtype`` when
    several dtypes run). ``peak``: GFLOP/s per dtype (default: measured now on ``device``, ``peak.py``).
    ``concept_bucket``: the ConceptMoEs' ``concept_bucket`` (None: as in training, lm.py)."""
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"dtypes must be among {', '.join(DTYPES)} (got {', '.join(dtypes) or 'none'})")
    base = ModelConfig.from_preset(preset, kind="moe")
    cfgs = [("MoE", base)] + [(f"{s}-R{r:g}", match_config(base, r, s).config) for r in ratios for s in strategies]
    dev = torch.device(device)
    peak = peak or measure_peak(tuple(dtypes), preset, tokens, squares_for(preset, tokens), device=device,
                                min_time=0.1, budget=30.0)["peak_gflops"]
    torch.manual_seed(seed)
    models = {name: build_model(cfg).to(dev).train() for name, cfg in cfgs}
    for m in models.values():
        m.loss_only = True  # as the trainer: the head and its cross-entropy fused (model/linear_ce.py)
        if m.cfg.is_concept:
            m.concept_bucket = concept_bucket
    if compile:
        for m in models.values():
            for blk in blocks(m):
                blk.compile(dynamic=True)
    runs = [(name, dt) for dt in dtypes for name in models]
    rows, profiles = [], {}
    for T in seq_lens:
        B = max(1, tokens // T)
        g = torch.Generator().manual_seed(seed + T)
        x = torch.randint(0, base.vocab_size, (B, T), generator=g)
        u = torch.rand(B, T, generator=g)
        inputs = {name: (exact_boundaries(B, T, m.cfg.compression_ratio, g) if exact and m.cfg.is_concept else u)
                  .to(dev) for name, m in models.items()}
        x = x.to(dev)
        for name, dt in runs:  # warm-up (and, with compile, compilation)
            _step(models[name], x, inputs[name], dt)
        times: dict[tuple[str, str], list[tuple[float, float]]] = {r: [] for r in runs}
        for _ in range(repeats):
            if not exact:  # fresh boundary noise every step, as in training: C changes step to step
                u = torch.rand(B, T, generator=g).to(dev)
                inputs = {name: u for name in models}
            for name, dt in runs:
                times[name, dt].append(_step(models[name], x, inputs[name], dt))
        comps = {name: _compression(m, x, inputs[name]) for name, m in models.items()}
        tps_of = {}
        for (name, dt), t in times.items():
            fwd = statistics.median(a for a, _ in t)
            bwd = statistics.median(b for _, b in t)
            tps = tps_of[name, dt] = B * T / (fwd + bwd)
            f = count_flops(models[name].cfg, T, comps[name])
            flops = (f["activated_flops_per_token"] + f["attention_map_flops_per_token"]) * B * T  # forward
            rows.append({"model": name, "dtype": dt, "seq_len": T, "batch": B, "forward_s": fwd, "backward_s": bwd,
                         "tokens_per_s": tps, "ratio_vs_moe": tps / tps_of["MoE", dt],
                         "vs_fp32": tps / tps_of[name, "fp32"] if "fp32" in dtypes else None,
                         "compression": comps[name], "forward_flops": flops,
                         "forward_gflops_per_s": flops / fwd / 1e9, "backward_gflops_per_s": 2 * flops / bwd / 1e9,
                         "forward_mfu": flops / fwd / 1e9 / peak[dt], "backward_mfu": 2 * flops / bwd / 1e9 / peak[dt],
                         "mfu": 3 * flops / (fwd + bwd) / 1e9 / peak[dt]})
        if profile:
            for name, dt in runs:
                key = f"{name}@{T}" + (f" {dt}" if len(dtypes) > 1 else "")
                profiles[key] = profile_step(models[name], x, inputs[name], profile, dt)
    return {"profile": profiles, "preset": preset, "device": dev.type, "threads": torch.get_num_threads(),
            "repeats": repeats,
            "machine": machine(),
            "exact_compression": exact, "concept_bucket": concept_bucket,
            "dtypes": list(dtypes), "compile": compile,
            "peak_gflops": {dt: peak[dt] for dt in dtypes}, "rows": rows,
            "models": {n: cfg.name for n, cfg in cfgs}}


def profile_step(model, x: torch.Tensor, u: torch.Tensor, top: int = 12, dtype: str = "fp32") -> dict[str, list[dict]]:
    """Top ``top`` operators by self CPU time in one forward and, separately, one backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as fwd, precision(dtype, x.device.type):
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
    peak = ", ".join(f"{k} {v:.0f}" for k, v in res["peak_gflops"].items())
    lines = [f"training step, preset {res['preset']}, {res['threads']} threads, median of {res['repeats']}"
             f"{', compiled blocks' if res['compile'] else ''}; MFU against the measured matmul peak "
             f"({peak} GFLOP/s)",
             f"{'model':<12}{'dtype':>6}{'T':>6}{'B':>4}{'R':>6}{'fwd (s)':>9}{'bwd (s)':>9}{'tok/s':>8}"
             f"{'vs MoE':>7}{'vs fp32':>8}{'fwd GF/s':>9}{'bwd GF/s':>9}{'fwd MFU':>8}{'bwd MFU':>8}"]
    for r in res["rows"]:
        vs32 = f"{r['vs_fp32']:>8.2f}" if r["vs_fp32"] is not None else f"{'-':>8}"
        lines.append(f"{r['model']:<12}{r['dtype']:>6}{r['seq_len']:>6}{r['batch']:>4}{r['compression']:>6.2f}"
                     f"{r['forward_s']:>9.3f}{r['backward_s']:>9.3f}{r['tokens_per_s']:>8.0f}"
                     f"{r['ratio_vs_moe']:>7.2f}{vs32}{r['forward_gflops_per_s']:>9.1f}"
                     f"{r['backward_gflops_per_s']:>9.1f}{r['forward_mfu']:>8.1%}{r['backward_mfu']:>8.1%}")
    return "\n".join(lines)
