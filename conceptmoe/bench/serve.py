"""``conceptmoe bench serve``: requests per second at a fixed KV budget, runs side by side (CONCEPTMOE.md §4).

In the style of vLLM's serving benchmark: N requests whose prompts are stretches of the first
run's held-out text (the same token ids for every run, which must share a tokenizer), fixed or
drawn prompt and output lengths (``ignore_eos``, so every run produces the same number of
tokens), sent at a Poisson rate or all at once with a bounded concurrency, to a
``conceptmoe serve`` the benchmark starts itself for each run with the same ``--kv-cache-mb``.
Per run (and per ratio of an elastic run): request throughput, output tokens/s, time to first
token and time per output token (mean, p50, p99), the peak number of sequences the KV pool held
at once, KV bytes per token and the realised compression, and what memory that took: the peak
of the KV pool's ledger, the peak bytes of the K/V tensors the server really held, and the server
process's peak resident set. One warm-up request precedes timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ..device import machine
from ..errors import UserError
from .workloads import WORKLOADS


@dataclass
class ServeBenchSettings:
    runs: list[str]
    requests: int = 64
    prompt_len: int = 64
    output_len: int = 64
    len_spread: float = 0.0  # lengths drawn uniformly in [len (1 - s), len (1 + s)]
    rate: float = float("inf")  # requests per second (Poisson); inf: all at t = 0
    concurrency: int | None = None  # at most this many in flight (None: no bound)
    kv_cache_mb: float = 16.0
    max_batch: int = 64
    dtype: str = "fp32"
    device: str = "auto"
    threads: int | None = None  # server torch threads (None: its default)
    concept_ratios: list[float] = field(default_factory=list)  # for elastic runs: one measurement per R
    seed: int = 0
    temperature: float = 0.0
    # --engine vllm only (bench/workloads.py): the load's shape, and vLLM's prefix caching for both
    # models' servers ("on": vLLM's default)
    workload: str = "random"
    prefixes: int = 6
    prefix_len: int = 1200
    turns: int = 4
    prefix_caching: str = "on"

    def check(self) -> None:
        if not self.runs:
            raise UserError("give at least one RUN")
        if self.requests < 1 or self.prompt_len < 1 or self.output_len < 1:
            raise UserError("--requests, --prompt-len and --output-len must be >= 1")
        if not 0 <= self.len_spread < 1:
            raise UserError(f"--len-spread must be in [0, 1) (got {self.len_spread})")
        if not self.rate > 0:
            raise UserError(f"--rate must be > 0 requests/s (or inf) (got {self.rate})")
        if self.concurrency is not None and self.concurrency < 1:
            raise UserError(f"--concurrency must be >= 1 (got {self.concurrency})")
        if len(set(self.concept_ratios)) != len(self.concept_ratios):
            raise UserError("--concept-ratios lists a ratio twice")
        if self.workload not in WORKLOADS:
            raise UserError(f"--workload must be one of {', '.join(WORKLOADS)} (got {self.workload!r})")
        if self.prefix_caching not in ("on", "off"):
            raise UserError(f"--prefix-caching must be on or off (got {self.prefix_caching!r})")


def make_requests(ids: list[int], s: ServeBenchSettings) -> list[dict]:
    """The benchmark's requests: prompts cut from ``ids`` at seeded offsets, lengths drawn."""
    rng = random.Random(s.seed)

    def draw(n: int) -> int:
        return max(1, round(n * (1 + rng.uniform(-s.len_spread, s.len_spread))))
    out = []
    for _ in range(s.requests):
        p, o = draw(s.prompt_len), draw(s.output_len)
        if len(ids) <= p:
            raise UserError(f"the held-out text has {len(ids)} tokens, fewer than a prompt of {p}")
        start = rng.randrange(0, len(ids) - p)
        out.append({"prompt": ids[start:start + p], "max_tokens": o})
    return out


