"""``conceptmoe generate``: stream a continuation from a trained run (CONCEPTMOE.md §4)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..errors import UserError
from ..inference.text import MARK, TextStats, stream_text
from ..training.checkpoint import load_run
from ..training.conventions import eos_list, token_ids
from ..model.elastic import require_ratio
from .args import finite_float, seed
from .frontier import add_ratio_flags

MAX_NEW_TOKENS = 1_000_000  # the KV cache grows with the text; far beyond any length a run was trained at


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a trained run (streamed, KV-cached)",
                       description="Generate text from a trained run directory with the KV cache "
                                   "(concept-level cache for ConceptMoE), streaming it as it comes.")
    p.add_argument("run", metavar="RUN", help="run directory written by `conceptmoe train`")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help=f"tokens to generate (default 200, at most {MAX_NEW_TOKENS:,})")
    p.add_argument("--temperature", type=finite_float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=finite_float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=seed, default=None, help="sampling seed (default: random)")
    p.add_argument("--show-concepts", action="store_true",
                   help=f"print '{MARK}' before every token that starts a concept (ConceptMoE)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    add_ratio_flags(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in [1, {MAX_NEW_TOKENS}] (got {args.max_new_tokens})")
    if not args.temperature >= 0 or args.temperature == float("inf") or \
            (args.top_k is not None and args.top_k < 1) or (args.top_p is not None and not 0 < args.top_p <= 1):
        raise UserError("need a finite --temperature >= 0, --top-k >= 1 and --top-p in (0, 1]")
    model, cfg, tok, run_cfg = load_run(args.run, args.device)
    ratio = require_ratio(cfg, args.ratio, args.extrapolate)
    eos = eos_list(token_ids(run_cfg, tok)) or None  # stop at end-of-text (runs made before it: never)
    gen = None
    if args.seed is not None:
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    stats = TextStats()
    for piece in stream_text(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                             args.top_p, gen, args.show_concepts, stats, eos, ratio, args.extrapolate):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stats.summary(), file=sys.stderr)
    return 0
