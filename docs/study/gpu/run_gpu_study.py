"""The study on one GPU in a fixed time: measure, size the budget, train both models, time them.

Issue 44 ("ready for a GPU"). On one GPU for ``--minutes`` (default 10):

1. ``conceptmoe bench train --router`` measures the training tokens/s of the MoE and the default
   ConceptMoE at ``--seq-len``, the ConceptMoE's concept count changing from step to step as in
   training (written down first: ``speed/train.json``);
2. the token budget is sized so that both models train, one after the other, in the
   ``--train-share`` of the time (default 60%), rounded down to whole batches;
3. ``conceptmoe compare`` trains both on the same batches (paired seed) and evaluates them;
4. ``conceptmoe bench latency --input held-out`` times prefill and decode of both trained models
   at ``--latency-lens`` (default 4K-64K tokens, the paper's Fig. 5 trend);
5. ``summary.json`` and ``summary.md`` hold the figures: tokens/s, budget, held-out BPB of each
   model, the gap, realised compression, prefill and decode times and the KV ratio.

    python docs/study/gpu/run_gpu_study.py --out runs/gpu-study              # on the GPU machine
    python docs/study/gpu/run_gpu_study.py --out /tmp/g --tiny --device cpu  # the CPU check (~1 min)

``--tiny`` shrinks everything (tiny preset, short sequences, a few thousand tokens) so the whole
pipeline runs on a CPU in about a minute; ``tests/test_gpu_study.py`` runs it that way.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path


def sh(args: list[str], log: Path, fatal: bool = True) -> int:
    """Run ``conceptmoe ARGS``; its output goes to ``log``. A failure stops the study with its tail
    (``fatal``), or is returned (the latency step: the trained models' records stand without it)."""
    cmd = [sys.executable, "-m", "conceptmoe", *args]
    print("+ conceptmoe " + " ".join(args), flush=True)
    with open(log, "a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        tail = log.read_text().splitlines()[-5:]
        msg = f"error: conceptmoe {' '.join(args[:2])} failed ({r.returncode}); last lines of {log}:\n" + "\n".join(tail)
        if fatal:
            sys.exit(msg)
        print(msg, file=sys.stderr, flush=True)
    return r.returncode


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (logs, runs, summary.json, summary.md)")
    p.add_argument("--minutes", type=float, default=10.0, help="the whole study's time (default 10)")
    p.add_argument("--train-share", type=float, default=0.6, help="share of the time for training (default 0.6)")
    p.add_argument("--device", default="cuda", help="default cuda")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="default bf16")
    p.add_argument("--data", default="python-stdlib", help="default python-stdlib")
    p.add_argument("--preset", default="small", help="MoE baseline preset (default small)")
    p.add_argument("--seq-len", type=int, default=2048, help="training sequence length (default 2048)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-lens", default="4096,8192,16384,32768,65536", help="prefill / KV lengths")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap the budget per model (e.g. a few epochs of the data: past that a held-out "
                        "comparison measures memorising)")
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny preset, short sequences, a few batches")
    a = p.parse_args()
    if a.tiny:
        a.preset, a.seq_len, a.batch_size, a.latency_lens = "tiny", 64, 4, "128,256"
    if not (a.minutes > 0 and 0 < a.train_share < 1):
        p.error("--minutes must be > 0 and --train-share in (0, 1)")
    return a


def main() -> int:
    a = parse()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log, t0 = out / "log.txt", time.monotonic()
    common = ["--device", a.device]
    # 1. speed first
    sh(["bench", "train", "--router", "--preset", a.preset, "--seq-lens", str(a.seq_len), "--tokens",
        str(a.batch_size * a.seq_len), "--repeats", "2" if a.tiny else "3", "--dtype", a.dtype,
        "--out", str(out / "speed")] + common + (["--threads", "1"] if a.tiny else []), log)
    speed = json.loads((out / "speed" / "train.json").read_text())
    tps = {("moe" if r["model"].startswith("MoE") else "cm"): r["tokens_per_s"] for r in speed["rows"]}
    # 2. the budget: both models in the training share of what is left, whole batches
    left = a.minutes * 60 - (time.monotonic() - t0)
    train_s = max(left * a.train_share, 1.0)
    batch_tokens = a.batch_size * a.seq_len
    tokens = train_s / (1 / tps["moe"] + 1 / tps["cm"])
    tokens = max(batch_tokens, math.floor(tokens / batch_tokens) * batch_tokens)
    if a.tiny:
        tokens = min(tokens, 8 * batch_tokens)
    if a.max_tokens:
        tokens = max(batch_tokens, min(tokens, a.max_tokens // batch_tokens * batch_tokens))
    budget = {"tokens_per_s": tps, "train_seconds": train_s, "tokens": tokens, "batch_tokens": batch_tokens,
              "max_tokens": a.max_tokens}
    (out / "budget.json").write_text(json.dumps(budget, indent=2) + "\n")
    print(f"budget: {tokens:,} tokens per model (MoE {tps['moe']:.0f} tok/s, ConceptMoE {tps['cm']:.0f} tok/s)")
    # 3. both models on the same batches, evaluated
    cmp_dir = out / "compare"
    sh(["compare", "--preset", a.preset, "--data", a.data, "--tokens", str(tokens), "--seeds", str(a.seed),
        "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--dtype", a.dtype,
        "--out", str(cmp_dir)] + common, log)
    report = json.loads((cmp_dir / "report.json").read_text())
    # 4. latency of the trained models on their held-out text
    moe_run, cm_run = cmp_dir / "moe" / f"seed{a.seed}", cmp_dir / "topk-R2" / f"seed{a.seed}"
    rc = sh(["bench", "latency", "--input", "held-out", "--preset", a.preset, "--run", str(moe_run), "--run", str(cm_run), "--strategies",
        "topk", "--prefill-lens", a.latency_lens, "--kv-lens", a.latency_lens, "--batch", "1" if a.tiny else "4",
        "--repeats", "1" if a.tiny else "2", "--decode-steps", "4" if a.tiny else "16", "--dtype", a.dtype,
        "--out", str(out / "latency")] + common + (["--threads", "1"] if a.tiny else []), log, fatal=False)
    latency_file = out / "latency" / "latency.json"
    latency = json.loads(latency_file.read_text()) if rc == 0 and latency_file.exists() else None
    # 5. the summary
    write_summary(out, a, budget, report, latency, speed.get("machine"), time.monotonic() - t0)
    print(f"done in {time.monotonic() - t0:.0f} s: {out / 'summary.md'}")
    return 0 if latency is not None else 1


def trained_rows(latency: dict, key: str, length: str) -> list[tuple[int, dict, dict]]:
    """(length, MoE row, ConceptMoE row) of the two trained runs (named ``...[seedN]``) per length."""
    rows = [r for r in latency[key] if r["model"].endswith("]")]
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(r[length], []).append(r)
    return [(n, rs[0], rs[1]) for n, rs in sorted(by_len.items()) if len(rs) == 2]


def write_summary(out: Path, a, budget: dict, report: dict, latency: dict | None, machine: dict | None,
                  seconds: float) -> None:
    moe, cm = report["models"][0], report["models"][1]
    summary = {"device": a.device, "machine": machine, "dtype": a.dtype, "data": a.data, "preset": a.preset,
               "seq_len": a.seq_len, "batch_size": a.batch_size, "seed": a.seed, "seconds": seconds,
               "tokens_per_model": budget["tokens"], "tokens_per_s": budget["tokens_per_s"],
               "moe": {"name": moe["name"], "val_bpb": moe["val_bpb"], "train_tokens_per_s": moe["train_tokens_per_s"]},
               "conceptmoe": {"name": cm["name"], "val_bpb": cm["val_bpb"], "compression": cm["compression"],
                              "train_tokens_per_s": cm["train_tokens_per_s"]},
               "gap_bpb": cm["val_bpb"] - moe["val_bpb"], "latency": latency}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    gpu = (machine or {}).get("gpu") or (machine or {}).get("cpu_model") or a.device
    lines = [f"# GPU study: {gpu}, {a.dtype}, {a.data}, {a.preset} preset, seq {a.seq_len}, seed {a.seed}", "",
             f"Measured first (bench train): MoE {budget['tokens_per_s']['moe']:.0f} tok/s, ConceptMoE "
             f"{budget['tokens_per_s']['cm']:.0f} tok/s; budget {budget['tokens']:,} tokens per model "
             f"(batch {a.batch_size} x {a.seq_len}); the whole study took {seconds:.0f} s.", "",
             "| model | held-out BPB | compression | train tokens/s (in compare) |", "|---|---|---|---|",
             f"| {moe['name']} | {moe['val_bpb']:.4f} | 1.00 | {moe['train_tokens_per_s']:.0f} |",
             f"| {cm['name']} | {cm['val_bpb']:.4f} ({summary['gap_bpb']:+.4f}) | {cm['compression']:.2f} | "
             f"{cm['train_tokens_per_s']:.0f} |", ""]
    if latency is None:
        lines += ["Latency: the bench failed (log.txt has its output).", ""]
    else:
        lines += ["Latency of the two trained models on their held-out text (medians, seconds; "
                  "ConceptMoE / MoE below 1 is faster):", "",
                  "| tokens | prefill MoE | prefill ConceptMoE | ratio | decode step MoE (KV = tokens) | "
                  "decode step ConceptMoE | ratio | KV bytes ConceptMoE / MoE |", "|---|---|---|---|---|---|---|---|"]
        dec = {n: (m, c) for n, m, c in trained_rows(latency, "decode", "kv_len")}
        for n, m, c in trained_rows(latency, "prefill", "tokens"):
            dm, dc = dec.get(n, (None, None))
            d = (f"{dm['median_s']:.4f} | {dc['median_s']:.4f} | {dc['median_s'] / dm['median_s']:.2f} | "
                 f"{dc['kv_bytes'] / dm['kv_bytes']:.3f}") if dm else "- | - | - | -"
            lines.append(f"| {n} | {m['median_s']:.4f} | {c['median_s']:.4f} | {c['median_s'] / m['median_s']:.2f} | {d} |")
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
