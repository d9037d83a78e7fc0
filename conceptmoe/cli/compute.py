"""``conceptmoe flops`` and ``conceptmoe match``: compute accounting from the command line.

    conceptmoe flops --preset small --json
    conceptmoe flops --preset paper --set kind=moe --seq-len 4096
    conceptmoe match --baseline small --ratio 2 --strategy topk --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UserError
from ..model.config import ModelConfig, parse_overrides
from ..model.flops import count_flops
from ..model.match import STRATEGIES, match_config
from .args import finite_float


def _load_config(preset: str | None, config: str | None, sets: list[str] | None) -> ModelConfig:
    overrides = parse_overrides(sets)
    if config:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"no config file at {config}")
        data = json.loads(path.read_text())
        data = data.get("model", data)  # a run's config.json nests the model config
        return ModelConfig.from_dict({**data, **overrides})
    return ModelConfig.from_preset(preset or "small", **overrides)


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def cmd_flops(args: argparse.Namespace) -> int:
    cfg = _load_config(args.preset, args.config, args.set)
    out = count_flops(cfg, args.seq_len, args.compression, args.dtype_bytes)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_table([
        ("model", out["name"]),
        ("total params", f"{out['total_params']:,}"),
        ("activated params", f"{out['activated_params']:,}"),
        ("activated FLOPs/token", f"{out['activated_flops_per_token']:.4g}"),
        (f"attention-map FLOPs/token @{args.seq_len}", f"{out['attention_map_flops_per_token']:.4g}"),
        ("KV-cache bytes/token", f"{out['kv_cache_bytes_per_token']:.4g}"),
    ])
    return 0


def cmd_match(args: argparse.Namespace) -> int:
    base = _load_config(args.baseline, None, args.set).replace(kind="moe")
    res = match_config(base, args.ratio, args.strategy, seq_len=args.seq_len,
                       experts_multiple_of=args.experts_multiple_of)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    b, m = res.baseline, res.matched
    print(f"{'':30}{'baseline':>16}{res.name:>28}")
    for key in ("total_params", "activated_flops_per_token", "attention_map_flops_per_token",
                "kv_cache_bytes_per_token"):
        print(f"{key:30}{b[key]:>16.4g}{m[key]:>28.4g}")
    print(f"flops_ratio {res.flops_ratio:.4f}  params_ratio {res.params_ratio:.4f}")
    c = res.config
    print(f"layers {c.n_encoder_layers}+{c.n_concept_layers}x{c.concept_loops}+{c.n_decoder_layers}, "
          f"concept experts {c.concept_experts} top-{c.concept_k}, token-layer top-{c.top_k}")
    if res.constraint:
        k = res.constraint
        print(f"experts a multiple of {k['experts_multiple_of']}: matching error {k['error']:.2%} "
              f"(unconstrained {k['unconstrained_error']:.2%})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="parameters, activated FLOPs/token, attention FLOPs, KV bytes",
                       description="Analytic compute accounting of a model config (CONCEPTMOE.md §3).")
    p.add_argument("--preset", default="small", help="preset name: tiny, small, paper (default small)")
    p.add_argument("--config", help="a config.json (or run directory) instead of a preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--seq-len", type=int, default=2048, help="sequence length for attention-map FLOPs")
    p.add_argument("--compression", type=finite_float, help="realised tokens per concept (default: R)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per KV-cache element (default 2, bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser("match", help="the ConceptMoE config compute-matched to a MoE baseline",
                       description="Solve for the ConceptMoE whose activated FLOPs/token and total "
                                   "params match a MoE baseline (CONCEPTMOE.md §3).")
    p.add_argument("--baseline", default="small", help="baseline preset (default small)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a baseline field")
    p.add_argument("--ratio", type=finite_float, default=2.0, help="compression ratio R (default 2)")
    p.add_argument("--strategy", choices=STRATEGIES, default="topk", help="how saved compute is reinvested")
    p.add_argument("--experts-multiple-of", type=int, default=1, metavar="N",
                   help="concept-expert counts N divides only (shardable by --expert-parallel N); the report "
                        "gives the matching error this costs")
    p.add_argument("--seq-len", type=int, default=2048, help="sequence length for the reported attention FLOPs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_match)
