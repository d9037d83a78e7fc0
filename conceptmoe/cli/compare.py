"""``conceptmoe compare``: the MoE baseline against compute-matched ConceptMoEs (CONCEPTMOE.md §5).

A thin wrapper over ``evaluation.compare.compare`` (and ``evaluation.continual`` with ``--init``);
``--config FILE.toml`` fills the flags left out (cli/recipe.py), ``--print-config`` shows the result.
"""

from __future__ import annotations

import argparse

from ..errors import UserError
from ..evaluation.compare import CompareConfig, compare, load_variants, plan
from ..training.config import LOG_MODES
from ..training.recipe import render_compare
from .args import common_model_flags, finite_float
from .recipe import add_recipe_flags, compare_file, overrides


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}")
    return parse


def register(sub) -> None:
    p = sub.add_parser("compare", help="MoE baseline vs compute-matched ConceptMoE on the same data",
                       description="Train the MoE baseline and compute-matched ConceptMoE variants with the "
                                   "same tokenizer, data, token budget and seeds; write report.md, "
                                   "report.json and curves.png. Rerunning with the same --out resumes.")
    common_model_flags(p)
    p.add_argument("--strategies", type=_csv(str), help="reinvestment strategies: topk,layers,loop (default topk)")
    p.add_argument("--ratios", type=_csv(finite_float), help="compression ratios R (default 2)")
    p.add_argument("--seeds", type=_csv(int), help="seeds, e.g. 0,1,2 (default 0,1,2)")
    p.add_argument("--tokens", type=int, help="training tokens per model (default 300k)")
    p.add_argument("--ablations", action="store_true",
                   help="add linear router, fixed-size chunking, no joint decoding and no boundary noise")
    p.add_argument("--variants", metavar="FILE",
                   help='JSON object of extra ConceptMoE variants, label -> {"strategy", "ratio", "set": {ModelConfig '
                        'overrides}, "lr", "chunk_lr_mult", "seeds": [subset of --seeds]}, e.g. '
                        '{"split2": {"set": {"n_encoder_layers": 2, "n_decoder_layers": 2}, "seeds": [0]}}')
    p.add_argument("--out", help="output directory (default runs/compare-<preset>)")
    p.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="every run in this precision (default: each run's own, as `train`: bf16 on CUDA and on "
                        "AMX-BF16 / AVX512-BF16 CPUs, else fp32; a resumed run keeps its recorded one); runs "
                        "finished in another precision count as different settings")
    p.add_argument("--force", action="store_true", help="replace a comparison with different settings in --out")
    p.add_argument("--experts-multiple-of", type=int, metavar="N",
                   help="match every ConceptMoE with a concept-expert count N divides (shardable by "
                        "--expert-parallel N; default 1)")
    p.add_argument("--init", metavar="MOE_RUN",
                   help="continual-training mode: continue this MoE run vs its ConceptMoE conversions (default "
                        "--ratios 1.5,2, --strategies topk,loop: loop = concept layers run twice) for --tokens "
                        "each (default 262k), with the MoE's tokenizer and data; report.md in --out "
                        "(default runs/ct-<run name>)")
    p.add_argument("--chunk-lr-mult", type=finite_float, help="with --init: learning-rate multiplier of the new chunk router")
    p.add_argument("--split", metavar="E+C+D",
                   help="with --init: encoder + concept + decoder layers of the conversions, as `conceptmoe convert "
                        "--split` (default: convert's, 2 + 4 + 2 for an 8-layer MoE)")
    p.add_argument("--jobs", type=int,
                   help="train up to N runs at once, one process each: cores / N torch threads each (or "
                        "OMP_NUM_THREADS), one GPU each on a multi-GPU machine; a run's output goes to "
                        "--out/logs/ (default 1: one after another, output here)")
    p.add_argument("--log", choices=LOG_MODES,
                   help="watch every run as `train --log` does: jsonl (health, MFU, warnings in each run's "
                        "metrics.jsonl) or tensorboard (also RUN/tensorboard/); default off")
    add_recipe_flags(p, "compare")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    compare_file(args)
    if args.init is not None:
        return _cmd_compare_ct(args)
    for flag, value in (("--chunk-lr-mult", args.chunk_lr_mult), ("--split", args.split)):
        if value is not None:
            raise UserError(f"{flag} applies to the continual-training mode (--init)")
    given = {k: getattr(args, k) for k in ("preset", "strategies", "ratios", "seeds", "tokens", "data",
                                          "out", "batch_size", "seq_len", "lr", "device", "dtype",
                                          "experts_multiple_of")
             if getattr(args, k) is not None}
    if overrides(args, args.file_overrides) is not None:
        given["overrides"] = overrides(args, args.file_overrides)
    if args.variants is not None:  # a JSON file (--variants), or a recipe's [variants] tables
        given["variants"] = load_variants(args.variants) if isinstance(args.variants, str) else args.variants
    cc = CompareConfig(**given, ablations=args.ablations, force=args.force, jobs=_jobs(args), log=args.log)
    if args.print_config:
        print(render_compare(cc.to_dict(), plan(cc)), end="")
        return 0
    out = compare(cc)
    print((out / "report.md").read_text())
    extra = " and curves.png" if (out / "curves.png").is_file() else ""  # vlm-digits: no curves
    print(f"report written to {out}/report.md, report.json{extra}")
    return 0


def _cmd_compare_ct(args: argparse.Namespace) -> int:
    from ..evaluation.continual import CTConfig, continual_compare

    if args.ablations or args.preset or args.data or args.experts_multiple_of is not None:
        raise UserError("--init compares continual training from that run: leave out --ablations, --preset, --data "
                        "and --experts-multiple-of")
    if args.seeds is not None and len(args.seeds) != 1:
        raise UserError("--init runs one seed: give --seeds N with a single value")
    strategies = args.strategies or ["topk", "loop"]
    if not set(strategies) <= {"topk", "loop"}:
        raise UserError("--init converts by topk (more activated experts) or loop (concept layers run twice)")
    given = {k: getattr(args, k) for k in ("ratios", "tokens", "out", "batch_size", "seq_len", "lr", "device",
                                          "dtype", "chunk_lr_mult", "split") if getattr(args, k) is not None}
    if args.seeds:
        given["seed"] = args.seeds[0]
    if overrides(args, args.file_overrides) is not None:
        given["overrides"] = overrides(args, args.file_overrides)
    variants = [{"topk": "topk", "loop": "loop2"}[s] for s in strategies]
    ct = CTConfig(init=args.init, variants=variants, force=args.force, jobs=_jobs(args), log=args.log, **given)
    if args.print_config:  # the comparison resolved, as its recipe.toml will hold it
        print(ct.recipe_text(), end="")
        return 0
    out = continual_compare(ct)
    print((out / "report.md").read_text())
    print(f"report written to {out}/report.md, report.json and curves.png")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    return 1 if args.jobs is None else args.jobs
