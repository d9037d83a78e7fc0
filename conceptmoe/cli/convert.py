"""``conceptmoe convert``: a MoE run -> a ConceptMoE run for continual training (issue 10 B, CONCEPTMOE.md §5)."""

from __future__ import annotations

import argparse

from ..errors import UserError
from ..interop.convert import STRATEGIES, convert_run
from ..model.config import parse_overrides
from ..model.flops import count_flops
from ..training.checkpoint import model_config_of, read_run_config
from ..training.elastic import parse_ratios
from .args import finite_float, seed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="make a ConceptMoE run from a trained or imported MoE run",
                       description="Split a MoE run's layers into encoder, concept model and decoder, add "
                                   "a chunk router (cosine, identity start) and zero joint-decoding "
                                   "projectors, and write a ConceptMoE run directory. The dechunk carries "
                                   "the concept model's update, so --ratio 1 (fixed router: every token a "
                                   "concept) gives the source's logits exactly.")
    p.add_argument("src", metavar="SRC_RUN", help="MoE run directory (conceptmoe train --model moe, or import-hf)")
    p.add_argument("--out", required=True, metavar="RUN", help="run directory to write")
    p.add_argument("--ratio", type=finite_float, default=2.0,
                   help="target compression R (default 2; 1: fixed router, every token a concept); with "
                        "--ratios: the design ratio")
    p.add_argument("--ratios", metavar="R,R,...",
                   help="make the ConceptMoE elastic over these ratios (a fresh ratio embedding; continue with "
                        "conceptmoe train --init RUN, which then draws each sequence's R from them)")
    p.add_argument("--split", metavar="E+C+D",
                   help="encoder + concept + decoder layers (default: two token-level layers on each side "
                        "from 6 layers on, 2+4+2 for 8 layers, as the study found best; 2+23+2 at 27 as the "
                        "paper; 1+(n-2)+1 below 6)")
    p.add_argument("--loops", type=int, help="run the concept layers N times (default 1; no new parameters)")
    p.add_argument("--joint-layers", type=int, metavar="K",
                   help="joint decoding in the last K decoder layers (default: all D; 0: none)")
    p.add_argument("--strategy", choices=STRATEGIES,
                   help="compute-matched to the source's activated FLOPs: topk (more activated experts in "
                        "the concept layers) or loop (loop count); layers is refused (new parameters)")
    p.add_argument("--experts-multiple-of", type=int, metavar="N",
                   help="check that N divides every layer's expert count (shardable by --expert-parallel N); "
                        "convert keeps the source's experts, so the source decides it")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a ConceptMoE field, e.g. --set concept_pooling=mean (repeatable)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the new modules' init (default 0)")
    p.add_argument("--force", action="store_true", help="replace a run already in --out")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.overrides)
    N = args.experts_multiple_of
    if N is not None:
        E = model_config_of(read_run_config(args.src)).n_experts
        if N < 1 or E % N:
            raise UserError(f"--experts-multiple-of {N}: {args.src} has {E} experts per layer and convert keeps "
                            f"them (no new parameters): expert parallelism over {N} processes cannot shard it")
    if args.ratios is not None:
        overrides["elastic_ratios"] = [r for r, _ in parse_ratios(args.ratios)]
    out = convert_run(args.src, args.out, ratio=args.ratio, split=args.split, loops=args.loops,
                      joint_layers=args.joint_layers, overrides=overrides,
                      strategy=args.strategy, force=args.force, seed=args.seed)
    cfg = model_config_of(read_run_config(out))
    src = count_flops(model_config_of(read_run_config(args.src)))
    new = count_flops(cfg)
    print(f"converted {args.src} -> {out}: {cfg.name}")
    print(f"layers {cfg.n_encoder_layers}+{cfg.n_concept_layers}x{cfg.concept_loops}+{cfg.n_decoder_layers}, "
          f"joint decoding in the last {cfg.n_joint_layers}, concept top-{cfg.concept_k}, router "
          f"{cfg.chunk_router}, R={cfg.compression_ratio:g}")
    print(f"activated FLOPs/token {src['activated_flops_per_token']:.4g} -> {new['activated_flops_per_token']:.4g} "
          f"(x{new['activated_flops_per_token'] / src['activated_flops_per_token']:.3f}); total params "
          f"{src['total_params']:,} -> {new['total_params']:,}")
    return 0
