"""``conceptmoe frontier``, and the ``--ratio``/``--extrapolate`` flags of an elastic run (issue 21).

``frontier RUN [RUN ...] --ratios 1.5,2,3,4 [--json] [--plot PNG]``: val BPB, realised compression,
activated FLOPs/token and K/V bytes per token of each run at each R it serves
(``evaluation/frontier.py``).
"""

from __future__ import annotations

import argparse
import json

from ..errors import UserError
from .args import distinct, finite_float, writable_file


def add_ratio_flags(p: argparse.ArgumentParser) -> None:
    """``--ratio R`` and ``--extrapolate`` for commands that run an elastic ConceptMoE."""
    p.add_argument("--ratio", type=finite_float, metavar="R",
                   help="compression R to run an elastic ConceptMoE at (trained with --ratios; default: its "
                        "design ratio); a fixed-R run takes only its own R")
    p.add_argument("--extrapolate", action="store_true",
                   help="allow a --ratio outside the range the elastic run was trained on (at most 2x beyond it)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontier", help="quality vs compute of elastic runs at several compression ratios",
                       description="For each run and each ratio R it serves (elastic: the --ratios in its trained "
                                   "range; fixed-R ConceptMoE: its R; MoE: 1): held-out val BPB, realised "
                                   "compression, activated FLOPs/token and K/V bytes per token.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--ratios", default="1.5,2,3,4", help="ratios to measure elastic runs at (default 1.5,2,3,4)")
    p.add_argument("--val-tokens", type=int, help="cap on held-out tokens per measurement (default: the run's)")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows")
    p.add_argument("--plot", nargs="?", const="frontier.png", metavar="PNG",
                   help="write val BPB against FLOPs/token as a PNG (default frontier.png)")
    p.add_argument("--latency", action="store_true",
                   help="also time prefill (the first --latency-len held-out tokens) and per-token decode "
                        "(16 steps of the text) at each R, on this machine")
    p.add_argument("--latency-len", type=int, default=512, metavar="L", help="prefill length of --latency (default 512)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.set_defaults(func=cmd_frontier)


def _parse(spec: str) -> list[float]:
    try:
        out = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--ratios: expected numbers like 1.5,2,3,4 (got {spec!r})") from None
    if not out or not all(r > 1 and r < float("inf") for r in out):
        raise UserError(f"--ratios: every ratio must be a finite number > 1 (got {spec!r})")
    return distinct(out, "--ratios")


def _add_latency(rows: list[dict], prefill_len: int, device: str) -> None:
    """Prefill and decode latency of every row, on the run's held-out text (bench/text_latency.py)."""
    import torch

    from ..bench.text_latency import text_latency
    from ..evaluation.evaluate import held_out_tokens
    from ..training.checkpoint import load_run

    for run in dict.fromkeys(r["run"] for r in rows):
        model, cfg, tok, run_cfg = load_run(run, device)
        ids, _ = held_out_tokens(run_cfg, cfg, tok)
        ids = torch.as_tensor(ids[:prefill_len + 16].astype("int64"))
        if len(ids) < prefill_len + 16:
            raise UserError(f"{run}: the held-out text has {len(ids)} tokens, fewer than --latency-len + 16")
        for r in (r for r in rows if r["run"] == run):
            r.update(text_latency(model, ids, r["ratio"] if r["elastic"] else None, prefill_len))


def cmd_frontier(args: argparse.Namespace) -> int:
    from ..evaluation.frontier import format_table, frontier, plot

    ratios = _parse(args.ratios)
    if args.val_tokens is not None and args.val_tokens < 1:
        raise UserError("--val-tokens must be a positive integer")
    if args.latency_len < 1:
        raise UserError("--latency-len must be a positive integer")
    if args.plot:  # before the measurement, not after it
        writable_file(args.plot, "--plot")
    rows = frontier(args.runs, ratios, args.device, args.val_tokens)
    if args.latency:
        _add_latency(rows, args.latency_len, args.device)
    print(json.dumps(rows) if args.json else format_table(rows))
    if args.plot:
        plot(rows, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
