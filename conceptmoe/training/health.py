"""Watching a run (``train --log jsonl|tensorboard``): health figures, warnings, MFU (CONCEPTMOE.md §2.2, §2b, §5).

``Watch`` adds to the metrics rows of ``loop.run``: every step the router z-loss, the model
FLOP/s (3x the forward's activated and attention-map FLOPs at the step's realised compression,
``model/flops.py``) and MFU against a quick matmul probe of this device and dtype
(``matmul_peak``; ``conceptmoe bench peak`` measures the peak properly); every health interval (the
validation interval, or a tenth of the run without validation) a ``health`` object: the chunk
router's realised compression against its target R (per R for an elastic run), p histogram and
share within 0.1 of the threshold, and per MoE layer the tokens per expert, load imbalance
(max/mean), dead experts (no token over the interval) and z-loss (``model/health.py``). The
counts are local running sums on the device, summed over processes once per interval, so data,
FSDP and expert parallelism all report the global figures.

Warnings (stderr, once per event, and in the row's ``warnings``): realised compression more than
``COMPRESSION_BAND`` (15%) off its target, over an interval of training or at a validation (cut at
p >= 0.5), and experts that received no token over a whole interval. An event re-arms once the
figure is back in its band or the expert receives tokens again. After a resume the first interval
counts from the resumed step (``health.steps`` says how many it covers).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..model.flops import count_flops
from ..model.health import COMPRESSION_BAND, HealthTally, compression_off, summary
from ..parallel.distributed import Dist
from . import tblog


def matmul_peak(device: torch.device, dtype: str) -> float:
    """GFLOP/s of the best of a few square products in ``dtype`` here (a quick probe, ~0.1 s)."""
    n = 4096 if device.type == "cuda" else 512
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dt) for _ in range(2))
    best = float("inf")
    for i in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


class Watch:
    """The health of one training session: installed on the model, called once per logged step."""

    def __init__(self, raw: torch.nn.Module, mode: str, out: Path, step: int, total: int, every: int,
                 seq_len: int, d: Dist, dtype: str) -> None:
        self.raw, self.cfg, self.d, self.total, self.seq_len = raw, raw.cfg, d, total, seq_len
        self.every, self.start = every, step
        self.tally = HealthTally(training=True)
        raw.health = self.tally
        self.peak = matmul_peak(d.device, dtype)
        self.writer = tblog.open_writer(out, step) if mode == "tensorboard" and d.main else None
        self.out_of_band: set[str] = set()  # compression events now in progress
        self.dead: set[tuple[str, int]] = set()  # (layer, expert) dead over the last interval

    def add(self, row: dict, aux: dict, step: int) -> None:
        """Add this step's figures (and at a health step the interval's) to ``row``; write the
        row's events. Every rank calls it (the interval's sums are a collective)."""
        row["router_z_loss"] = aux["router_z_loss"]
        comp = max(float(row.get("compression", 1.0)), 1.0)
        f = count_flops(self.cfg, self.seq_len, comp if self.cfg.is_concept else None)
        row["flops_per_s"] = 3 * (f["activated_flops_per_token"] + f["attention_map_flops_per_token"]) \
            * row["tokens_per_s"]
        row["mfu"] = row["flops_per_s"] / (self.peak * 1e9 * self.d.world)
        warnings = []
        if step % self.every == 0 or step == self.total:
            h = summary(self.tally, self.cfg, self.d.sum(self.tally.vector()))
            h = {"steps": step - self.start, "peak_gflops": self.peak, **h}
            self.tally.reset()
            self.start = step
            if self.cfg.is_concept:
                h["target"] = self.cfg.compression_ratio
            row["health"] = h
            warnings += self._compression(h, row, step) + self._dead(h, step)
        elif "val_compression" in row:
            warnings += self._compression({}, row, step)
        if warnings:
            row["warnings"] = warnings
            if self.d.main:
                for w in warnings:
                    tqdm.write(w, file=sys.stderr)
        if self.writer is not None:
            tblog.write(self.writer, row)

    def _compression(self, h: dict, row: dict, step: int) -> list[str]:
        cfg = self.cfg
        if not cfg.is_concept or cfg.chunk_router == "fixed":
            return []
        span = f"over steps {step - h['steps'] + 1}-{step}" if "steps" in h else ""
        checks = [(f"training compression at R = {r}", c, float(r)) for r, c in h.get("compression_by_ratio", {}).items()]
        if "compression" in h and not checks:
            checks.append(("training compression", h["compression"], cfg.compression_ratio))
        if "val_compression" in row:
            checks.append(("held-out compression (p >= 0.5)", row["val_compression"], cfg.compression_ratio))
        out = []
        for what, realised, target in checks:
            off = compression_off(realised, target)
            if off is None:
                self.out_of_band.discard(what)
            elif what not in self.out_of_band:
                self.out_of_band.add(what)
                where = span if what.startswith("training") else "at this validation"
                out.append(f"warning: step {step}: {what} {realised:.2f} is {off:+.0%} off the target R = "
                           f"{target:g} (band ±{COMPRESSION_BAND:.0%}) {where}")
        return out

    def _dead(self, h: dict, step: int) -> list[str]:
        out, now = [], set()
        for name, e in h["experts"].items():
            dead = [i for i, c in enumerate(e["tokens"]) if c == 0]
            now |= {(name, i) for i in dead}
            new = [i for i in dead if (name, i) not in self.dead]
            if new:
                out.append(f"warning: step {step}: layer {name}: expert{'s' * (len(new) > 1)} "
                           f"{', '.join(map(str, new))} received no token over steps {step - h['steps'] + 1}-{step} "
                           f"(dead: {e['dead']} of {len(e['tokens'])})")
        self.dead = now
        return out

    def close(self) -> None:
        self.raw.health = None
        if self.writer is not None:
            self.writer.close()
