"""Prefill and decode latency of MoE vs compute-matched ConceptMoE (CONCEPTMOE.md §4, §5).

``run_latency(LatencySettings(...))`` builds the MoE baseline of a preset and the ConceptMoE
configs ``match_config`` gives for each ratio and strategy (plus trained runs, ``--run``),
then times, interleaving the models inside every repeat so that machine noise hits all of
them alike, and reports medians:

- **prefill**: ``inference.prefill`` over ``prefill_batch`` rows of L random tokens (the
  forward pass that also fills the caches; logits of the last position only);
- **decode**: seconds per ``decode_step`` (one new token for each of ``batch`` rows) with
  ``kv`` tokens already cached, filled synthetically (``decode_state.py``); each repeat
  rewinds them.

``input="held-out"`` (with ``text_ids``, a run's held-out tokens): the prompts and the decoded
tokens are stretches of that text instead of random ids (``text_rows``), so a trained router
realises the compression it has on text.

Untrained ConceptMoE routers are calibrated to the target ratio first (``calibrate.py``);
trained runs are left alone. The realised compression is measured and reported every time.

Speedup % = (t_MoE / t - 1) x 100, the paper's convention (+100% = twice as fast).

``dtype`` ``bfloat16``: weights, activations and the KV / concept caches in bf16 (the routers,
norms and dechunk scan compute in fp32 inside, as in training). ``compile``: ``torch.compile``
of the dense modules the cached steps call (norms, shared experts). Every row also has its
FLOPs (activated linear layers + attention maps, ``flops.count_flops``), GFLOP/s and MFU
against the matmul peak of the dtype (``peak.py``, measured in the same process unless given).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..inference.cache import InferenceState
from ..inference.steps import decode_step, prefill
from ..model.config import ModelConfig
from ..model.flops import count_flops
from ..model.lm import build_model
from ..model.match import match_config
from ..model.elastic import require_ratio
from .calibrate import calibrate_decode, calibrate_router
from ..parallel.distributed import blocks
from .decode_state import restore, snapshot, synthetic_state
from ..device import machine, resolve_device
from .peak import is_emulated, measure_peak, squares_for


@dataclass
class LatencySettings:
    preset: str = "small"
    ratios: list[float] = field(default_factory=lambda: [2.0])
    strategies: list[str] = field(default_factory=lambda: ["topk", "layers"])
    runs: list[str] = field(default_factory=list)  # trained run directories (no calibration)
    run_ratios: list[float] = field(default_factory=list)  # R asked of elastic runs (one model each)
    extrapolate: bool = False  # allow run_ratios outside an elastic run's trained range
    prefill_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384])
    kv_lens: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    batch: int = 8  # decode rows
    prefill_batch: int = 1
    repeats: int = 3
    decode_steps: int = 16  # decode steps per timed repeat
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # or "bfloat16"
    threads: int = 0  # torch intra-op threads (0: leave torch's default)
    compile: bool = False  # torch.compile the dense modules of every block
    peak_gflops: float | None = None  # matmul peak of the dtype (None: measure it)
    input: str = "random"  # "random" token ids, or "held-out": the first run's held-out text (``text_ids``)


@dataclass
class BenchModel:
    name: str
    model: nn.Module
    strategy: str | None = None  # match strategy; None for the baseline and trained runs
    calibrate: bool = False  # untrained router: set it to hit the target ratio
    request: float | None = None  # the R asked of an elastic run (None: its design ratio)
    extrapolate: bool = False  # request lies outside the trained range, as --extrapolate allowed

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def ratio(self) -> float:
        if self.request is not None:
            return self.request
        return self.cfg.compression_ratio if self.cfg.is_concept else 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_bench_models(s: LatencySettings, load_run=None) -> list[BenchModel]:
    """The MoE baseline, its matched ConceptMoE variants, and any trained runs."""
    dtype, dev = getattr(torch, s.dtype), torch.device(s.device)
    base = ModelConfig.from_preset(s.preset, kind="moe")
    torch.manual_seed(s.seed)
    out = [BenchModel(base.name, build_model(base))]
    for ratio in s.ratios:
        for strategy in s.strategies:
            m = match_config(base, ratio, strategy)
            name = m.name if all(b.name != m.name for b in out) else f"{m.name}[{strategy}]"
            out.append(BenchModel(name, build_model(m.config), strategy, calibrate=True))
    for run in s.runs:
        if load_run is None:
            raise UserError("--run needs the training package's checkpoint loader")
        model = load_run(run)
        for r in s.run_ratios or [None]:
            r = require_ratio(model.cfg, r, s.extrapolate)
            at = "" if r is None else f"@R{r:g}"
            out.append(BenchModel(f"{model.cfg.name}[{Path(run).name}]{at}", model, request=r,
                                  extrapolate=s.extrapolate))
    for b in out:
        b.model.to(device=dev, dtype=dtype).eval()
        if s.compile:
            _compile_dense(b.model)
    return out


def _compile_dense(model: nn.Module) -> None:
    """``torch.compile`` the modules the cached steps call whole: norms and shared experts (the
    attention and the expert dispatch are called piecewise and stay eager)."""
    for blk in blocks(model):
        for mod in (blk.attn_norm, blk.moe_norm, blk.moe.shared):
            if mod is not None:
                mod.compile(dynamic=True)
    model.norm.compile(dynamic=True)


def add_mfu(result: dict, models: list[BenchModel], peak_gflops: float) -> None:
    """FLOPs, GFLOP/s and MFU of every prefill and decode row (in place)."""
    cfg = {b.name: b.cfg for b in models}
    for r in result["prefill"]:
        f = count_flops(cfg[r["model"]], r["tokens"], r["compression"])
        r["flops"] = (f["activated_flops_per_token"] + f["attention_map_flops_per_token"]) * r["tokens"] * r["batch"]
    for r in result["decode"]:
        f = count_flops(cfg[r["model"]], compression=max(r["compression"], 1.0))
        r["flops"] = (f["activated_flops_per_token"] + r["attention_map_flops_per_token"]) * r["batch"]
    for r in result["prefill"] + result["decode"]:
        r["gflops_per_s"] = r["flops"] / r["median_s"] / 1e9
        r["mfu"] = r["gflops_per_s"] / peak_gflops


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def decode_attention_flops(cfg: ModelConfig, kv: int, compression: float) -> float:
    """Attention-map FLOPs (QKᵀ + AV) of one decoded token with kv tokens cached."""
    hd = 4 * cfg.n_heads * cfg.head_dim
    if not cfg.is_concept:
        return hd * (kv + 1) * cfg.n_layers
    tok = hd * (kv + 1) * (cfg.n_encoder_layers + cfg.n_decoder_layers)
    con = hd * (kv / compression + 1) * cfg.n_concept_layers * cfg.concept_loops / compression
    return tok + con


@torch.no_grad()
def _time_prefill(b: BenchModel, ids: torch.Tensor) -> tuple[float, InferenceState, torch.Tensor | None]:
    dev = ids.device
    _sync(dev)
    t0 = time.perf_counter()
    out, st = (prefill(b.model, ids) if b.request is None
               else prefill(b.model, ids, ratio=b.request, extrapolate=b.extrapolate))
    _sync(dev)
    return time.perf_counter() - t0, st, out.boundary


def text_rows(text_ids: torch.Tensor, rows: int, length: int, start: int = 0) -> torch.Tensor:
    """(rows, length) consecutive stretches of ``text_ids`` from ``start`` on (wrapping around when
    the text is shorter): the prompts of a latency run on real text."""
    n = text_ids.numel()
    idx = (start + torch.arange(rows * length)) % n
    return text_ids[idx].view(rows, length)


def bench_prefill(models: list[BenchModel], s: LatencySettings, log=print,
                  text_ids: torch.Tensor | None = None) -> list[dict]:
    dev = torch.device(s.device)
    V = min(b.cfg.vocab_size for b in models)
    g = torch.Generator().manual_seed(s.seed)
    if text_ids is None:
        ids = torch.randint(0, V, (s.prefill_batch, max(s.prefill_lens)), generator=g).to(dev)
    else:
        ids = text_rows(text_ids, s.prefill_batch, max(s.prefill_lens)).to(dev)
    states = {}  # encoder states (B, T, D): they do not depend on the router
    for b in models:
        if b.calibrate:
            with torch.no_grad():
                states[b.name] = b.model.encode(ids)[0]
        _time_prefill(b, ids[:, :min(256, ids.shape[1])])  # warm-up
    rows = []
    for L in s.prefill_lens:
        for b in models:  # calibrate on this very input: prefix L of the longest one
            if b.calibrate:
                h = states[b.name][:, :L]
                n = s.prefill_batch * (round(L / b.ratio) - 1)  # position 0 is always a boundary
                calibrate_router(b.model, h[:, 1:].flatten(0, 1), h[:, :-1].flatten(0, 1), n, s.seed)
        times = {b.name: [] for b in models}
        info = {}
        for _ in range(s.repeats):
            for b in models:  # interleaved: every repeat runs every model once
                dt, st, bnd = _time_prefill(b, ids[:, :L])
                times[b.name].append(dt)
                comp = 1.0 if bnd is None else bnd.numel() / int(bnd.sum())
                info[b.name] = (comp, st.kv_bytes(), st.tokens.k[0].element_size())
                del st
        base = _median(times[models[0].name])
        for b in models:
            comp, kv, esize = info[b.name]
            t = _median(times[b.name])
            f = count_flops(b.cfg, seq_len=L, compression=comp, dtype_bytes=esize)
            rows.append({"model": b.name, "tokens": L, "batch": s.prefill_batch, "median_s": t,
                         "times_s": times[b.name], "speedup_pct": 100 * (base / t - 1),
                         "compression": comp, "target_compression": b.ratio,
                         "kv_bytes": kv, "kv_bytes_analytic": f["kv_cache_bytes_per_token"] * L * s.prefill_batch,
                         "attention_map_flops": f["attention_map_flops_per_token"] * L * s.prefill_batch})
            log(f"prefill L={L:<6} {b.name:<28} {t:8.3f} s  {rows[-1]['speedup_pct']:+7.1f}%  R={comp:.2f}")
    return rows


def bench_decode(models: list[BenchModel], s: LatencySettings, log=print,
                 text_ids: torch.Tensor | None = None) -> list[dict]:
    dev = torch.device(s.device)
    V = min(b.cfg.vocab_size for b in models)
    g = torch.Generator().manual_seed(s.seed + 1)
    if text_ids is None:
        tokens = torch.randint(0, V, (s.decode_steps, s.batch), generator=g).to(dev)
    else:  # row r continues stretch r of the text; the cache before it stays synthetic
        tokens = text_rows(text_ids, s.batch, s.decode_steps).T.contiguous().to(dev)
    rows = []
    for kv in s.kv_lens:
        states, snaps = {}, {}
        for b in models:
            st = synthetic_state(b.model, s.batch, kv, s.decode_steps, s.seed, b.request, b.extrapolate)
            if b.calibrate:
                calibrate_decode(b.model, b.ratio, st, tokens, s.seed)
            else:  # warm-up pass
                snap = snapshot(st)
                with torch.no_grad():
                    for t in tokens:
                        decode_step(b.model, st, t)
                restore(st, snap)
            states[b.name], snaps[b.name] = st, snapshot(st)
        times = {b.name: [] for b in models}
        comps = {}
        for _ in range(s.repeats):
            for b in models:
                st = states[b.name]
                restore(st, snaps[b.name])
                n_bound = 0
                _sync(dev)
                t0 = time.perf_counter()
                with torch.no_grad():
                    for t in tokens:
                        out = decode_step(b.model, st, t)
                        if out.boundary is not None:
                            n_bound += int(out.boundary.sum())
                _sync(dev)
                times[b.name].append((time.perf_counter() - t0) / s.decode_steps)
                comps[b.name] = tokens.numel() / n_bound if b.cfg.is_concept and n_bound else 1.0
        base = _median(times[models[0].name])
        for b in models:
            st, t = states[b.name], _median(times[b.name])
            restore(st, snaps[b.name])
            esize = st.tokens.k[0].element_size()
            f = count_flops(b.cfg, compression=b.ratio, dtype_bytes=esize)
            rows.append({"model": b.name, "kv_len": kv, "batch": s.batch, "median_s": t,
                         "times_s": times[b.name], "speedup_pct": 100 * (base / t - 1),
                         "compression": comps[b.name], "target_compression": b.ratio,
                         "kv_bytes": st.kv_bytes(),
                         "kv_bytes_analytic": f["kv_cache_bytes_per_token"] * kv * s.batch,
                         "attention_map_flops_per_token": decode_attention_flops(b.cfg, kv, comps[b.name])})
            log(f"decode kv={kv:<6} {b.name:<28} {t * 1e3:8.2f} ms/step  "
                f"{rows[-1]['speedup_pct']:+7.1f}%  R={comps[b.name]:.2f}")
        del states, snaps
    return rows


def run_latency(s: LatencySettings, load_run=None, log=print, text_ids: torch.Tensor | None = None) -> dict:
    """Both benchmarks; returns the JSON-ready result (see ``latency_report``). ``text_ids``
    (1-D token ids, with ``s.input == "held-out"``): prompts and decoded tokens from this text
    instead of random ids, so that a trained router places its boundaries as it would on text."""
    if (s.input == "held-out") != (text_ids is not None) or s.input not in ("random", "held-out"):
        raise UserError(f"input must be random, or held-out with the text's token ids (got {s.input!r})")
    for name in ("prefill_lens", "kv_lens"):
        if any(n < 2 for n in getattr(s, name)):
            raise UserError(f"--{name.replace('_', '-')}: lengths must be >= 2")
    if s.batch < 1 or s.prefill_batch < 1 or s.repeats < 1 or s.decode_steps < 1:
        raise UserError("--batch, --repeats and --decode-steps must be >= 1")
    if s.dtype not in ("float32", "bfloat16"):
        raise UserError(f"dtype must be float32 or bfloat16 (got {s.dtype!r})")
    threads = torch.get_num_threads()
    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        models = build_bench_models(s, load_run)
        if text_ids is not None and int(text_ids.max()) >= min(b.cfg.vocab_size for b in models):
            raise UserError("--input held-out: the text's token ids do not fit every model's vocabulary "
                            "(time runs that share one tokenizer, and a --preset with their vocabulary)")
        info = [{"name": b.name, "kind": b.cfg.kind, "strategy": b.strategy,
                 "target_compression": b.ratio, "calibrated_router": b.calibrate,
                 "total_params": b.model.num_params(),
                 "activated_flops_per_token": count_flops(b.cfg)["activated_flops_per_token"],
                 "config": b.cfg.to_dict()} for b in models]
        short = {"float32": "fp32", "bfloat16": "bf16"}[s.dtype]
        peak = s.peak_gflops or measure_peak((short,), s.preset, square=squares_for(s.preset), device=s.device,
                                             min_time=0.1, budget=20.0)["peak_gflops"][short]
        result = {"settings": asdict(s), "threads": torch.get_num_threads(), "models": info,
                  "dtype": short, "peak_gflops": peak, "machine": machine(),
                  "emulated": is_emulated(short, torch.device(resolve_device(s.device))),
                  "prefill": bench_prefill(models, s, log, text_ids) if s.prefill_lens else [],
                  "decode": bench_decode(models, s, log, text_ids) if s.kv_lens else []}
        add_mfu(result, models, peak)
    finally:
        torch.set_num_threads(threads)
    return result
