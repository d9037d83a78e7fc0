"""Benchmark of ``conceptmoe prepare``: throughput and peak memory as the corpus grows.

    conceptmoe bench prepare --sizes 50,200 --out bench_out/prepare

For each size a synthetic ``.jsonl`` corpus (lines of Shakespeare's plays in seeded random
documents of 2 to 200 lines, so both the tail and the whole-document rule of the held-out split
apply) is prepared in a fresh process, with one tokenizer trained beforehand on a 4 MB sample so
that the timing covers reading, splitting, encoding and writing only. Reported: seconds, MB/s of
UTF-8 text, cores busy (CPU seconds over wall seconds: the tokenizer's threads), and the
process's peak RSS, total and above what it held after its imports (torch among them). The
streaming contract is that the peak does not grow with the corpus (prepare.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from ..data.corpus import play_files
from ..device import machine
from ..data.tokenizer import train_tokenizer
from ..files import write_text

SAMPLE_CHARS = 4_000_000  # tokenizer training sample
_CHILD = """
import json, resource, sys, time
from conceptmoe.data.prepare import PrepareConfig, prepare
from conceptmoe.data.shards import open_prepared
def rss_kb():  # resident now (Linux); elsewhere the peak so far
    try:
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = resource.getrusage(resource.RUSAGE_SELF)
base, cpu0 = rss_kb(), start.ru_utime + start.ru_stime
t = time.perf_counter()
prepare(PrepareConfig(data=sys.argv[1], out=sys.argv[2], tokenizer=sys.argv[3], force=True, progress=False))
seconds = time.perf_counter() - t
m = open_prepared(sys.argv[2]).manifest
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": seconds, "peak_rss_kb": use.ru_maxrss, "cpu_seconds": use.ru_utime + use.ru_stime - cpu0,
                  "import_rss_kb": base, "dtype": m["dtype"],
                  "bytes": sum(s["bytes"] for s in m["splits"].values()),
                  "tokens": sum(s["tokens"] for s in m["splits"].values())}))
"""


def make_corpus(path: Path, mb: float, seed: int = 0) -> Path:
    """A ``.jsonl`` corpus of about ``mb`` million characters of play lines."""
    lines = [ln for f in play_files() for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    rng = random.Random(seed)
    chars = 0
    with open(path, "w", encoding="utf-8") as f:
        while chars < mb * 1e6:
            text = "\n".join(rng.choices(lines, k=rng.choice((2, 10, 40, 200))))
            f.write(json.dumps({"text": text}) + "\n")
            chars += len(text)
    return path


def _sample(path: Path) -> list[str]:
    out, chars = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["text"])
            chars += len(out[-1])
            if chars >= SAMPLE_CHARS:
                break
    return out


def run_prepare_bench(sizes_mb: list[float], work: Path, vocab_size: int = 4096, threads: int = 0,
                      log=print) -> dict:
    """Prepare a synthetic corpus of each size in a fresh process; one row per size."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)  # the tokenizers library's thread pool
    rows, tok_path = [], work / "tokenizer.json"
    for mb in sizes_mb:
        data = work / f"corpus-{mb:g}mb.jsonl"
        if not data.exists():
            log(f"writing {data} ...")
            make_corpus(data, mb)
        if not tok_path.exists():
            train_tokenizer(_sample(data), vocab_size).save(str(tok_path))
        log(f"preparing {mb:g} MB ...")
        r = subprocess.run([sys.executable, "-c", _CHILD, str(data), str(work / f"prepared-{mb:g}mb"), str(tok_path)],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"prepare of {data} failed: {r.stderr.strip().splitlines()[-1:]}")
        res = json.loads(r.stdout)
        rows.append({"corpus_mb": mb, "text_mb": res["bytes"] / 1e6, "tokens": res["tokens"], "dtype": res["dtype"],
                     "seconds": res["seconds"], "mb_per_s": res["bytes"] / 1e6 / res["seconds"],
                     "cores_busy": res["cpu_seconds"] / res["seconds"],
                     "peak_rss_mb": res["peak_rss_kb"] / 1024,
                     "rss_over_imports_mb": (res["peak_rss_kb"] - res["import_rss_kb"]) / 1024})
    return {"rows": rows, "vocab_size": vocab_size, "threads": threads or os.cpu_count(),
            "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()), "machine": machine()}


def format_table(result: dict) -> str:
    head = f"{'corpus':>8} {'tokens':>12} {'seconds':>8} {'MB/s':>6} {'cores':>5} {'peak RSS':>9} {'above imports':>14}"
    lines = [head] + [f"{r['corpus_mb']:>6g}MB {r['tokens']:>12,} {r['seconds']:>8.1f} {r['mb_per_s']:>6.2f} "
                      f"{r['cores_busy']:>5.2f} "
                      f"{r['peak_rss_mb']:>7.0f}MB {r['rss_over_imports_mb']:>12.0f}MB" for r in result["rows"]]
    lines.append(f"(tokenizer threads {result['threads']} of {result['cpu_count']} cores, "
                 f"load average {result['load_average'][0]:.1f} at the end)")
    return "\n".join(lines) + "\n"


def run_and_report(sizes_mb: list[float], out: str | None, work: str | None, vocab_size: int = 4096,
                   threads: int = 0) -> dict:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if work:
        result = run_prepare_bench(sizes_mb, Path(work), vocab_size, threads, log)
    else:
        with tempfile.TemporaryDirectory(prefix="conceptmoe-bench-prepare-") as tmp:
            result = run_prepare_bench(sizes_mb, Path(tmp), vocab_size, threads, log)
    print(format_table(result), end="")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / "prepare.json"
        write_text(path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result
