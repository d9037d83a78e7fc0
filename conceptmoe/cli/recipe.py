"""``--config FILE.toml`` and ``--print-config`` of ``train`` and ``compare`` (training/recipe.py).

The file fills the flags the command line leaves out: a flag given on the command line beats the
file's value (``--set KEY=VALUE`` beats the file's ``[set] KEY``, ``--max-steps`` its ``tokens``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..evaluation.compare import CompareConfig
from ..model.config import parse_overrides
from ..training.config import TrainConfig
from ..training.recipe import LAUNCH_FLAGS, NOT_READ, model_overrides, read

# compare flags of the continual-training mode (--init), which CompareConfig does not hold; the
# variants as [variants.LABEL] tables or the path of a --variants JSON file
COMPARE_KEYS = {"init": "str | None", "chunk_lr_mult": "float | None", "split": "str | None",
                "variants": "dict[str, Any] | str"}


def add_recipe_flags(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help=f"read the settings from a recipe: any flag of `{command}` by name (batch_size for "
                        "--batch-size) and a [set] table of ModelConfig fields; flags given here override the "
                        "file; every run writes its own as recipe.toml (recipes/: the default run and the "
                        "study's; docs/training.md#recipes)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved recipe (every default filled in) as TOML and exit: trains nothing, "
                        "writes nothing")


def train_file(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig settings of ``--config`` that the command line does not override ({} without
    one); the file's resume / force / verify set those flags when given there."""
    if args.config is None:
        return {}
    d = read(args.config, TrainConfig, skip=NOT_READ, extra=LAUNCH_FLAGS)
    for flag in LAUNCH_FLAGS:
        if d.pop(flag, False):
            setattr(args, flag, True)
    if args.max_steps is not None or args.tokens is not None:  # the budget is one of the two
        d.pop("max_steps", None), d.pop("tokens", None)
    if args.init is not None:  # the init run brings the model
        for k in ("model", "preset", "ratio", "strategy"):
            d.pop(k, None)
    if args.model == "moe":  # a ConceptMoE recipe trained as its MoE: the matching settings go
        d.pop("strategy", None), d.pop("experts_multiple_of", None)
    if args.strategy == "none":  # unmatched: nothing to constrain
        d.pop("experts_multiple_of", None)
    return d


def compare_file(args: argparse.Namespace) -> None:
    """Fill the compare flags the command line left out from ``--config`` (in place)."""
    args.file_overrides = {}
    if args.config is None:
        return
    d = read(args.config, CompareConfig, extra=COMPARE_KEYS)
    args.file_overrides = d.pop("overrides", {})
    for label, spec in (d.get("variants") if isinstance(d.get("variants"), dict) else {}).items():
        if isinstance(spec, dict) and isinstance(spec.get("set"), dict):  # typed as [set] is ("none": unset)
            spec["set"] = model_overrides(spec["set"], f"--config {args.config}: [variants.{label}.set]")
    for k, v in d.items():
        if getattr(args, k, None) in (None, False):
            setattr(args, k, v)


def overrides(args: argparse.Namespace, file: dict[str, Any]) -> dict[str, Any] | None:
    """The file's [set] with the command line's --set on top (None when neither gives any)."""
    cli = parse_overrides(args.overrides) if args.overrides is not None else {}
    return {**file, **cli} if file or args.overrides is not None else None
