"""``conceptmoe generate`` and ``conceptmoe bench latency|moe`` (CONCEPTMOE.md §4, §5)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import UserError

MARK = "|"  # printed before each token that starts a concept (--show-concepts)


def _ints(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _words(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a trained run (streamed, KV-cached)",
                       description="Generate text from a trained run directory with the KV cache "
                                   "(concept-level cache for ConceptMoE), streaming it as it comes.")
    p.add_argument("run", metavar="RUN", help="run directory written by `conceptmoe train`")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--show-concepts", action="store_true",
                   help=f"print '{MARK}' before every token that starts a concept (ConceptMoE)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.set_defaults(func=cmd_generate)

    bench = _bench_subparsers(sub)
    lat = bench.add_parser("latency", help="prefill and decode latency: MoE vs matched ConceptMoE",
                           description="Prefill and per-token decode latency of the MoE baseline "
                                       "and compute-matched ConceptMoE models, interleaved, medians. "
                                       "Writes latency.json and latency.png to --out.")
    lat.add_argument("--prefill-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384],
                     help="prompt lengths (default 1024,2048,4096,8192,16384; 'none' skips prefill)")
    lat.add_argument("--kv-lens", type=_ints, default=[1024, 4096, 16384],
                     help="cached tokens for the decode benchmark (default 1024,4096,16384; 'none' skips)")
    lat.add_argument("--batch", type=int, default=8, help="decode batch rows (default 8)")
    lat.add_argument("--prefill-batch", type=int, default=1, help="prefill batch rows (default 1)")
    lat.add_argument("--preset", default="small", help="MoE baseline preset (default small)")
    lat.add_argument("--ratios", type=_floats, default=[2.0], help="compression ratios R (default 2)")
    lat.add_argument("--strategies", type=_words, default=["topk", "layers"],
                     help="compute-matching strategies: topk,layers,loop (default topk,layers)")
    lat.add_argument("--run", action="append", default=[], metavar="DIR",
                     help="also time a trained run (repeatable; its router is not calibrated)")
    lat.add_argument("--repeats", type=int, default=3, help="timed repeats per model and length (default 3)")
    lat.add_argument("--decode-steps", type=int, default=16, help="decode steps per repeat (default 16)")
    lat.add_argument("--threads", type=int, default=0,
                     help="torch threads (default: torch's choice; 1 is steadier on a shared CPU)")
    lat.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--out", default="bench_out/latency", help="output directory (default bench_out/latency)")
    lat.set_defaults(func=cmd_bench_latency)

    moe = bench.add_parser("moe", help="our MoE block and model vs Hugging Face transformers",
                           description="Copy our weights into the Hugging Face OLMoE / Qwen2-MoE / "
                                       "Qwen3-MoE implementation (small random config, no download), "
                                       "check outputs agree within 1e-4 and compare forward and "
                                       "forward+backward time. Needs `pip install -e '.[hf]'`.")
    moe.add_argument("--arch", default="all", help="olmoe, qwen2_moe, qwen3_moe or all (default all)")
    moe.add_argument("--preset", default="small", help="sizes from this preset (default small)")
    moe.add_argument("--layers", type=int, default=2, help="layers of the model comparison (default 2)")
    moe.add_argument("--batch", type=int, default=2, help="batch rows (default 2)")
    moe.add_argument("--seq-len", type=int, default=512, help="tokens per row (default 512)")
    moe.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    moe.add_argument("--hf-experts", default=None,
                     help="Hugging Face experts implementation: eager or grouped_mm (default: its own default)")
    moe.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    moe.add_argument("--out", default=None, help="also write moe_bench.json into this directory")
    moe.set_defaults(func=cmd_bench_moe)


def _bench_subparsers(sub):
    """The ``bench`` command's sub-command table (created here unless another module made it)."""
    parser = sub.choices.get("bench")
    if parser is None:
        parser = sub.add_parser("bench", help="benchmarks: latency (MoE vs ConceptMoE), moe (vs transformers)",
                                description="Benchmarks.")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    table = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    table.required = True
    return table


# ----- generate -----
def _render(tok, ids: list[int], starts: set[int], show: bool) -> str:
    """Text of ``ids``; with ``show`` each concept is decoded on its own, preceded by the mark."""
    if not show:
        return tok.decode(ids)
    out, seg = [], []
    for i, t in enumerate(ids):
        if i in starts and seg:
            out.append(tok.decode(seg))
            seg = []
        if i in starts:
            out.append(MARK)
        seg.append(t)
    out.append(tok.decode(seg))
    return "".join(out)


