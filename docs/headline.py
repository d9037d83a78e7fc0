"""The README's headline tables, built from the committed records under docs/ (issue 42).

    python docs/headline.py           # print every table
    python docs/headline.py --write   # rewrite the README's tables in place (between their markers)

The verdict sentences (README answers, the study READMEs' generated paragraphs) come from
docs/verdicts.py and are written the same way (issue 53).

Each table sits in README.md between ``<!-- headline:NAME -->`` and ``<!-- /headline:NAME -->``;
tests/test_claims.py rebuilds them from the records and fails when the README differs, so a
figure in a headline table cannot drift from the file it comes from. Paired gaps are
ConceptMoE − MoE in held-out bits per byte (> 0: the MoE is better), with a Student-t 95%
interval over seeds; the answer is "level" only if the interval lies within ±0.01, a winner only
if it excludes 0, else "unresolved" (docs/study/round3/interval.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
from pathlib import Path

DOCS = Path(__file__).resolve().parent
README = DOCS.parent / "README.md"


def _interval_module():
    spec = importlib.util.spec_from_file_location("round3_interval", DOCS / "study/round3/interval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


interval = _interval_module().interval


def _verdicts_module():
    spec = importlib.util.spec_from_file_location("verdicts", DOCS / "verdicts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


verdicts = _verdicts_module()


def _load(rel: str) -> dict:
    return json.loads((DOCS / rel).read_text())


def _per_seed(summary: dict, label: str) -> dict[str, float]:
    m = next(m for m in summary["models"] if m["label"] == label)
    return {s: r["val_bpb"] for s, r in m["per_seed"].items()}


def _precision(summary: dict, label: str) -> str:
    m = next(m for m in summary["models"] if m["label"] == label)
    kinds = {r.get("precision") for r in m["per_seed"].values()}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else "not recorded"


def _ci(res: dict) -> str:
    lo, hi = res["ci95"]
    return f"[{lo:+.3f}, {hi:+.3f}]" if lo is not None else "-"


def _row(budget: str, what: str, moe: dict, cm: dict, precision: str, source: str) -> str:
    seeds = sorted(set(moe) & set(cm), key=str)
    res = interval([cm[s] - moe[s] for s in seeds])
    return (f"| {budget} | {what} | {len(seeds)} | {precision} | {statistics.fmean(moe[s] for s in seeds):.4f} | "
            f"{statistics.fmean(cm[s] for s in seeds):.4f} | {res['mean']:+.4f} | {_ci(res)} | {res['verdict']} | "
            f"[record]({source}) |")


def quality() -> str:
    head = ("| budget | ConceptMoE (vs the `small` MoE) | seeds | precision | MoE BPB | ConceptMoE BPB | paired gap "
            "| 95% interval | answer | source |\n|---|---|---|---|---|---|---|---|---|---|")
    r3 = _load("study/round3/d1.2M-8seeds.json")
    machines = len(verdicts.by_machine(r3))
    rows = [_row("1.2M", f"default (2 + 4 + 2){f', {machines} machines pooled' if machines > 1 else ''}",
                 dict(zip(r3["seeds"], r3["moe"])), dict(zip(r3["seeds"], r3["cm"])),
                 verdicts.precision_of(r3), "docs/study/round3/d1.2M-8seeds.json")]
    for budget in ("1.2M", "4.8M", "9.6M"):
        rel = f"study/round2/d{budget}/summary.json"
        s = _load(rel)
        if budget != "1.2M":  # at 1.2M round 3's seeds include round 2's
            rows.append(_row(budget, "default (2 + 4 + 2)", _per_seed(s, "moe"), _per_seed(s, "topk-R2"),
                             _precision(s, "topk-R2"), f"docs/{rel}"))
        if any(m["label"] == "fixed-chunks" for m in s["models"]):
            rows.append(_row(budget, "fixed chunks (every 2nd token)", _per_seed(s, "moe"),
                             _per_seed(s, "fixed-chunks"), _precision(s, "fixed-chunks"), f"docs/{rel}"))
    ct = _load("study/round2/ct-2+4+2/summary.json")
    rows.append(_row("2.4M + 1.2M", "converted at R = 2 (`topk`), one pretrained MoE continued on 3 batch orders",
                     _per_seed(ct, "moe"), _per_seed(ct, "R2-topk"), "fp32", "docs/study/round2/ct-2+4+2/summary.json"))
    conv = _load("study/round3/conversion.json")  # round 3: one independently pretrained MoE per seed
    own = len(set(conv["pretrained"].values())) == len(conv["seeds"])  # one pretrained MoE per seed, or shared
    for r in conv["rows"]:
        if r["label"] in ("R1.5-loop2", "R2-topk"):
            what = (f"converted at R = {r['label'][1:].split('-')[0]}, `{r['label'].split('-')[1]}` "
                    f"({r['flops_vs_moe']:.2f}× FLOPs), "
                    f"{'each seed its own pretrained MoE' if own else 'one pretrained MoE for every seed'}")
            rows.append(_row("2.4M + 1.2M", what, dict(zip(r["seeds"], r["moe"])), dict(zip(r["seeds"], r["cm"])),
                             "fp32", "docs/study/round3/conversion.json"))
    return "\n".join([head, *rows])


def latency() -> str:
    head = ("| trained pair (`python-stdlib`) | where | prefill 4K | prefill 16K | decode at KV 4K | "
            "decode at KV 16K | realised R in decode | KV cache vs MoE | source |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for budget, seed, rel in (("1.2M", 0, "study/round2/d1.2M/latency-s0/latency.json"),
                              ("9.6M", 2, "study/round2/d9.6M/latency-s2/latency.json"),
                              ("36M (12 epochs)", 0, "study/gpu/h200-seq2048-36M/latency/latency.json"),
                              ("5.8M (2 epochs)", 0, "study/gpu/h200-seq2048-5.8M/latency/latency.json")):
        rec = _load(rel)
        moe, cm = f"MoE-top4[seed{seed}]", f"ConceptMoE-1L-top10-R2[seed{seed}]"

        def speedup(kind: str, key: str, n: int) -> str:
            t = {r["model"]: r["median_s"] for r in rec[kind] if r[key] == n}
            return f"{t[moe] / t[cm] - 1:+.0%}"

        st = rec["settings"]
        where = (f"{rec['machine']['gpu']}, {rec['dtype']}, decode batch {st['batch']}" if st["device"].startswith("cuda")
                 else f"CPU, {rec['dtype']}, {rec['threads']} thread")
        rs = sorted({round(r["compression"], 2) for r in rec["decode"] if r["model"] == cm})
        kv = sorted({round(r["kv_ratio_vs_moe"], 2) for r in rec["kv_check"] if r["model"] == cm})
        rows.append(f"| {budget} seed {seed} | {where} | {speedup('prefill', 'tokens', 4096)} | "
                    f"{speedup('prefill', 'tokens', 16384)} | {speedup('decode', 'kv_len', 4096)} | "
                    f"{speedup('decode', 'kv_len', 16384)} | {' / '.join(f'{r:.2f}' for r in rs)} "
                    f"({st['decode_steps']} steps) | {' / '.join(f'{k:.2f}' for k in kv)}× | "
                    f"[record](docs/{rel}) |")
    return "\n".join([head, *rows])


SERVING = (  # record, engine, note
    ("serving/fp32-64mb.json", "built-in", ""),
    ("serving/fp32-512mb.json", "built-in", ""),
    ("serving/bf16-12mb.json", "built-in", ""),
    ("serving/vllm-mixed-32mb/serve.json", "vLLM", "the default pair, estimates, both compiled"),
    ("serving/vllm-mixed-512mb/serve.json", "vLLM", "the default pair, estimates, both compiled"),
    ("serving/vllm-deep-mixed-64mb/serve.json", "vLLM", "the deep pair (2 + 12 + 2), both compiled"),
    ("serving/vllm-shared-prefix/serve.json", "vLLM",
     "6 shared system prompts of 1200 tokens, 8 at a time, prefix caching on both, the default pair"),
    ("serving/vllm-chat/serve.json", "vLLM", "chat, 8 conversations of 4 turns, prefix caching on both, the default pair"),
)


def held(row: dict, engine: str) -> str:
    """Sequences a run held: the built-in server's peak; vLLM's mean running requests (its peak is
    the admission burst, first chunks only), the peak where an older record has no mean."""
    if engine == "vLLM" and "mean_concurrent" in row:
        return f"{row['mean_concurrent']:.1f}"
    return str(row["peak_concurrent"])


def serving() -> str:
    recs = [(_load(rel), rel, engine, note) for rel, engine, note in SERVING]
    cores = {r["machine"]["cpu_count"] for r, *_ in recs}
    where = f"{cores.pop()}-core CPU" if len(cores) == 1 else "CPUs of different sizes"
    head = (f"| engine, KV budget (`bench serve`, {where}) | out tok/s MoE | out tok/s ConceptMoE | "
            "ConceptMoE / MoE | sequences held, ConceptMoE vs MoE (built-in: peak; vLLM: mean running in "
            "the record's median round) | KV bytes per token (built-in) or capacity in tokens (vLLM), ConceptMoE vs "
            "MoE | source |\n|---|---|---|---|---|---|---|")
    rows = []
    for rec, rel, engine, note in recs:
        moe, cm = (next(r for r in rec["rows"] if r["kind"] == k) for k in ("moe", "conceptmoe"))
        s = rec["settings"]
        # vLLM admits at first-chunk size, so its peak can reach every request even where memory binds
        preempted = engine == "vLLM" and moe["preemptions"] > 0
        at_once = min(s["requests"], s.get("concurrency") or s["requests"])  # what the load offers at once
        peak_short = min(moe["peak_concurrent"], cm["peak_concurrent"]) < at_once and s.get("workload") != "chat"
        binds = "binds" if preempted or peak_short else "does not bind"
        shape = f"{s['requests']} × {s['prompt_len']} + {s['output_len']}"
        if s.get("len_spread"):
            shape += f" (lengths ±{s['len_spread']:.0%})"
        kv = (f"{cm['kv_bytes_per_token']:.0f} vs {moe['kv_bytes_per_token']:.0f}" if engine == "built-in"
              else f"{cm['kv_cache_tokens']} vs {moe['kv_cache_tokens']} tokens")
        what = ", ".join(x for x in (f"{s['kv_cache_mb']:g} MiB", s["dtype"], shape, binds, note) if x)
        rows.append(f"| {engine}, {what} | {moe['output_tokens_per_s']:.0f} | {cm['output_tokens_per_s']:.0f} | "
                    f"{cm['output_tokens_per_s'] / moe['output_tokens_per_s']:.2f}× | "
                    f"{held(cm, engine)} vs {held(moe, engine)} | {kv} | [record](docs/{rel}) |")
    return "\n".join([head, *rows])


def elastic() -> str:
    head = ("| R | specialist BPB | elastic BPB | elastic − specialist (2 seeds) | 95% interval | "
            "realised R (specialist / elastic) |\n|---|---|---|---|---|---|")
    cells = _load("study-elastic/summary.json")["cells"]
    rows = []
    for c in (c for c in cells if c["kind"] == "anneal-elastic-router"):
        fixed = next(f for f in cells if f["kind"] == f"anneal-fixed-R{c['ratio']:g}")
        res = interval(c["gap_vs_fixed_seeds"])
        rows.append(f"| {c['ratio']:g} | {fixed['val_bpb']:.4f} | {c['val_bpb']:.4f} | {res['mean']:+.3f} | "
                    f"{_ci(res)} | {fixed['compression']:.2f} / {c['compression']:.2f} |")
    return "\n".join([head, *rows])


LONG = "study/round3/long-context.json"


def long_context() -> str:
    """Round 3's long-context pairs: what training at 2048 changes, figure by figure."""
    head = ("| at 2.4M tokens (`python-stdlib`, fp32) | trained at | seeds | MoE | ConceptMoE | paired gap | "
            "95% interval | answer |\n|---|---|---|---|---|---|---|---|")
    rec = _load(LONG)
    spec = importlib.util.spec_from_file_location("round3_long_context", DOCS / "study/round3/long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    figures = mod.figures  # the flat figures of one run, as the record's gaps take them
    rows = []
    names = {"val_bpb": "held-out BPB", "position 1024-2048": "BPB at positions 1024-2048 of a document",
             "needle 2048 acc": "needle at 2K: accuracy (chance 0.25)",
             "copy 1856 gain": "copy gain, span 1856 tokens back"}
    for L, by in sorted(rec["runs"].items(), key=lambda kv: -int(kv[0])):
        pairs = {s: m for s, m in by.items() if len(m) == 2}
        if not pairs:
            continue
        fig = {s: {lab: figures(m[lab]) for lab in m} for s, m in pairs.items()}
        keys = list(names) if L == "2048" else ["val_bpb"]
        for k in keys:
            moe = {s: f["moe"][k] for s, f in fig.items()}
            cm = {s: f[rec["label"]][k] for s, f in fig.items()}
            res = interval([cm[s] - moe[s] for s in moe])
            answer = "higher is better" if k.endswith(("acc", "gain")) else res["verdict"]
            rows.append(f"| {names[k]} | {L} | {len(moe)} | {statistics.fmean(moe.values()):.4f} | "
                        f"{statistics.fmean(cm.values()):.4f} | {res['mean']:+.4f} | {_ci(res)} | {answer} |")
        for how, label in (("own", "BPB at equal training time, the runs' own step times"),
                           ("bench", "BPB at equal training time, `bench train` speed ({:.2f}×): an upper bound, "
                                     "the MoE read mid-schedule")):
            if rec["wallclock"].get(L):
                gaps = verdicts.equal_time(L, how)
                res = interval(gaps)
                w = sorted(rec["wallclock"][L].items())
                pick = (lambda x: x["bpb"]) if how == "own" else (lambda x: x["bench"]["bpb"])
                rows.append(f"| {label.format(w[0][1]['bench']['speed'])} | {L} | {len(gaps)} | "
                            f"{statistics.fmean(pick(x)['moe'] for _, x in w):.4f} | "
                            f"{statistics.fmean(pick(x)[rec['label']] for _, x in w):.4f} | {res['mean']:+.4f} | "
                            f"{_ci(res)} | {res['verdict']} |")
    contrasts = {"late - early gap at 2048": ("gap at positions 1024-2048 minus gap at 1-64", "2048"),
                 "val_bpb gap at 2048 - at 256": ("held-out BPB gap at 2048 minus at 256, per seed", "both")}
    for k, (label, where) in contrasts.items():
        c = rec.get("contrasts", {}).get(k)
        if c:
            rows.append(f"| {label} | {where} | {c['n']} | - | - | {c['mean']:+.4f} | {_ci(c)} | {c['verdict']} |")
    return "\n".join([head, *rows])


TABLES = {"quality": quality, "latency": latency, "serving": serving, "elastic": elastic, "long": long_context,
          **verdicts.README_BLOCKS}
DOC_BLOCKS = verdicts.DOC_BLOCKS  # the study READMEs' generated sentences and tables, by path under docs/


def block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- headline:{name} -->\n)(.*?)(<!-- /headline:{name} -->)", re.S)


def write(text: str, blocks: dict = TABLES, where: str = "README.md") -> str:
    for name, build in blocks.items():
        pat = block(name)
        if not pat.search(text):
            raise SystemExit(f"error: {where} has no <!-- headline:{name} --> block")
        text = pat.sub(lambda m, t=build(): m.group(1) + t + "\n" + m.group(3), text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the tables in README.md")
    a = p.parse_args()
    if a.write:
        README.write_text(write(README.read_text()))
        for rel, blocks in DOC_BLOCKS.items():
            (DOCS / rel).write_text(write((DOCS / rel).read_text(), blocks, rel))
    else:
        for name, build in [*TABLES.items(), *(kv for b in DOC_BLOCKS.values() for kv in b.items())]:
            print(f"## {name}\n\n{build()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
