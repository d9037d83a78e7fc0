"""``conceptmoe train | eval | boundaries``: thin argparse wrappers (CONCEPTMOE.md §5); ``compare``: compare.py.

Each command validates its flags into a library config and calls ``train``, ``evaluate`` or
``boundaries``; errors surface as one-line ``error: ...`` (cli/__init__.py).
Training flags default to None so that ``--resume`` can fill what the user left out from the
run's stored config, and reject what contradicts it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ..errors import UserError
from ..evaluation.boundaries import find_boundaries, render_html, render_terminal
from ..training.config import DEFAULT_STRATEGY, TrainConfig, resolve_train_config
from ..data.corpus import read_text_file
from ..evaluation.evaluate import compression_warning, evaluate
from ..training.checkpoint import read_run_config
from ..training.train import train
from .args import common_model_flags, finite_float, seed
from .frontier import add_ratio_flags
from . import compare
from .recipe import add_recipe_flags, overrides, train_file
from ..training.recipe import freeze, render_train
from ..files import write_text

MAX_EXAMPLES = 100  # boundaries of a vlm-digits run: examples shown (each one a forward pass and a picture)
_TRAIN_FLAGS = ("model", "preset", "ratio", "ratios", "strategy", "data", "out", "max_steps", "tokens",
                "save_every", "batch_size", "seq_len", "lr", "seed", "device", "warmup_steps",
                "chunk_lr_mult", "stage_lr_mults", "eval_every", "val_tokens", "skip_bad_steps", "parallel", "grad_accum",
                "dtype", "compile", "expert_parallel", "experts_multiple_of", "log")


def register(sub: argparse._SubParsersAction) -> None:
    _register_train(sub)
    _register_eval(sub)
    compare.register(sub)  # compare.py, listed in this order
    _register_boundaries(sub)


def _register_train(sub) -> None:
    p = sub.add_parser("train", help="train a ConceptMoE or MoE language model",
                       description="Train a model into a run directory (config.json, model.safetensors, "
                                   "tokenizer.json, metrics.jsonl, checkpoints/). With no flags: the small "
                                   "ConceptMoE, R=2, compute-matched to the small MoE, on Shakespeare.")
    p.add_argument("--model", choices=("conceptmoe", "moe"), help="architecture (default conceptmoe)")
    p.add_argument("--ratio", type=finite_float, help="target compression R, tokens per concept (default 2); "
                                                      "with --ratios: the design ratio of compute matching")
    p.add_argument("--ratios", metavar="R[:W],...",
                   help="elastic training: each sequence draws its target R from this set (optional weights, "
                        "e.g. 1.5:1,2:2,3:1,4:1); any R in the range can then be chosen at inference")
    p.add_argument("--strategy", choices=("topk", "layers", "loop", "none"),
                   help=f"the ConceptMoE is compute-matched to the preset's MoE by this reinvestment (default "
                        f"{DEFAULT_STRATEGY}); none: the preset's own ConceptMoE layout, not matched")
    common_model_flags(p)
    p.add_argument("--out", help="run directory (default runs/<preset>-<model name>)")
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--tokens", type=int, help="training tokens instead of --max-steps (default 1.6M; steps = tokens / (batch x seq-len))")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (default 100)")
    p.add_argument("--seed", type=seed, help="random seed (default 0)")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 5%% of the steps)")
    p.add_argument("--chunk-lr-mult", type=finite_float, help="learning-rate multiplier of the chunk router (default 1)")
    p.add_argument("--stage-lr-mults", metavar="TOKEN,CONCEPT",
                   help="ConceptMoE: learning-rate multipliers of the token-rate stage (embeddings, encoder, "
                        "router, decoder, head) and of the concept stage; auto: H-Net's rule, 1,1/sqrt(R) "
                        "(default: one rate for the whole model)")
    p.add_argument("--eval-every", type=int, help="steps between validations (default: 10 per run; 0: off)")
    p.add_argument("--val-tokens", type=int, help="cap on the held-out tokens of the final validation (default 1M)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"),
                   help="under torchrun: DistributedDataParallel or FSDP2 sharding (default ddp)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per step on each process (default 1)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16 (printed at the start), else fp32")
    p.add_argument("--expert-parallel", type=int, metavar="S",
                   help="under torchrun: shard every MoE layer's experts over groups of S processes (default 1)")
    p.add_argument("--experts-multiple-of", type=int, metavar="N",
                   help="--strategy: match with a concept-expert count N divides, so that --expert-parallel N "
                        "can shard it (default: the --expert-parallel degree)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile each block")
    p.add_argument("--skip-bad-steps", type=int, metavar="N",
                   help="skip up to N steps whose loss or gradient is not finite (default 0: stop at the first)")
    p.add_argument("--init", metavar="RUN",
                   help="start from this run's weights, model config and tokenizer (continual training: fresh "
                        "optimizer, new schedule); --set may change fields that keep the weights' shapes")
    p.add_argument("--log", choices=("jsonl", "tensorboard"),
                   help="watch the run: jsonl adds the chunk router's and experts' health (compression vs R, p "
                        "histogram, tokens per expert, imbalance, dead experts, z-loss), MFU and warnings to "
                        "metrics.jsonl every validation interval; tensorboard also writes them to RUN/tensorboard/ "
                        "(pip install -e \".[tensorboard]\")")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--force", action="store_true", help="replace a run already in --out")
    p.add_argument("--verify", action="store_true",
                   help="--data from `conceptmoe prepare`: check every shard's SHA-256 against the manifest "
                        "first (done on --resume anyway; sizes are always checked)")
    add_recipe_flags(p, "train")
    p.set_defaults(func=cmd_train)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from flags over the --config recipe; with --resume, flags left out come from the
    stored run. A new run's defaults are frozen (training/recipe.py), as its recipe.toml records them."""
    file = train_file(args)
    given = {**file, **{k: getattr(args, k) for k in _TRAIN_FLAGS + ("init",) if getattr(args, k, None) is not None}}
    clash = [k for k in ("model", "preset", "ratio", "strategy") if k in given and "init" in given]
    if clash:
        raise UserError(f"--init takes the model from the init run; leave out --{clash[0]}")
    if overrides(args, file.get("overrides", {})) is not None:
        given["overrides"] = overrides(args, file.get("overrides", {}))
    if given.get("strategy") == "none":
        given["strategy"] = None
    elif "strategy" not in given and not args.resume and "init" not in given and given.get("model") != "moe":
        given["strategy"] = DEFAULT_STRATEGY  # a resumed run keeps what it was started with
    tc = resolve_train_config(given, args.resume, args.force)
    tc.verify = bool(getattr(args, "verify", False))
    return tc if args.resume else freeze(tc)


