"""``conceptmoe bench serve``: a load generator against servers it starts (``bench/serve.py``)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..bench.workloads import WORKLOADS
from ..errors import UserError
from ..files import write_json, write_text


def _rate(text: str) -> float:
    v = float(text)
    if not (v > 0 or math.isinf(v)):
        raise argparse.ArgumentTypeError("must be > 0 or inf")
    return v


def _ratios(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4 (got {text!r})") from None


def _lens(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts like 1024,4096 (got {text!r})") from None


def register_bench(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("serve", help="serving throughput at a fixed KV budget: runs side by side",
                         description="Start `conceptmoe serve` for each RUN in turn with the same --kv-cache-mb and "
                                     "send every one the same requests (prompts from the first run's held-out "
                                     "text); report request throughput, output tokens/s, TTFT and TPOT, the peak "
                                     "number of sequences the KV pool held and KV bytes per token. Writes "
                                     "serve.json and serve.md to --out. Needs the extra `serve`.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories sharing one tokenizer")
    p.add_argument("--requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens, EOS ignored (default 64)")
    p.add_argument("--len-spread", type=float, default=0.0,
                   help="draw each length uniformly within ±this fraction (default 0: fixed)")
    p.add_argument("--rate", type=_rate, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no bound)")
    p.add_argument("--kv-cache-mb", type=float, default=16.0, help="every server's KV budget in MiB (default 16)")
    p.add_argument("--max-batch", type=int, default=64, help="every server's --max-batch (default 64)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="default fp32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: torch's)")
    p.add_argument("--concept-ratios", type=_ratios, default=[],
                   help="elastic runs: measure at each of these R, e.g. 2,4 (other runs: ignored)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0, help="request draws and sampling seed (default 0)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="builtin: conceptmoe's server (default); vllm: `conceptmoe serve --engine vllm` for each "
                        "run (the extra `vllm`; bench/vllm_serve.py)")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="with --engine vllm: more arguments for every vLLM server, one string")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --engine vllm: the load this many times on each server; the median repeat is "
                        "reported, every repeat's throughput beside it (default 1)")
    p.add_argument("--prompt-lens", type=_lens, default=None, metavar="L,...",
                   help="with --engine vllm and two runs (the MoE, then the ConceptMoE): the long-prompt sweep "
                        "(bench/vllm_long.py): per length, TTFT and TPOT of a prompt sent alone, and output tok/s "
                        "of --requests x max(L)/L prompts at --kv-cache-mb (and --unbound-kv-cache-mb), beside the "
                        "pair's analytic limits; writes long.json, long.md and long.png")
    p.add_argument("--unbound-kv-cache-mb", type=float, default=None, metavar="MB",
                   help="with --prompt-lens: a second budget, one that holds every load (default: none)")
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="--engine vllm: independent prompts (default); shared-prefix: --prefixes system prompts "
                        "of --prefix-len tokens, each before its own questions of --prompt-len; chat: "
                        "conversations of --turns turns, each resending the conversation so far")
    p.add_argument("--prefixes", type=int, default=6, help="shared-prefix: system prompts (default 6)")
    p.add_argument("--prefix-len", type=int, default=1200, help="shared-prefix: tokens a system prompt (default 1200)")
    p.add_argument("--turns", type=int, default=4, help="chat: turns a conversation (default 4)")
    p.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                   help="--engine vllm: vLLM's prefix caching on both models' servers (default on, as vLLM "
                        "and conceptmoe serve --engine vllm serve)")
    p.add_argument("--out", default="bench_out/serve", help="directory for serve.json and serve.md")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        from ..bench.serve import ServeBenchSettings, format_table, run_serve_bench
    except ImportError as e:
        raise UserError(f"bench serve needs the extra `serve`: pip install -e \".[serve]\" ({e})") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # fails now, not after the measurement
    s = ServeBenchSettings(runs=args.runs, requests=args.requests, prompt_len=args.prompt_len,
                           output_len=args.output_len, len_spread=args.len_spread, rate=args.rate,
                           concurrency=args.concurrency, kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch,
                           dtype=args.dtype, device=args.device, threads=args.threads,
                           concept_ratios=args.concept_ratios, seed=args.seed, temperature=args.temperature,
                           workload=args.workload, prefixes=args.prefixes, prefix_len=args.prefix_len,
                           turns=args.turns, prefix_caching=args.prefix_caching or "on")
    from .held_out import run_held_out_ids

    s.check()
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1 (got {args.repeats})")
    if args.repeats > 1 and args.engine != "vllm":
        raise UserError("--repeats applies to --engine vllm")
    if (args.prompt_lens or args.unbound_kv_cache_mb) and args.engine != "vllm":
        raise UserError("--prompt-lens and --unbound-kv-cache-mb apply to --engine vllm")
    if args.unbound_kv_cache_mb is not None and not args.prompt_lens:
        raise UserError("--unbound-kv-cache-mb applies with --prompt-lens")
    if args.prefix_caching is not None and args.engine != "vllm":
        raise UserError("--prefix-caching applies to --engine vllm")
    if args.workload != "random" and (args.engine != "vllm" or args.prompt_lens):
        raise UserError("--workload applies to --engine vllm without --prompt-lens")
    if args.prompt_lens:
        return _long(args, s, out)
    if args.engine == "vllm":
        from ..bench.vllm_serve import format_table, run_vllm_serve_bench
        from ..vllm_plugin.launch import check_installed

        check_installed()
        report = run_vllm_serve_bench(s, run_held_out_ids(s.runs[0]).tolist(), args.vllm_args, args.repeats)
    else:
        if args.vllm_args:
            raise UserError("--vllm-args applies to --engine vllm")
        report = run_serve_bench(s, run_held_out_ids(s.runs[0]).tolist())
    return _write(out, "serve", report, format_table(report), s)


def _write(out: Path, stem: str, report: dict, table: str, s) -> int:
    """Print the table; write ``stem``.json and ``stem``.md to ``out``."""
    print(table)
    report["settings"]["rate"] = None if math.isinf(s.rate) else s.rate  # strict JSON: no Infinity
    write_json(out / f"{stem}.json", report)
    write_text(out / f"{stem}.md", table + "\n")
    print(f"wrote {out / f'{stem}.json'}", file=sys.stderr)
    return 0


def _long(args: argparse.Namespace, s, out: Path) -> int:
    from ..bench.vllm_long import format_long_table, plot, run_vllm_long_bench
    from ..vllm_plugin.launch import check_installed
    from .held_out import run_held_out_ids

    check_installed()
    if args.unbound_kv_cache_mb is not None and not args.unbound_kv_cache_mb > 0:
        raise UserError(f"--unbound-kv-cache-mb must be > 0, got {args.unbound_kv_cache_mb:g}")
    report = run_vllm_long_bench(s, run_held_out_ids(s.runs[0]).tolist(), args.prompt_lens, args.unbound_kv_cache_mb,
                                 args.vllm_args, args.repeats)
    plot(report, out / "long.png")
    return _write(out, "long", report, format_long_table(report), s)
