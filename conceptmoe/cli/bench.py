"""``conceptmoe bench latency | scan | moe | prepare | train | peak``: benchmarks that print a table and write JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ..bench.latency import LatencySettings, run_latency
from ..bench.latency_report import format_table, write_outputs
from ..bench.moe import ARCHS, TABLE_HEADER, TOLERANCE, require_transformers, write_rows
from ..bench.moe import compare as compare_moe
from ..bench.peak import format_table as format_peak_table
from ..bench.peak import measure_peak
from ..bench.prepare import run_and_report as run_prepare_bench
from ..bench.scan import run_and_report
from ..bench.train import format_profile
from ..bench.train import format_table as format_train_table
from ..bench.train import run_train_bench
from .bench_serve import register_bench as register_serve_bench
from .held_out import run_held_out_ids
from ..device import default_dtype, resolve_device
from ..errors import UserError
from ..files import write_json, write_text
from ..training.checkpoint import load_run


def _lengths(text: str) -> list[int]:
    """Comma-separated lengths >= 2, or 'none' for an empty list."""
    if text.strip().lower() == "none":
        return []
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or 'none', got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"lengths must be integers >= 2 (or 'none' to skip), got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {text!r}")
    if len(set(values)) != len(values):  # measured twice otherwise
        raise argparse.ArgumentTypeError(f"each value once, got {text!r}")
    return values


def _words(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks: latency and train (MoE vs ConceptMoE), serve (throughput at a KV budget), peak (matmul), scan, moe (vs transformers), prepare",
                            description="Benchmarks.")
    bench = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.required = True
    register_serve_bench(bench)
    lat = bench.add_parser("latency", help="prefill and decode latency: MoE vs matched ConceptMoE",
                           description="Prefill and per-token decode latency of the MoE baseline "
                                       "and compute-matched ConceptMoE models, interleaved, medians. "
                                       "Writes latency.json and latency.png to --out.")
    lat.add_argument("--prefill-lens", type=_lengths, default=[1024, 2048, 4096, 8192, 16384],
                     help="prompt lengths (default 1024,2048,4096,8192,16384; 'none' skips prefill)")
    lat.add_argument("--kv-lens", type=_lengths, default=[1024, 4096, 16384],
                     help="cached tokens for the decode benchmark (default 1024,4096,16384; 'none' skips)")
    lat.add_argument("--batch", type=int, default=8, help="decode batch rows (default 8)")
    lat.add_argument("--prefill-batch", type=int, default=1, help="prefill batch rows (default 1)")
    lat.add_argument("--preset", default="small", help="MoE baseline preset (default small)")
    lat.add_argument("--ratios", type=_floats, default=[2.0], help="compression ratios R (default 2)")
    lat.add_argument("--strategies", type=_words, default=["topk", "layers"],
                     help="compute-matching strategies: topk,layers,loop (default topk,layers)")
    lat.add_argument("--run", action="append", default=[], metavar="DIR",
                     help="also time a trained run (repeatable; its router is not calibrated)")
    lat.add_argument("--input", choices=["random", "held-out"], default="random",
                     help="prompts and decoded tokens: random ids (default), or the first --run's held-out "
                          "text, where a trained router places its boundaries as it does on text")
    lat.add_argument("--ratio", type=_floats, dest="run_ratios", default=[], metavar="R[,R...]",
                     help="elastic --run: the compression R to run it at (a comma list: one timed model per R; "
                          "default: its design ratio)")
    lat.add_argument("--extrapolate", action="store_true",
                     help="allow a --ratio outside the range an elastic --run was trained on (at most 2x beyond it)")
    lat.add_argument("--repeats", type=int, default=3, help="timed repeats per model and length (default 3)")
    lat.add_argument("--decode-steps", type=int, default=16, help="decode steps per repeat (default 16)")
    lat.add_argument("--threads", type=int, default=0,
                     help="torch threads (default: torch's choice; 1 is steadier on a shared CPU)")
    lat.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    lat.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                     help="weights, activations and caches in this precision (default: bf16 on CUDA and on "
                          "CPUs with AMX-BF16 / AVX512-BF16, else fp32)")
    lat.add_argument("--compile", action="store_true", help="torch.compile the dense modules of every block")
    lat.add_argument("--peak", metavar="FILE", help="the peak.json of `bench peak --out` (default: measure it now)")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--out", default="bench_out/latency", help="output directory (default bench_out/latency)")
    lat.set_defaults(func=cmd_bench_latency)

    moe = bench.add_parser("moe", help="our MoE block and model vs Hugging Face transformers",
                           description="Copy our weights into the Hugging Face OLMoE / Qwen2-MoE / "
                                       "Qwen3-MoE implementation (small random config, no download), "
                                       "check outputs agree within 1e-4 and compare forward and "
                                       "forward+backward time. Needs `pip install -e '.[hf]'`.")
    moe.add_argument("--arch", default="all", help="olmoe, qwen2_moe, qwen3_moe or all (default all)")
    moe.add_argument("--preset", default="small", help="sizes from this preset (default small)")
    moe.add_argument("--layers", type=int, default=2, help="layers of the model comparison (default 2)")
    moe.add_argument("--batch", type=int, default=2, help="batch rows (default 2)")
    moe.add_argument("--seq-len", type=int, default=512, help="tokens per row (default 512)")
    moe.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    moe.add_argument("--hf-experts", default=None,
                     help="Hugging Face experts implementation: eager or grouped_mm (default: its own default)")
    moe.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    moe.add_argument("--out", default=None, help="also write moe_bench.json into this directory")
    moe.set_defaults(func=cmd_bench_moe)

    p = bench.add_parser(
        "scan", help="dechunk EMA: parallel scan vs sequential loop",
        description="Time the parallel dechunk scan against the sequential loop (CONCEPTMOE.md §2.5).")
    p.add_argument("--concepts", type=int, default=4096, help="sequence length in concepts (default 4096)")
    p.add_argument("--dim", type=int, default=512, help="channels (default 512)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats, median reported (default 7)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--out", help="also write scan.json into this directory")
    p.set_defaults(func=cmd_bench_scan)

    p = bench.add_parser(
        "train", help="training step time: MoE vs compute-matched ConceptMoE",
        description="Forward and backward time of a training step of the MoE baseline and its "
                    "compute-matched ConceptMoE, interleaved, medians; prints a table, writes train.json.")
    p.add_argument("--preset", default="small", help="MoE baseline preset (default small)")
    p.add_argument("--ratios", type=_floats, default=[2.0], help="compression ratios R (default 2)")
    p.add_argument("--strategies", type=_words, default=["topk"], help="topk,layers,loop (default topk)")
    p.add_argument("--seq-lens", type=_lengths, default=[256, 2048], help="sequence lengths (default 256,2048)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step: batch = tokens / length (default 2048)")
    p.add_argument("--router", action="store_true",
                   help="let the untrained router choose the boundaries, with fresh noise every step as in "
                        "training (default: exactly T/R per row)")
    p.add_argument("--concept-bucket", type=int, default=None,
                   help="pad the number of concepts to a multiple of this (1: off; default: 64 on CUDA, "
                        "1 elsewhere, as training does)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats, median reported (default 5)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one step per model and length (torch.profiler): the top N operators "
                        "by self CPU time, forward and backward separately (default 0: off)")
    p.add_argument("--dtype", type=_words, default=None, metavar="fp32|bf16",
                   help="precision(s), comma-separated, timed side by side (default: bf16 on CPUs with "
                        "AMX-BF16 / AVX512-BF16, else fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (as train --compile)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda[:N] or auto")
    p.add_argument("--peak", metavar="FILE", help="the peak.json of `bench peak --out` (default: measure it now)")
    p.add_argument("--out", help="also write train.json into this directory")
    p.set_defaults(func=cmd_bench_train)

    p = bench.add_parser(
        "peak", help="measured matmul peak per dtype (fp32, bf16): the reference for MFU",
        description="Time torch.mm at large square shapes and at the shapes a training step of the "
                    "preset multiplies, in fp32 and bf16; the best rate per dtype is the peak that "
                    "every MFU figure (bench train, bench latency) is measured against.")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.add_argument("--preset", default="small", help="model shapes from this preset (default small)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the model shapes (default 2048)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per shape, about (default 0.3)")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds for the whole measurement, about (default 60): a shape that would not fit "
                        "its share (bf16 emulated on a CPU without AMX-BF16 / AVX512-BF16) is timed on fewer rows")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--out", help="also write peak.json into this directory")
    p.set_defaults(func=cmd_bench_peak)

    p = bench.add_parser(
        "prepare", help="conceptmoe prepare: MB/s and peak RSS as the corpus grows",
        description="Prepare synthetic .jsonl corpora of the given sizes, each in a fresh process with one "
                    "pre-trained tokenizer; print MB/s and peak RSS (flat when prepare streams).")
    p.add_argument("--sizes", type=_floats, default=[50.0, 200.0], help="corpus sizes in MB (default 50,200)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary (default 4096)")
    p.add_argument("--threads", type=int, default=0, help="tokenizer threads (default: all cores)")
    p.add_argument("--work", help="keep corpora and shards here (default: a temporary folder)")
    p.add_argument("--out", help="also write prepare.json into this directory")
    p.set_defaults(func=cmd_bench_prepare)


def cmd_bench_latency(args) -> int:
    def load(run_dir):
        return load_run(run_dir, args.device)[0]

    dtype = args.dtype or default_dtype(resolve_device(args.device))
    peak = (_read_peak(args.peak, (dtype,)) or {}).get(dtype)
    s = LatencySettings(preset=args.preset, ratios=args.ratios, strategies=args.strategies,
                        runs=args.run, run_ratios=args.run_ratios, extrapolate=args.extrapolate,
                        prefill_lens=args.prefill_lens, kv_lens=args.kv_lens,
                        batch=args.batch, prefill_batch=args.prefill_batch, repeats=args.repeats,
                        decode_steps=args.decode_steps, seed=args.seed, device=args.device,
                        threads=args.threads, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                        compile=args.compile, peak_gflops=peak, input=args.input)
    if s.run_ratios and not s.runs:
        raise UserError("--ratio applies to the elastic runs given with --run")
    if not s.prefill_lens and not s.kv_lens:
        raise UserError("nothing to do: both --prefill-lens and --kv-lens are empty")
    text_ids = None
    if s.input == "held-out":
        if not s.runs:
            raise UserError("--input held-out takes the held-out text of the first --run: give one")
        text_ids = run_held_out_ids(s.runs[0])
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    result = run_latency(s, load, log, text_ids)
    paths = write_outputs(result, args.out)
    print(format_table(result), end="")
    print(f"wrote {paths['json']} and {paths['plot']}")
    return 0


def cmd_bench_moe(args) -> int:
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    if any(a not in ARCHS for a in archs):
        raise UserError(f"unknown --arch {args.arch!r}; choose from {', '.join(ARCHS)} or all")
    if any(n < 1 for n in (args.layers, args.batch, args.seq_len, args.repeats)):
        raise UserError("--layers, --batch, --seq-len and --repeats must be >= 1")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _bench_moe(args, archs)
    finally:
        torch.set_num_threads(threads)


def _bench_moe(args, archs: list[str]) -> int:
    require_transformers()  # a one-line error when transformers is missing
    rows = []
    print(TABLE_HEADER)
    for arch in archs:
        for c in compare_moe(arch, args.preset, args.layers, args.batch, args.seq_len, args.repeats,
                             args.hf_experts):
            rows.append(c.to_dict())
            print(c.table_row(), flush=True)
    if args.out:
        print(f"wrote {write_rows(rows, args.out)}")
    bad = [r for r in rows if r["max_abs_diff"] > TOLERANCE]
    if bad:
        print(f"error: outputs differ by more than {TOLERANCE:g} for "
              f"{', '.join(r['arch'] + '/' + r['part'] for r in bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_scan(args: argparse.Namespace) -> int:
    if args.concepts < 1 or args.dim < 1 or args.repeats < 1 or args.batch < 1:
        raise UserError("--concepts, --dim, --batch and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    run_and_report(args.concepts, args.dim, args.batch, args.repeats, "cpu", args.out)
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.repeats < 1 or args.threads < 0 or args.profile < 0:
        raise UserError("--tokens and --repeats must be >= 1, --threads and --profile >= 0")
    if args.concept_bucket is not None and args.concept_bucket < 1:
        raise UserError(f"--concept-bucket must be >= 1 (got {args.concept_bucket})")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtypes = tuple(dict.fromkeys(args.dtype if args.dtype is not None else [default_dtype(device)]))
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        raise UserError(f"--dtype must be fp32, bf16 or fp32,bf16 (got {','.join(dtypes)})")
    res = run_train_bench(args.preset, tuple(args.ratios), tuple(args.strategies), tuple(args.seq_lens),
                          args.tokens, args.repeats, exact=not args.router, profile=args.profile,
                          dtypes=dtypes, compile=args.compile, peak=_read_peak(args.peak, dtypes),
                          device=str(device), concept_bucket=args.concept_bucket)
    print(format_train_table(res))
    if args.profile:
        print(format_profile(res))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "train.json", json.dumps(res, indent=2, allow_nan=False) + "\n")
        print(f"wrote {out / 'train.json'}")
    return 0


def cmd_bench_peak(args: argparse.Namespace) -> int:
    if args.threads < 0 or args.tokens < 1 or not args.min_time > 0:
        raise UserError("--threads must be >= 0, --tokens >= 1 and --min-time > 0")
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise UserError(f"--budget must be a number of seconds > 0 (got {args.budget})")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure_peak(preset=args.preset, tokens=args.tokens, device=str(resolve_device(args.device)),
                       min_time=args.min_time, budget=args.budget, progress=True)
    print(json.dumps(res, indent=2) if args.json else format_peak_table(res))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "peak.json", res)
        if not args.json:
            print(f"wrote {out / 'peak.json'}")
    return 0


def _read_peak(path: str | None, dtypes) -> dict[str, float] | None:
    """``peak_gflops`` of a ``bench peak`` result file, or None (measure it)."""
    if path is None:
        return None
    try:
        peak = json.loads(Path(path).read_text())["peak_gflops"]
        values = {d: float(peak[d]) for d in dtypes}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise UserError(f"--peak {path}: not a `conceptmoe bench peak` result with {', '.join(dtypes)}") from None
    if not all(math.isfinite(v) and v > 0 for v in values.values()):
        raise UserError(f"--peak {path}: peaks must be positive")
    return values


def cmd_bench_prepare(args: argparse.Namespace) -> int:
    if not args.sizes or min(args.sizes) <= 0 or args.vocab_size < 256 or args.threads < 0:
        raise UserError("--sizes must be positive, --vocab-size >= 256 and --threads >= 0")
    run_prepare_bench(args.sizes, args.out, args.work, args.vocab_size, args.threads)
    return 0