def cmd_train(args: argparse.Namespace) -> int:
    tc = train_config_from_args(args)
    if args.print_config:
        print(render_train(tc), end="")
        return 0
    out = train(tc)
    ev = json.loads((out / "eval.json").read_text())
    print(f"run saved to {out}")
    if "val_bpb" not in ev:  # --data vlm-digits
        from ..training.digits import log_line

        print(log_line(ev))
        return 0
    print(f"val_loss {ev['val_loss']:.4f}  val_bpb {ev['val_bpb']:.4f}  "
          f"compression {ev['compression']:.2f}  tokens {ev['tokens']}")
    mc = json.loads((out / "config.json").read_text()).get("model", {})
    _warn_compression(mc, ev["compression"])
    if mc.get("elastic_ratios"):  # the figures above are at the design ratio
        rs = mc["elastic_ratios"]
        print(f"elastic: choose R in [{rs[0]:g}, {rs[-1]:g}] with --ratio (eval, generate, boundaries, bench latency); "
              f"compute-matched and validated at the design R {mc['compression_ratio']:g}; "
              f"conceptmoe frontier {out} reports every R")
    return 0


def _register_eval(sub) -> None:
    p = sub.add_parser("eval", help="validation loss, bits per byte and compression of a run",
                       description="Evaluate a trained run on its held-out text, or on --data.")
    p.add_argument("run", help="run directory")
    p.add_argument("--data", help="evaluate on all text under this path instead of the run's held-out split")
    p.add_argument("--json", action="store_true", help="print one JSON object (val_loss, val_bpb, compression, tokens; "
                                                       "health: the chunk router's and every MoE layer's figures)")
    p.add_argument("--batch-size", type=int, help="windows per forward pass (default 16)")
    p.add_argument("--val-tokens", type=int, help="cap on held-out tokens (default: the run's --val-tokens)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--tasks", help="run lm-evaluation-harness tasks instead, comma-separated: cmoe_nextline, "
                                   "cmoe_niah, cmoe_heldout_ppl (offline, built from the held-out plays) or "
                                   "stock tasks whose data is cached locally; needs pip install -e \".[eval]\"")
    p.add_argument("--limit", type=int, help="with --tasks: at most N documents per task")
    add_ratio_flags(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError("--batch-size must be a positive integer")
    if args.tasks is not None or args.limit is not None:
        return _eval_tasks(args)
    if args.val_tokens is not None and args.val_tokens < 1:
        raise UserError("--val-tokens must be a positive integer")
    from ..evaluation.evaluate import is_vlm_run

    if is_vlm_run(args.run):  # the digits task: text loss, answer accuracy, compression per modality
        from ..evaluation.evaluate import evaluate_vlm_run

        given = [f for f, v in (("--data", args.data), ("--val-tokens", args.val_tokens),
                                ("--batch-size", args.batch_size), ("--ratio", args.ratio)) if v is not None]
        if given:
            raise UserError(f"{args.run} is a vision-language run, measured on the fixed held-out digit examples: "
                            f"leave out {', '.join(given)}")
        from ..training.digits import log_line

        res = evaluate_vlm_run(args.run, args.device)
        print(json.dumps(res) if args.json else log_line(res))
        return 0
    res = evaluate(args.run, args.data, args.device, args.batch_size, args.val_tokens, progress=True,
                   ratio=args.ratio, extrapolate=args.extrapolate)
    if not math.isfinite(res["val_loss"]):
        raise UserError(f"validation loss is {res['val_loss']}: the run's weights have diverged")
    keys = ("val_loss", "val_bpb", "compression", "tokens") + (("ratio",) if "ratio" in res else ()) + ("health",)
    if args.json:
        print(json.dumps({k: res[k] for k in keys}))
    else:
        asked = f" (requested R {res['ratio']:g})" if "ratio" in res else ""
        print(f"val_loss {res['val_loss']:.4f}  val_bpb {res['val_bpb']:.4f}  "
              f"compression {res['compression']:.2f}{asked}  tokens {res['tokens']}")
    _warn_compression(read_run_config(args.run).get("model", {}), res["compression"], res.get("ratio"))
    return 0


def _warn_compression(mc: dict, realised: float, ratio: float | None = None) -> None:
    """A ConceptMoE run's held-out compression far from R (``ratio``, else its design R): one stderr line."""
    if mc.get("kind") != "conceptmoe":
        return
    why = compression_warning(realised, ratio or mc["compression_ratio"], mc.get("chunk_router", "cosine"))
    if why:
        print(why, file=sys.stderr)


def _eval_tasks(args: argparse.Namespace) -> int:
    """``eval --tasks``: lm-evaluation-harness through our model (conceptmoe/harness/, issue 11 B)."""
    from ..harness.run import evaluate_tasks, format_table

    if args.tasks is None:
        raise UserError("--limit applies to --tasks")
    if args.ratio is not None:  # an elastic run at R (the harness model's concept_ratio)
        from ..model.elastic import require_ratio
        from ..training.checkpoint import model_config_of

        require_ratio(model_config_of(read_run_config(args.run)), args.ratio, args.extrapolate)
    if args.data is not None or args.val_tokens is not None:
        raise UserError("--data and --val-tokens apply to the plain validation, not to --tasks")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be a positive integer")
    from ..evaluation.evaluate import is_vlm_run

    if is_vlm_run(args.run):
        raise UserError(f"{args.run} is a vision-language run (word vocabulary, images); --tasks evaluates text "
                        f"models: use conceptmoe eval {args.run}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    res = evaluate_tasks(args.run, tasks, args.limit, args.batch_size, args.device, ratio=args.ratio,
                         extrapolate=args.extrapolate)
    print(json.dumps(res, sort_keys=True) if args.json else format_table(res))
    return 0


def _register_boundaries(sub) -> None:
    p = sub.add_parser("boundaries", help="show where a ConceptMoE run puts concept boundaries",
                       description="Colour the concepts a trained ConceptMoE finds in a text (terminal) "
                                   "and optionally write a self-contained HTML page.")
    p.add_argument("run", help="ConceptMoE run directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="text to chunk (required unless the run was trained on vlm-digits)")
    src.add_argument("--file", help="UTF-8 file to chunk")
    p.add_argument("--html", metavar="OUT", help="also write an HTML page here")
    p.add_argument("--examples", type=int, default=4,
                   help=f"vlm-digits runs: held-out image-text examples to show (default 4, at most {MAX_EXAMPLES})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_ratio_flags(p)
    p.set_defaults(func=cmd_boundaries)


def cmd_boundaries(args: argparse.Namespace) -> int:
    from ..evaluation.evaluate import is_vlm_run

    if is_vlm_run(args.run):
        return _vlm_boundaries(args)
    if args.text is None and args.file is None:
        raise UserError("give --text or --file")
    text = args.text if args.text is not None else read_text_file(args.file)
    res = find_boundaries(args.run, text, args.device, args.ratio, args.extrapolate)
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    print(render_terminal(res, color=color))
    if args.html:
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        write_text(Path(args.html), render_html(res))
        print(f"HTML written to {args.html}")
    return 0


def _vlm_boundaries(args: argparse.Namespace) -> int:
    from ..evaluation.boundaries import find_vlm_boundaries, render_vlm_html, render_vlm_terminal

    if args.text is not None or args.file is not None or not 1 <= args.examples <= MAX_EXAMPLES:
        raise UserError(f"a vlm-digits run shows held-out examples: use --examples N (1 <= N <= {MAX_EXAMPLES}), "
                        "not --text/--file")
    views = find_vlm_boundaries(args.run, args.examples, args.device)
    print(render_vlm_terminal(views))
    if args.html:
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        write_text(Path(args.html), render_vlm_html(views, args.run))
        print(f"HTML written to {args.html}")
    return 0
