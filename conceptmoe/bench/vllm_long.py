"""``conceptmoe bench serve --engine vllm --prompt-lens 1024,2048,4096,8192``: the ConceptMoE against
its MoE in vLLM as prompts grow, where the method says it is faster (CONCEPTMOE.md §3-4; the
paper's Fig. 5, measured in a serving engine).

Per prompt length L, in interleaved rounds (every server started first, then each length's loads
sent to each server in turn, round after round; the median round reported):

- **alone**: one held-out prompt of L tokens, sent alone: TTFT (prefill of L tokens; prefill tok/s
  = L / TTFT) and TPOT (decoding at a KV length of about L);
- **load**: ``requests x max(lens) / L`` prompts of L tokens at once (the same prompt tokens per
  load at every length), at ``--kv-cache-mb`` (meant to bind: vLLM preempts) and, with
  ``--unbound-kv-cache-mb``, at a budget that holds them all: output tok/s, mean running
  requests, preemptions.

Beside each ratio, the pair's analytic limit at that length and the ConceptMoE's realised R on the
prompts (``analytic``): prefill FLOPs with attention, decode FLOPs at KV length L, and KV bytes per
token (requests held at a binding budget).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from ..device import machine
from ..errors import UserError
from .serve import ServeBenchSettings, make_requests
from .vllm_serve import measure, start


def loads(s: ServeBenchSettings, lens: list[int]) -> dict[int, int]:
    """Requests per load at each length: the same prompt tokens at every length."""
    return {L: max(1, round(s.requests * max(lens) / L)) for L in lens}


def realised_ratios(run: str, prompts: dict[int, list[list[int]]]) -> dict[int, float]:
    """Tokens per concept the ConceptMoE ``run``'s router makes on each length's ``prompts``."""
    import torch

    from ..training.checkpoint import load_run

    model, *_ = load_run(run, "cpu")
    model.eval()
    out = {}
    with torch.no_grad():
        for L, ps in prompts.items():
            concepts = sum(int(model(torch.tensor([p])).chunks.b.sum()) for p in ps)
            out[L] = sum(map(len, ps)) / max(concepts, 1)
    return out


def analytic(moe_cfg, cm_cfg, L: int, R: float) -> dict:
    """MoE / ConceptMoE cost ratios at prompt length L and realised R (> 1: the ConceptMoE is cheaper)."""
    from ..model.flops import count_flops

    def decode(cfg, r: float) -> float:  # FLOPs of one token at KV length L, attention over L
        f = count_flops(cfg, L, r)
        hd = 4 * cfg.n_heads * cfg.head_dim * L
        n_tok = cfg.n_layers if not cfg.is_concept else cfg.n_encoder_layers + cfg.n_decoder_layers
        n_con = cfg.n_concept_layers * cfg.concept_loops if cfg.is_concept else 0
        return f["activated_flops_per_token"] + hd * (n_tok + n_con / r ** 2)
    fm, fc = count_flops(moe_cfg, L), count_flops(cm_cfg, L, R)
    prefill = lambda f: f["activated_flops_per_token"] + f["attention_map_flops_per_token"]  # noqa: E731
    return {"prefill": prefill(fm) / prefill(fc), "decode": decode(moe_cfg, 1.0) / decode(cm_cfg, R),
            "kv": fm["kv_cache_bytes_per_token"] / fc["kv_cache_bytes_per_token"]}


def run_vllm_long_bench(s: ServeBenchSettings, held_out: list[int], lens: list[int], unbound_mb: float | None,
                        vllm_args: str = "", repeats: int = 1) -> dict:
    """Both runs (a MoE first, then the ConceptMoE) at every length; see the module docstring."""
    from ..training.checkpoint import load_run_meta

    s.check()
    if len(s.runs) != 2:
        raise UserError("--prompt-lens compares two runs: the MoE, then the ConceptMoE")
    cfgs = [load_run_meta(r)[0] for r in s.runs]
    if cfgs[0].is_concept or not cfgs[1].is_concept:
        raise UserError("--prompt-lens: give the MoE run first, then the ConceptMoE run")
    if any(L < 1 for L in lens) or len(set(lens)) != len(lens):
        raise UserError(f"--prompt-lens must be distinct lengths >= 1 (got {lens})")
    per = loads(s, lens)
    want = {L: make_requests(held_out, replace(s, requests=per[L], prompt_len=L, len_spread=0.0)) for L in lens}
    alone = {L: want[L][:1] for L in lens}
    max_len = max(lens) + s.output_len
    budgets = [("bound", s.kv_cache_mb)] + ([("unbound", unbound_mb)] if unbound_mb else [])
    servers, got = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for budget, mb in budgets:
                for run in s.runs:
                    print(f"bench serve (vLLM, long prompts): starting {run} at {mb:g} MiB ...", file=sys.stderr,
                          flush=True)
                    log = Path(tmp) / f"server-{len(servers)}.log"
                    proc, url = start(run, replace(s, kv_cache_mb=mb), max_len, vllm_args, log)
                    servers.append((budget, run, proc, url))
            for i in range(repeats):
                for L in lens:
                    for budget, run, proc, url in servers:
                        print(f"bench serve (vLLM, long prompts): L={L} {budget} {run} (round {i + 1} of {repeats})",
                              file=sys.stderr, flush=True)
                        if budget == "bound":
                            got.setdefault((run, L, "alone"), []).append(measure(url, run, alone[L], s, running=False))
                        got.setdefault((run, L, budget), []).append(measure(url, run, want[L], s))
        finally:
            for *_, proc, _url in servers:
                proc.terminate()
            for *_, proc, _url in servers:
                proc.wait(120)
    rows = []
    ratios = realised_ratios(s.runs[1], {L: [r["prompt"] for r in want[L][:4]] for L in lens})
    for L in lens:
        R = ratios[L]
        row = {"prompt_len": L, "requests": per[L], "realised_R": R, "analytic": analytic(*cfgs, L, R)}
        for kind, run in zip(("moe", "conceptmoe"), s.runs):
            a = got[(run, L, "alone")]
            ttft = statistics.median(m["ttft_s"]["mean"] for m in a)
            tpot = statistics.median(m["tpot_s"]["mean"] for m in a if m["tpot_s"]["mean"] is not None)
            row[kind] = {"run": run, "ttft_s": ttft, "prefill_tok_s": L / ttft, "tpot_s": tpot,
                         **{b: _median_load(got[(run, L, b)]) for b, _ in budgets}}
        rows.append(row)
    return {"settings": {**s.__dict__, "engine": "vllm", "prompt_lens": lens, "unbound_kv_cache_mb": unbound_mb,
                         "vllm_args": vllm_args, "repeats": repeats, "interleaved": True},
            "machine": machine(), "rows": rows}


def _median_load(rounds: list[dict]) -> dict:
    keys = ("output_tokens_per_s", "mean_concurrent", "preemptions")
    mid = sorted(rounds, key=lambda m: m["output_tokens_per_s"])[(len(rounds) - 1) // 2]
    return {**{k: mid[k] for k in keys}, "rounds": [m["output_tokens_per_s"] for m in rounds]}


def format_long_table(report: dict) -> str:
    head = ("| prompt | realised R | TTFT MoE / CM (s) | prefill speed-up (limit) | TPOT MoE / CM (ms) | decode "
            "speed-up (limit) | out tok/s bound MoE / CM | ratio (KV limit) | running MoE / CM | out tok/s "
            "unbound ratio |")
    lines = [head, "|" + "---|" * 10]
    for r in report["rows"]:
        m, c, a = r["moe"], r["conceptmoe"], r["analytic"]
        bound = c["bound"]["output_tokens_per_s"] / m["bound"]["output_tokens_per_s"]
        unbound = (f"{c['unbound']['output_tokens_per_s'] / m['unbound']['output_tokens_per_s']:.2f}x"
                   if "unbound" in m else "-")
        lines.append(
            f"| {r['prompt_len']} | {r['realised_R']:.2f} | {m['ttft_s']:.2f} / {c['ttft_s']:.2f} "
            f"| {m['ttft_s'] / c['ttft_s']:.2f}x ({a['prefill']:.2f}x) | {1000 * m['tpot_s']:.1f} / "
            f"{1000 * c['tpot_s']:.1f} | {m['tpot_s'] / c['tpot_s']:.2f}x ({a['decode']:.2f}x) "
            f"| {m['bound']['output_tokens_per_s']:.1f} / {c['bound']['output_tokens_per_s']:.1f} "
            f"| {bound:.2f}x ({a['kv']:.2f}x) | {m['bound']['mean_concurrent']:.1f} / "
            f"{c['bound']['mean_concurrent']:.1f} | {unbound} |")
    mc = report["machine"]
    st = report["settings"]
    lines.append(f"\n{mc['cpu_model']} ({mc['cpu_count']} cores; {', '.join(mc['cpu_flags'])}); bound at "
                 f"{st['kv_cache_mb']:g} MiB, unbound at {st['unbound_kv_cache_mb'] or '-'} MiB, {st['dtype']}; "
                 f"median of {st['repeats']} interleaved rounds")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """ConceptMoE / MoE speed against prompt length: prefill, decode, output at a binding budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    x = [r["prompt_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["moe"]["ttft_s"] / r["conceptmoe"]["ttft_s"] for r in rows], "o-", label="prefill (TTFT)")
    ax.plot(x, [r["moe"]["tpot_s"] / r["conceptmoe"]["tpot_s"] for r in rows], "s-", label="decode (TPOT)")
    ax.plot(x, [r["conceptmoe"]["bound"]["output_tokens_per_s"] / r["moe"]["bound"]["output_tokens_per_s"]
                for r in rows], "^-", label="output tok/s, binding budget")
    ax.plot(x, [r["analytic"]["prefill"] for r in rows], "o:", color="C0", alpha=0.5, label="prefill limit")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ConceptMoE speed / MoE speed")
    ax.set_title("ConceptMoE vs MoE in vLLM, by prompt length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
