"""``conceptmoe import-hf`` / ``export-hf``: Hugging Face MoE checkpoints <-> run directories (issue 10)."""

from __future__ import annotations

import argparse

from ..interop import export_hf, import_hf
from ..interop.hf_config import ARCHS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import-hf", help="import a local OLMoE / Qwen2-MoE / Qwen3-MoE checkpoint as a MoE run",
                       description="Convert a local Hugging Face checkpoint directory (config.json, "
                                   "*.safetensors, possibly sharded, tokenizer.json) of OlmoeForCausalLM, "
                                   "Qwen2MoeForCausalLM or Qwen3MoeForCausalLM into a run directory "
                                   "(config.json, model.safetensors in fp32, tokenizer.json) that eval, "
                                   "generate and flops --config read. Nothing is downloaded.")
    p.add_argument("src", metavar="SRC_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, metavar="RUN", help="run directory to write")
    p.add_argument("--force", action="store_true", help="replace what is already in --out")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export-hf", help="export a run as a Hugging Face checkpoint directory",
                       description="Write a MoE run as a Hugging Face checkpoint directory (config.json, "
                                   "model.safetensors with per-expert keys, tokenizer.json) that the "
                                   "matching transformers class loads with the same logits. A ConceptMoE "
                                   "run becomes a model_type \"conceptmoe\" directory with its modeling "
                                   "code, for AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) "
                                   "(needs the conceptmoe package where it is loaded).")
    p.add_argument("run", metavar="RUN", help="run directory (MoE or ConceptMoE)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--arch", choices=tuple(ARCHS),
                   help="target family (default: the one the run was imported from, else by QK-norm: "
                        "full -> olmoe, head -> qwen3_moe, none -> qwen2_moe)")
    p.add_argument("--concept-ratio", type=float, metavar="R",
                   help="an elastic ConceptMoE: the default R written to the config's concept_ratio "
                        "(inside the trained range; default: the design ratio)")
    p.add_argument("--extrapolate", action="store_true",
                   help="with --concept-ratio: allow an R outside the trained range (at most 2x beyond it); "
                        "the exported config then accepts such an R per call too")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="max_position_embeddings past the run's training length, for serving longer contexts "
                        "(RoPE extrapolates; one warning says so; default: the training length)")
    p.add_argument("--force", action="store_true", help="replace what is already in --out")
    p.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> int:
    out = import_hf(args.src, args.out, force=args.force)
    print(f"imported {args.src} -> {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    out = export_hf(args.run, args.out, arch=args.arch, force=args.force, concept_ratio=args.concept_ratio,
                    extrapolate=args.extrapolate, max_model_len=args.max_model_len)
    print(f"exported {args.run} -> {out}")
    return 0
