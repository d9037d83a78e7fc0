"""The verdict sentences of the README and the study READMEs, built from the committed records (issue 53).

docs/headline.py writes each between ``<!-- headline:NAME -->`` markers as it does its tables, and
tests/test_claims.py fails when a sentence differs from what its record says now. So the words
that carry a claim — ahead / behind / unresolved / level, how many seeds lie on each side, "every
seed", which machines a pooled row mixes — move with the record, not with the prose. A gap is
ConceptMoE − MoE in held-out bits per byte (< 0: the ConceptMoE is better); the verdict rule is
docs/study/round3/interval.py's.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def _module(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_iv = _module("study/round3/interval.py", "round3_interval_v")
interval = _iv.interval


def _load(rel: str) -> dict:
    return json.loads((DOCS / rel).read_text())


def ci(res: dict, digits: int = 3) -> str:
    lo, hi = res["ci95"]
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]" if lo is not None else "(one seed: no interval)"


def says(res: dict) -> str:
    """The verdict as a clause about the ConceptMoE."""
    return {"ConceptMoE ahead": "the ConceptMoE is ahead", "MoE ahead": "the ConceptMoE is behind",
            "level": "level"}.get(res["verdict"], "unresolved")


def tally(gaps: list[float]) -> str:
    """Which side each seed lies on: "ahead on every seed", "behind on every seed", "ahead on k of n"."""
    n, ahead = len(gaps), sum(g < 0 for g in gaps)
    if ahead == n:
        return "ahead on every seed" if n > 1 else "ahead on its one seed"
    if sum(g > 0 for g in gaps) == n:
        return "behind on every seed" if n > 1 else "behind on its one seed"
    return f"ahead on {ahead} of {n} seeds"


def stated(gaps: list[float], digits: int = 4) -> str:
    """Gap, interval, verdict and tally in one phrase: "-0.0135 [-0.023, -0.004], the ConceptMoE is ahead (...)"."""
    res = interval(gaps)
    return f"{res['mean']:+.{digits}f} {ci(res)}, {says(res)} ({tally(gaps)})"


def spans(lo_hi: list[float]) -> bool:
    return lo_hi[0] is not None and lo_hi[0] < 0 < lo_hi[1]


# --- 1.2M: the pooled 8 seeds, by machine ------------------------------------------------------

D12 = "study/round3/d1.2M-8seeds.json"
RERUN = "study/round3/rerun-1.2M-s0.json"


def by_machine(rec: dict) -> list[tuple[str, list[int], list[float]]]:
    """(machine and round, seeds, gaps) per machine of a record with ``provenance``; "unknown" for a seed without."""
    groups: dict[str, list[int]] = {}
    for s in rec["seeds"]:
        runs = rec.get("provenance", {}).get(str(s), {})
        names = {f"{r['machine']['name']}, round {r['round']}" if isinstance(r, dict) else "unknown machine"
                 for r in (runs.get("moe"), runs.get("cm"))}
        groups.setdefault(" and ".join(sorted(names)), []).append(s)
    gap = dict(zip(rec["seeds"], rec["gaps"]))
    return [(m, ss, [gap[s] for s in ss]) for m, ss in groups.items()]


def seed_range(seeds: list[int]) -> str:
    return f"{seeds[0]}–{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1 else \
        ", ".join(map(str, seeds))


def precision_of(rec: dict) -> str:
    kinds = {r.get("precision") if isinstance(r, dict) else None
             for runs in rec.get("provenance", {}).values() for r in runs.values()}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else "not recorded"


def machines_sentence(rec: dict) -> str:
    parts = by_machine(rec)
    rounds = {r["round"] for runs in rec.get("provenance", {}).values() for r in runs.values() if isinstance(r, dict)}
    head = (f"The {rec['n']} seeds pool {len(parts)} machines and {len(rounds)} rounds" if len(parts) > 1
            else f"The {rec['n']} seeds ran on one kind of machine")
    return head + ": " + "; ".join(f"{m} (seeds {seed_range(ss)}): " + stated(g) for m, ss, g in parts)


CODE_CHECK = "study/round3/code-check-1.2M.json"


def rerun_sentence() -> str:
    out = ""
    if (DOCS / RERUN).is_file():
        r = _load(RERUN)
        d = {k: r["bpb"][k] - r["recorded"][k] for k in ("moe", "cm")}
        out += (f" Seed {r['seed']} rerun on today's code ({r['commit'][:7]}) on a third machine "
                f"({r['machine']['name']}): MoE {d['moe']:+.4f}, ConceptMoE {d['cm']:+.4f} against its "
                f"round-{r['recorded_round']} values, gap {r['gap']:+.4f} (recorded {r['recorded_gap']:+.4f}).")
    if (DOCS / CODE_CHECK).is_file():
        c = _load(CODE_CHECK)
        same = [m for m, x in c["models"].items()
                if x["identical"] and x["weights_identical"] and x["model_config_identical"]]
        old, new = (c["commits"][k][:7] for k in ("old", "new"))
        out += (f" On one machine, commits {old} (round 2's, inferred) and {new} train "
                + ("both models bit for bit alike" if len(same) == len(c["models"]) else
                   f"{' and '.join(same) or 'neither model'} bit for bit alike (the other differs)")
                + f" over the first {c['steps']} steps: every logged figure and the final weights, byte for byte "
                  f"(round 3's `code_check.py`).")
    return out


# --- README: the answers -------------------------------------------------------------------------

def _round2(budget: str) -> tuple[list[float], dict]:
    s = _load(f"study/round2/d{budget}/summary.json")
    ps = {m["label"]: {k: v["val_bpb"] for k, v in m["per_seed"].items()} for m in s["models"]}
    seeds = sorted(set(ps["moe"]) & set(ps["topk-R2"]))
    return [ps["topk-R2"][k] - ps["moe"][k] for k in seeds], s


def _train_hours(budget: str, pairs: int) -> float:
    """Core-hours of training alone (validation excluded) for more paired seeds: one thread per run."""
    import glob
    secs = []
    for f in sorted(glob.glob(str(DOCS / f"study/round2/d{budget}/*/report.json"))):
        rep = json.loads(Path(f).read_text())
        secs += [sum(m["curve_seconds"][-1][0] for m in rep["models"] if m["label"] in ("moe", "topk-R2"))]
    return pairs * statistics.fmean(secs) / 3600


def answers() -> str:
    rec = _load(D12)
    one = (f"- **Equal compute, 1.2M tokens ({rec['n']} seeds): {says(rec)}** ({tally(rec['gaps'])}). "
           f"{machines_sentence(rec)}.{rerun_sentence()}")
    g48, _ = _round2("4.8M")
    g96, _ = _round2("9.6M")
    v48, v96 = says(interval(g48)), says(interval(g96))
    both = f"{v48} at both" if v48 == v96 else f"{v48} at 4.8M, {v96} at 9.6M"
    n = f"{len(g48)} seeds each" if len(g48) == len(g96) else f"{len(g48)} and {len(g96)} seeds"
    two = (f"- **4.8M and 9.6M tokens ({n}): {both}** (the ConceptMoE {tally(g48)} "
           f"at 4.8M, {tally(g96)} at 9.6M). To settle: 8 seeds each, five more pairs per "
           f"budget, about {_train_hours('4.8M', 5):.0f} and {_train_hours('9.6M', 5):.0f} core-hours of training "
           f"alone on the round-2 CPUs (validation adds more), or minutes on a GPU "
           f"([the GPU script](docs/study/gpu/README.md)).")
    conv = _load("study/round3/conversion.json")
    rows = conv["rows"]
    behind = all(r["verdict"] == "MoE ahead" for r in rows)
    best = min(rows, key=lambda r: r["mean"])
    sc = conv["scratch"]["vs_continued_moe"]
    three = (f"- **The paper's conversion (R = 1.5, looped): {'not reproduced' if behind else 'see the table'}.** "
             f"On {len(conv['seeds'])} seeds, against the MoE continued on the same batches, "
             f"{'each of the ' + str(len(rows)) + ' conversions is behind' if behind else _says_each(rows)} "
             f"({_each(rows)}); closest "
             f"{best['label']}, {best['mean']:+.3f} {ci(best)}. Trained from scratch on the same total tokens, the "
             f"ConceptMoE against the continued MoE: {sc['mean']:+.3f} {ci(sc)}, {says(sc)} ({tally(sc['gaps'])}), "
             f"on the conversions' {_slice_tokens():,}-token validation slice (the table's other rows: the whole "
             f"held-out split); part of that margin is schedule, as the continued runs restart warm-up (round 3 §3).")
    return "\n".join([one, two, three])


def _each(rows: list[dict]) -> str:
    t = {r["label"]: tally(r["gaps"]) for r in rows}
    return f"each {t.popitem()[1]}" if len(set(t.values())) == 1 else "; ".join(f"{k} {v}" for k, v in t.items())


def _says_each(rows: list[dict]) -> str:
    return "; ".join(f"{r['label']}: {says(r)}" for r in rows)


def _slice_tokens() -> int:
    vals = {_load(f"study/round3/ct-s{s}/report.json")["settings"]["val_tokens"] for s in (0, 1, 2)}
    assert len(vals) == 1, vals
    return vals.pop()


# --- README: long context and equal wall-clock ----------------------------------------------------

LONG = "study/round3/long-context.json"


def equal_time(L: str, how: str) -> list[float]:
    wc = _load(LONG)["wallclock"][L]
    lab = _load(LONG)["label"]
    return [(w["bpb"] if how == "own" else w["bench"]["bpb"])[lab] - (w["bpb"] if how == "own" else w["bench"]["bpb"])["moe"]
            for _, w in sorted(wc.items())]


def long_words() -> str:
    rec = _load(LONG)
    lab = rec["label"]
    g = {L: [m[lab]["val_bpb"] - m["moe"]["val_bpb"] for _, m in sorted(by.items()) if len(m) == 2]
         for L, by in rec["runs"].items()}
    c = rec["contrasts"]["val_bpb gap at 2048 - at 256"]
    per_seed = [a - b for a, b in zip(g["2048"], g["256"])]
    le = rec["contrasts"]["late - early gap at 2048"]
    shown = interval(g["2048"])["verdict"] == "ConceptMoE ahead" or c["verdict"] == "ConceptMoE ahead"
    return (f"**Long context: {'a ConceptMoE advantage at 2048' if shown else 'not shown'}.** "
            f"Held-out BPB at 2048: {stated(g['2048'])}; at 256: {stated(g['256'])}. The gap at 2048 minus the "
            f"gap at 256 favours the ConceptMoE {tally(per_seed).removeprefix('ahead ')}, "
            f"{c['mean']:+.3f} {ci(c)}, {c['verdict']}; its gap at positions 1024-2048 minus its gap at 1-64: "
            f"{le['mean']:+.3f} {ci(le)}, {le['verdict']}:")


def wallclock_words() -> str:
    rec = _load(LONG)
    speed = {L: next(iter(rec["wallclock"][L].values()))["bench"]["speed"] for L in ("2048", "256")}
    return (f"- **Equal wall-clock** (each model's validation BPB during training, read when the faster one "
            f"ended): from the runs' own "
            f"step times, at 2048 {stated(equal_time('2048', 'own'), 3)}, at 256 {stated(equal_time('256', 'own'), 3)}. "
            f"At the `bench train` speed ratios ({speed['2048']:.2f}× at 2048, {speed['256']:.2f}× at 256) the "
            f"figures are {interval(equal_time('2048', 'bench'))['mean']:+.3f} {ci(interval(equal_time('2048', 'bench')))} "
            f"and {interval(equal_time('256', 'bench'))['mean']:+.3f} {ci(interval(equal_time('256', 'bench')))}: "
            f"upper bounds on the gain, since the MoE is read mid-schedule, before its learning rate decays. The "
            f"MoE of seed 1 at 2048 learned and ran slowly for a cause not found (round 3 §2).")


# --- round 3 README ------------------------------------------------------------------------------

def round3_d12() -> str:
    rec = _load(D12)
    return (f"**{rec['n']} paired seeds: gap {rec['mean']:+.4f}, sd {rec['sd']:.4f}, 95% CI {ci(rec)}: "
            f"{says(rec)}** ({tally(rec['gaps'])}). {machines_sentence(rec)}. Each run's machine, commit (or "
            f"its bounds), recipe, precision, threads, processes, compression and time are in the record's "
            f"`provenance`, \"unknown\" where the runs left nothing.{rerun_sentence()}")


def round3_conversion() -> str:
    head = ("| conversion | activated FLOPs vs MoE | gap per seed (" + " / ".join(map(str, _load(
        "study/round3/conversion.json")["seeds"])) + ") | mean | 95% interval | answer |\n|---|---|---|---|---|---|")
    rows = []
    for r in _load("study/round3/conversion.json")["rows"]:
        ratio, strat = r["label"][1:].split("-")
        rows.append(f"| R = {ratio} `{strat}` | {r['flops_vs_moe']:.2f}× | "
                    f"{' / '.join(f'{g:+.4f}' for g in r['gaps'])} | {r['mean']:+.3f} | {ci(r)} | "
                    f"{says(r)} ({tally(r['gaps'])}) |")
    return "\n".join([head, *rows])


README_BLOCKS = {"answers": answers, "long-words": long_words, "wallclock-words": wallclock_words}
DOC_BLOCKS = {"study/round3/README.md": {"r3-1.2M": round3_d12, "r3-conversion": round3_conversion}}