def start_server(run: str, s: ServeBenchSettings, max_model_len: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    if s.threads:
        env["OMP_NUM_THREADS"] = str(s.threads)
    cmd = [sys.executable, "-m", "conceptmoe", "serve", run, "--port", "0", "--kv-cache-mb", str(s.kv_cache_mb),
           "--max-batch", str(s.max_batch), "--max-waiting", str(s.requests + 1), "--dtype", s.dtype,
           "--device", s.device, "--max-model-len", str(max_model_len), "--grace", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r" at (http://\S+)", line)
    if not m:
        err = proc.communicate(timeout=60)[1].strip().splitlines()
        raise UserError(f"the server for {run} did not start: {err[-1] if err else line.strip()}")
    return proc, m.group(1)


async def _one(http: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    summary = usage = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise UserError(f"a request failed with {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            e = json.loads(line[6:])
            if "error" in e:
                raise UserError(f"a request failed: {e['error']['message']}")
            k = (e.get("conceptmoe") or {}).get("tokens", 0)
            if k:
                now = time.perf_counter()
                first = first or now
                last, n = now, n + k
            if e.get("usage"):
                usage, summary = e["usage"], (e.get("conceptmoe") or {}).get("summary")
    return {"ttft": (first or t0) - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
            "latency": time.perf_counter() - t0, "usage": usage, "summary": summary}


async def _drive(url: str, reqs: list[dict], s: ServeBenchSettings, extra: dict) -> tuple[list[dict], float]:
    rng = random.Random(s.seed + 1)
    sem = asyncio.Semaphore(s.concurrency or len(reqs))
    limits = httpx.Limits(max_connections=len(reqs) + 1, max_keepalive_connections=len(reqs) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await _one(http, {**reqs[0], "max_tokens": 2, "stream": True, "ignore_eos": True, **extra})  # warm-up

        async def send(body, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await _one(http, body)
        t, delays = 0.0, []
        for _ in reqs:
            delays.append(t)
            if s.rate != float("inf"):
                t += rng.expovariate(s.rate)
        t0 = time.perf_counter()
        body = {"stream": True, "ignore_eos": True, "temperature": s.temperature, "seed": s.seed, **extra}
        results = await asyncio.gather(*(send({**r, **body}, d) for r, d in zip(reqs, delays)))
        return results, time.perf_counter() - t0


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set (Linux ``VmHWM``) in bytes; None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    q = sorted(xs)
    pick = lambda f: q[min(len(q) - 1, int(round(f * (len(q) - 1))))]  # noqa: E731
    return {"mean": statistics.fmean(q), "p50": pick(0.5), "p99": pick(0.99)}


def measure(url: str, label: str, reqs: list[dict], s: ServeBenchSettings, extra: dict) -> dict:
    """One fresh server's figures (its peak of concurrent rows counts this run and the warm-up only)."""
    results, wall = asyncio.run(_drive(url, reqs, s, extra))
    after = httpx.get(url + "/health", timeout=30).json()
    out_tokens = sum(r["tokens"] for r in results)
    summaries = [r["summary"] for r in results if r["summary"]]
    fed = sum(x["tokens_fed"] for x in summaries)
    kv = sum(x["kv_bytes"] for x in summaries)
    concepts = sum(x.get("concepts", 0) for x in summaries)
    return {"label": label, "requests": len(results), "seconds": wall, "request_throughput": len(results) / wall,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "ttft_s": _stats([r["ttft"] for r in results]),
            "tpot_s": _stats([r["tpot"] for r in results if r["tpot"] is not None]),
            "peak_concurrent": after["peak_running"],
            "peak_kv_tensor_bytes": after.get("peak_kv_tensor_bytes"), "peak_kv_ledger_bytes": after.get("peak_bytes_used"),
            "kv_budget_bytes": after.get("bytes_budget"),
            "preempted_rows": sum(x.get("preemptions", 0) for x in summaries),
            "kv_bytes_per_token": kv / fed if fed else None,
            "compression": fed / concepts if concepts else 1.0, **extra}


def run_label(run: str) -> str:
    """The run's folder name; with its parent for compare's ``LABEL/seedN`` folders."""
    p = Path(os.path.normpath(run)).resolve()
    return f"{p.parent.name}/{p.name}" if p.name.startswith("seed") else p.name


def run_serve_bench(s: ServeBenchSettings, held_out: list[int]) -> dict:
    """``held_out``: the first run's held-out token ids, which the prompts are cut from."""
    from ..training.checkpoint import load_run_meta

    s.check()
    metas = [load_run_meta(r) for r in s.runs]
    if any(m[1].to_str() != metas[0][1].to_str() for m in metas):
        raise UserError("the runs have different tokenizers: the same requests cannot be sent to all of them")
    reqs = make_requests(held_out, s)
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in reqs) + 2
    rows = []
    for run in s.runs:
        cfg = load_run_meta(run)[0]
        for label, R in points(run, cfg, s):  # a fresh server each: its peak of concurrent rows is this measurement's
            print(f"bench serve: {label}: {len(reqs)} requests ...", file=sys.stderr, flush=True)
            proc, url = start_server(run, s, max_len)
            try:
                row = measure(url, label, reqs, s, {"concept_ratio": R} if R else {})
                row["peak_rss_bytes"] = peak_rss(proc.pid)
            finally:
                proc.terminate()
                proc.communicate(timeout=60)
            row.update(run=run, kind=cfg.kind)
            rows.append(row)
    return {"settings": asdict(s), "machine": machine(), "rows": rows}


def points(run: str, cfg, s: ServeBenchSettings) -> list[tuple[str, float | None]]:
    """(label, R) of each measurement of ``run``: one per --concept-ratios for an elastic run, else
    one at its own R (None)."""
    ratios = s.concept_ratios if (cfg.is_concept and cfg.elastic_ratios and s.concept_ratios) else [None]
    return [(run_label(run) + (f" R={R:g}" if R else ""), R) for R in ratios]


def format_table(report: dict) -> str:
    rows = report["rows"]
    base = rows[0]
    head = ("| run | req/s | out tok/s | vs first | TTFT mean / p50 / p99 (s) | TPOT mean / p50 / p99 (ms) "
            "| peak seqs | KV B/token | compression | peak KV ledger / tensors (MiB) | peak RSS (MiB) |")
    lines = [head, "|" + "---|" * 11]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    for r in rows:
        t, p = r["ttft_s"], r["tpot_s"]
        tp = " / ".join("-" if v is None else f"{1000 * v:.1f}" for v in (p["mean"], p["p50"], p["p99"]))
        kvb = "-" if r["kv_bytes_per_token"] is None else f"{r['kv_bytes_per_token']:.0f}"
        lines.append(f"| {r['label']} | {r['request_throughput']:.2f} | {r['output_tokens_per_s']:.1f} "
                     f"| {r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x "
                     f"| {t['mean']:.2f} / {t['p50']:.2f} / {t['p99']:.2f} | {tp} | {r['peak_concurrent']} "
                     f"| {kvb} | {r['compression']:.2f} | {mib(r.get('peak_kv_ledger_bytes'))} / "
                     f"{mib(r.get('peak_kv_tensor_bytes'))} | {mib(r.get('peak_rss_bytes'))} |")
    m = report["machine"]
    lines.append(f"\n{m['cpu_model']} ({m['cpu_count']} cores; {', '.join(m['cpu_flags'])}; bf16: {m['cpu_bf16']}); KV budget "
                 f"{report['settings']['kv_cache_mb']:g} MiB, {report['settings']['dtype']}")
    return "\n".join(lines)
