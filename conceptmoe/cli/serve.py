"""``conceptmoe serve``: an OpenAI-compatible server over a run (CONCEPTMOE.md §4; ``serve/``)."""

from __future__ import annotations

import argparse

from ..errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a run over OpenAI's completions API (continuous batching)",
                       description="Serve a run (MoE, ConceptMoE, elastic, imported or converted) over OpenAI's "
                                   "completions API: continuous batching over the concept-level KV cache, a "
                                   "memory-budgeted KV pool, /metrics and a playground at /. Needs the extra "
                                   "`serve` (pip install -e \".[serve]\").")
    p.add_argument("run", metavar="RUN", help="run directory (conceptmoe train / import-hf / convert)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="builtin: this package's server (default); vllm: export the run if needed (RUN/vllm-export) "
                        "and start vLLM's OpenAI server on it (the extra `vllm`; a ConceptMoE through the plugin, "
                        "its concept KV cache paged at concept rate)")
    p.add_argument("--vllm-args", default=None, metavar="ARGS",
                   help="with --engine vllm: more arguments for vLLM's server, one string (e.g. \"--block-size 32\")")
    p.add_argument("--kv-cache-mb", type=float, default=None,
                   help="bytes all requests' KV caches may hold, in MiB (default 256; with --engine vllm: "
                        "vLLM's --kv-cache-memory-bytes, default vLLM's own)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests decoded together (default 32)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests queued for admission; past it new ones get 503 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens (prompt + completion) per request (default: the run's training length)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and KV caches (default fp32)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens one step may prefill; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the run directory's name)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default 10)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.kv_cache_mb is not None and not args.kv_cache_mb > 0:
        raise UserError(f"--kv-cache-mb must be > 0, got {args.kv_cache_mb:g}")
    if args.engine == "vllm":
        from ..vllm_plugin.launch import VllmServeConfig, serve_vllm, split_extra

        return serve_vllm(VllmServeConfig(args.run, args.host, args.port, args.kv_cache_mb, args.max_batch,
                                          args.max_model_len, args.dtype, args.device, args.served_model_name,
                                          extra=split_extra(args.vllm_args)))
    if args.vllm_args:
        raise UserError("--vllm-args applies to --engine vllm")
    if args.kv_cache_mb is None:
        args.kv_cache_mb = 256.0
    try:
        from ..serve.server import ServeConfig, serve
    except ImportError as e:
        raise UserError(f"serving needs the extra `serve`: pip install -e \".[serve]\" ({e})") from None
    return serve(ServeConfig(args.run, args.host, args.port, args.kv_cache_mb, args.max_batch, args.max_waiting,
                             args.max_model_len, args.dtype, args.device, args.grace,
                             served_model_name=args.served_model_name,
                             max_prefill_tokens=args.max_prefill_tokens))
