"""``conceptmoe bench serve --engine vllm``: the same load against vLLM servers, runs side by side.

The requests are ``bench/serve.py``'s (prompts cut from the first run's held-out text, EOS
ignored, all at once or at a Poisson rate). Each run is served by ``conceptmoe serve RUN --engine
vllm`` with the same ``--kv-cache-mb`` (vLLM's ``--kv-cache-memory-bytes``): a MoE run as its
transformers family, a ConceptMoE through the plugin with its concept KV cache at concept rate.
Servers are measured interleaved (``run_vllm_serve_bench``). Per run: request throughput, output
tokens/s, TTFT and TPOT (mean, p50, p99) from the streamed chunks, the peak and mean number of
requests vLLM ran at once (``vllm:num_requests_running``, polled every 50 ms; the mean over the
samples with any running), its preemptions, and its KV-cache capacity in tokens as its own start-up
line states it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ..device import machine
from ..errors import UserError
from .serve import ServeBenchSettings, _stats, make_requests, points
from .workloads import chat_turns, longest, shared_prefix_requests

READY = re.compile(r"^serving .* with vLLM at ", re.M)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(url: str, name: str, http: httpx.Client | None = None) -> float:
    """A counter or gauge from the server's /metrics, summed over its labels."""
    text = (http or httpx).get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