def cmd_generate(args) -> int:
    import torch

    from ..checkpoint import load_run
    from ..generate import stream
    from ..inference import decode_step

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.temperature < 0 or (args.top_k is not None and args.top_k < 1) or \
            (args.top_p is not None and not 0 < args.top_p <= 1):
        raise UserError("need --temperature >= 0, --top-k >= 1 and --top-p in (0, 1]")
    model, cfg, tok, _ = load_run(args.run, args.device)
    ids = tok.encode(args.prompt).ids
    if not ids:
        raise UserError("--prompt encodes to no tokens")
    dev = next(model.parameters()).device
    gen = None
    if args.seed is not None:
        gen = torch.Generator(device=dev).manual_seed(args.seed)
    show = args.show_concepts and cfg.is_concept
    states: list = []
    all_ids, printed = list(ids), ""
    t0, n_new = time.perf_counter(), 0

    def emit(final: bool) -> None:
        nonlocal printed
        st = states[0]
        decided = len(all_ids) if (final or not show) else st.tokens.lengths[0]
        starts = set(st.boundaries[0]) if show else set()
        text = _render(tok, all_ids[:decided], starts, show)
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
        if text.startswith(printed):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    x = torch.tensor([ids], device=dev)
    for step in stream(model, x, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                       generator=gen, state_out=states):
        all_ids.append(int(step.tokens[0]))
        n_new += 1
        emit(False)
    if show:  # feed the last token too, to learn whether it starts a concept
        decode_step(model, states[0], torch.tensor([all_ids[-1]], device=dev))
    emit(True)
    sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    note = f"{n_new} tokens in {dt:.2f} s ({n_new / max(dt, 1e-9):.1f} tok/s)"
    if cfg.is_concept:
        st = states[0]
        n_concepts = len(st.boundaries[0])
        note += f", {n_concepts} concepts over {st.tokens.lengths[0]} tokens " \
                f"(R = {st.tokens.lengths[0] / max(n_concepts, 1):.2f})"
    print(note, file=sys.stderr)
    return 0


# ----- bench -----
def cmd_bench_latency(args) -> int:
    from ..latency import LatencySettings, run_latency
    from ..latency_report import format_table, write_outputs

    def load(run_dir):
        from ..checkpoint import load_run

        return load_run(run_dir, args.device)[0]

    s = LatencySettings(preset=args.preset, ratios=args.ratios, strategies=args.strategies,
                        runs=args.run, prefill_lens=args.prefill_lens, kv_lens=args.kv_lens,
                        batch=args.batch, prefill_batch=args.prefill_batch, repeats=args.repeats,
                        decode_steps=args.decode_steps, seed=args.seed, device=args.device,
                        threads=args.threads)
    if not s.prefill_lens and not s.kv_lens:
        raise UserError("nothing to do: both --prefill-lens and --kv-lens are empty")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    result = run_latency(s, load, log)
    paths = write_outputs(result, args.out)
    print(format_table(result), end="")
    print(f"wrote {paths['json']} and {paths['plot']}")
    return 0


def cmd_bench_moe(args) -> int:
    import torch

    from ..hf_bench import ARCHS

    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    if any(a not in ARCHS for a in archs):
        raise UserError(f"unknown --arch {args.arch!r}; choose from {', '.join(ARCHS)} or all")
    if any(n < 1 for n in (args.layers, args.batch, args.seq_len, args.repeats)):
        raise UserError("--layers, --batch, --seq-len and --repeats must be >= 1")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _bench_moe(args, archs)
    finally:
        torch.set_num_threads(threads)


def _bench_moe(args, archs: list[str]) -> int:
    from ..hf_bench import _transformers, compare

    _transformers()  # a one-line error when transformers is missing
    rows = []
    print(f"{'arch':<10} {'part':<10} {'tokens':>6} {'max|diff|':>10} {'fwd ours':>9} {'fwd HF':>9} "
          f"{'HF/ours':>7} {'f+b ours':>9} {'f+b HF':>9} {'HF/ours':>7}")
    for arch in archs:
        for c in compare(arch, args.preset, args.layers, args.batch, args.seq_len, args.repeats,
                         args.hf_experts):
            rows.append(c.to_dict())
            print(f"{c.arch:<10} {c.part:<10} {c.tokens:>6} {c.max_abs_diff:>10.2e} "
                  f"{c.ours_fwd_s * 1e3:>7.1f}ms {c.hf_fwd_s * 1e3:>7.1f}ms {c.fwd_ratio:>7.2f} "
                  f"{c.ours_fwdbwd_s * 1e3:>7.1f}ms {c.hf_fwdbwd_s * 1e3:>7.1f}ms {c.fwdbwd_ratio:>7.2f}",
                  flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_bench.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {out / 'moe_bench.json'}")
    bad = [r for r in rows if r["max_abs_diff"] > 1e-4]
    if bad:
        print(f"error: outputs differ by more than 1e-4 for {', '.join(r['arch'] + '/' + r['part'] for r in bad)}",
              file=sys.stderr)
        return 1
    return 0