def start(run: str, s: ServeBenchSettings, max_len: int, vllm_args: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = dict(os.environ)
    if s.threads:
        env["OMP_NUM_THREADS"] = str(s.threads)
    cmd = [sys.executable, "-m", "conceptmoe", "serve", run, "--engine", "vllm", "--port", str(port),
           "--kv-cache-mb", str(s.kv_cache_mb), "--max-batch", str(s.max_batch), "--dtype", s.dtype,
           "--device", s.device, "--max-model-len", str(max_len), "--vllm-args", vllm_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while not READY.search(log.read_text()):
        if proc.poll() is not None:
            lines = log.read_text().strip().splitlines()
            why = [ln for ln in lines if re.search(r"Error|error:", ln) and "its log is above" not in ln]
            print("\n".join(lines[-15:]), file=sys.stderr)
            raise UserError(f"vLLM for {run} did not start: {(why or lines or [proc.returncode])[-1]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


async def _one(http: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n, ids = 0, []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise UserError(f"a request failed with {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            e = json.loads(line[6:])
            for c in e.get("choices") or []:
                k = len(c.get("token_ids") or [])
                if k:
                    now = time.perf_counter()
                    first = first or now
                    last, n = now, n + k
                    ids += c["token_ids"]
    return {"ttft": (first or t0) - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n, "ids": ids}


async def _drive(url: str, reqs: list[dict], s: ServeBenchSettings, extra: dict) -> tuple[list[dict], float]:
    import random

    rng = random.Random(s.seed + 1)
    sem = asyncio.Semaphore(s.concurrency or len(reqs))
    limits = httpx.Limits(max_connections=len(reqs) + 1, max_keepalive_connections=len(reqs) + 1)
    body = {"stream": True, "ignore_eos": True, "temperature": s.temperature, "seed": s.seed, "return_token_ids": True,
            **extra}
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        first = {"prompt": reqs[0]["turns"][0]} if "turns" in reqs[0] else {"prompt": reqs[0]["prompt"]}
        await _one(http, {**first, **body, "max_tokens": 2})  # warm-up (a prefix it caches is every run's)

        async def send(r, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await _one(http, {**r, **body})
        t, delays = 0.0, []
        for _ in reqs:
            delays.append(t)
            if s.rate != float("inf"):
                t += rng.expovariate(s.rate)
        async def talk(turns, delay):  # a conversation: each turn resends it so far, after the last answer
            await asyncio.sleep(delay)
            async with sem:
                history, done = [], []
                for new in turns:
                    done.append(await _one(http, {"prompt": history + new, "max_tokens": s.output_len, **body}))
                    history = history + new + done[-1]["ids"]
                return done
        t0 = time.perf_counter()
        if reqs and "turns" in reqs[0]:
            results = [r for c in await asyncio.gather(*(talk(r["turns"], d) for r, d in zip(reqs, delays))) for r in c]
        else:
            results = await asyncio.gather(*(send({k: v for k, v in r.items() if k != "prefix"}, d)
                                             for r, d in zip(reqs, delays)))
        return results, time.perf_counter() - t0


SETTLE_S = 2.0  # vLLM's engine busy-polls its worker for 1 s after its last step (shm_broadcast's SpinCondition)
POLL_S = 0.2  # how often a load's running requests are sampled


def measure(url: str, label: str, reqs: list[dict], s: ServeBenchSettings, extra: dict | None = None,
            running: bool = True) -> dict:
    """One load on one server. It starts ``SETTLE_S`` after the last: until then the server measured
    before still spins on a core, and a short measurement (one prompt alone) would share the
    machine with it. ``running``: sample the running requests every ``POLL_S`` (each sample costs
    the server and this client a few ms of CPU: polled every 50 ms, as before, it took a third of
    a core of two and made a 4K prompt's TTFT 40% longer); a prompt measured alone is not sampled."""
    time.sleep(SETTLE_S)
    samples, stop = [], threading.Event()

    def poll():
        if not running:
            return
        with httpx.Client() as http:
            while not stop.wait(POLL_S):
                try:
                    samples.append(int(_metric(url, "vllm:num_requests_running", http)))
                except httpx.HTTPError:
                    pass
    before = _metric(url, "vllm:num_preemptions_total")
    cache = [_metric(url, f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits")]
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        results, wall = asyncio.run(_drive(url, reqs, s, extra or {}))
    finally:
        stop.set()
        poller.join(5)
    out = sum(r["tokens"] for r in results)
    return {"label": label, "engine": "vllm", "requests": len(results), "seconds": wall,
            "request_throughput": len(results) / wall, "output_tokens": out, "output_tokens_per_s": out / wall,
            "ttft_s": _stats([r["ttft"] for r in results]),
            "tpot_s": _stats([r["tpot"] for r in results if r["tpot"] is not None]),
            "peak_concurrent": max(samples, default=0), "mean_concurrent": _mean_running(samples),
            "preemptions": _metric(url, "vllm:num_preemptions_total") - before,
            "prefix_cache_hit_rate": _hit_rate(url, cache)}


def _hit_rate(url: str, before: list[float]) -> float | None:
    """Prefix-cache hits over lookups, in tokens, during the load (None: nothing looked up: caching off)."""
    queries, hits = (_metric(url, f"vllm:prefix_cache_{k}_total") - b for k, b in zip(("queries", "hits"), before))
    return hits / queries if queries > 0 else None


def load_requests(held_out: list[int], s: ServeBenchSettings) -> list[dict]:
    """The load's requests (``workloads.py``); a chat's are its conversations (``turns``)."""
    if s.workload == "shared-prefix":
        return shared_prefix_requests(held_out, s.requests, s.prefixes, s.prefix_len, s.prompt_len, s.output_len,
                                      s.seed)
    if s.workload == "chat":
        return [{"turns": c} for c in chat_turns(held_out, s.requests, s.turns, s.prompt_len, s.seed)]
    return make_requests(held_out, s)


def caching_args(s: ServeBenchSettings) -> str:
    """vLLM's flag for prefix caching, for both models' servers: none where ``--prefix-caching on``
    (vLLM's default, and ``conceptmoe serve --engine vllm``'s: the concept side's is ``prefix.py``)."""
    return "" if s.prefix_caching == "on" else " --no-enable-prefix-caching"


def _mean_running(samples: list[int]) -> float:
    """Requests running, averaged over the samples taken while any ran (the warm-up's and the
    tail's empty samples left out): how many sequences the engine held at once, on average."""
    live = [n for n in samples if n > 0]
    return sum(live) / len(live) if live else 0.0


def median_repeat(rows: list[dict]) -> dict:
    """The repeat with the median output tokens/s (its TTFT, TPOT and running figures go together),
    every repeat's headline figures beside it."""
    row = sorted(rows, key=lambda r: r["output_tokens_per_s"])[(len(rows) - 1) // 2]
    keys = ("output_tokens_per_s", "mean_concurrent", "peak_concurrent", "preemptions", "seconds")
    return {**row, "repeats": [{k: r[k] for k in keys} for r in rows]}


def run_vllm_serve_bench(s: ServeBenchSettings, held_out: list[int], vllm_args: str = "", repeats: int = 1) -> dict:
    """Every server started first (one at a time: start-up compiles), then the load sent to each in
    turn, ``repeats`` rounds: the servers are measured interleaved, so a drift of the machine's
    speed (seen here: 30% between runs minutes apart) falls on all of them alike. An idle vLLM
    server stops polling within a second (``measure`` waits that out first), so the one under load
    has the cores."""
    from ..training.checkpoint import load_run_meta

    s.check()
    reqs = load_requests(held_out, s)
    max_len = longest(reqs, s.output_len)  # vLLM refuses more than the model's positions
    servers = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for run in s.runs:
                cfg = load_run_meta(run)[0]
                for label, R in points(run, cfg, s):  # a server each, as bench/serve.py
                    print(f"bench serve (vLLM): starting {label} ...", file=sys.stderr, flush=True)
                    log = Path(tmp) / f"server-{len(servers)}.log"
                    proc, url = start(run, s, max_len, vllm_args + caching_args(s), log)
                    servers.append((run, cfg, label, R, proc, url, log))
            measured: list[list[dict]] = [[] for _ in servers]
            for i in range(repeats):
                for (run, cfg, label, R, proc, url, log), got in zip(servers, measured):
                    print(f"bench serve (vLLM): {label}: {len(reqs)} requests (round {i + 1} of {repeats}) ...",
                          file=sys.stderr, flush=True)
                    got.append(measure(url, label, reqs, s, {"vllm_xargs": {"concept_ratio": R}} if R else {}))
        finally:
            for *_, proc, _url, _log in servers:
                proc.terminate()
            for *_, proc, _url, _log in servers:
                proc.wait(120)
        rows = []
        for (run, cfg, label, R, proc, url, log), got in zip(servers, measured):
            row = median_repeat(got)
            m = re.search(r"KV cache size: ([0-9,]+) tokens", log.read_text())
            row.update(run=run, kind=cfg.kind, kv_cache_tokens=int(m.group(1).replace(",", "")) if m else None,
                       prefix_caching=s.prefix_caching == "on")
            rows.append(row)
    return {"settings": {**s.__dict__, "engine": "vllm", "vllm_args": vllm_args, "repeats": repeats,
                         "interleaved": True}, "machine": machine(), "rows": rows}


def format_table(report: dict) -> str:
    rows, base = report["rows"], report["rows"][0]
    n = report["settings"].get("repeats", 1)
    tok_s = f"out tok/s (median of {n}; min–max)" if n > 1 else "out tok/s"
    lines = [f"| run (vLLM) | req/s | {tok_s} | vs first | TTFT mean / p50 / p99 (s) | TPOT mean / p50 / p99 (ms) "
             "| running peak / mean | preemptions | KV cache (tokens) | prefix-cache hits |", "|" + "---|" * 10]
    for r in rows:
        t, p = r["ttft_s"], r["tpot_s"]
        tp = " / ".join("-" if v is None else f"{1000 * v:.1f}" for v in (p["mean"], p["p50"], p["p99"]))
        spread = [x["output_tokens_per_s"] for x in r.get("repeats", [])]
        span = f" ({min(spread):.0f}–{max(spread):.0f})" if len(spread) > 1 else ""
        lines.append(f"| {r['label']} | {r['request_throughput']:.2f} | {r['output_tokens_per_s']:.1f}{span} "
                     f"| {r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x "
                     f"| {t['mean']:.2f} / {t['p50']:.2f} / {t['p99']:.2f} | {tp} "
                     f"| {r['peak_concurrent']} / {r.get('mean_concurrent', 0):.1f} "
                     f"| {r['preemptions']:.0f} | {r['kv_cache_tokens'] or '-'} | {_hits(r)} |")
    st = report["settings"]
    load = {"shared-prefix": f"; {st.get('prefixes')} shared prefixes of {st.get('prefix_len')} tokens",
            "chat": f"; chat, {st.get('turns')} turns a conversation"}.get(st.get("workload", "random"), "")
    m = report["machine"]
    lines.append(f"\n{m['cpu_model']} ({m['cpu_count']} cores; {', '.join(m['cpu_flags'])}; bf16: {m['cpu_bf16']}); "
                 f"KV budget {report['settings']['kv_cache_mb']:g} MiB, {report['settings']['dtype']}{load}")
    return "\n".join(lines)


def _hits(row: dict) -> str:
    if not row.get("prefix_caching"):
        return "off"
    rate = row.get("prefix_cache_hit_rate")
    return "-" if rate is None else f"{100 * rate:.0f}%"
