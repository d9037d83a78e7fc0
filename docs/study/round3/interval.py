"""The paired gap of a ConceptMoE to the MoE with its 95% interval, over any number of seeds (issue 44).

    python docs/study/round3/interval.py NAME [--label topk-R2] [--keep SUMMARY.json ...] COMPARE_DIR ...

A compare still running counts with its finished runs (their eval.json). The record keeps every
seed's BPB, paired or not (``per_seed``), so ``--keep NAME.json`` carries them to a later machine.

Reads each ``conceptmoe compare`` output's report.json (per-seed held-out BPB of the ``moe`` model
and of ``--label``), and with ``--keep`` the per-seed rows of a round-2 ``summarize.py`` summary
(runs whose directories are gone); a seed found twice is taken from the later source, the
difference printed. Pairs by
seed (a seed fixes the initialisation and the batch order of both models), and writes
docs/study/round3/NAME.json: the per-seed gaps (ConceptMoE - MoE, > 0: the MoE is better), their
mean, standard deviation and Student-t 95% interval, and the verdict the issue asks for: "level"
when the interval lies within ±0.01, who wins when it excludes 0, else "unresolved".

Every run also leaves its provenance (issue 53), ``provenance[seed][moe|cm]``: machine (CPU model
and flags), code commit, the resolved recipe, precision, threads and processes, realised
compression and wall time, read from the run's config.json, recipe.toml, eval.json and
metrics.jsonl; ``--jobs`` (processes at once) is not in a run's files, so it is given here. A
``--keep`` record's provenance is carried; what a record cannot say is "unknown".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
# two-sided 95% quantiles of Student's t, df = 1..30
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042]
LEVEL = 0.01


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else 1.96


def per_seed_of_report(path: Path, label: str) -> dict[str, dict[int, float]]:
    """A compare output's report.json; for a compare still running, its finished runs' eval.json."""
    if not (path / "report.json").is_file():
        out = {}
        for kind, lab in (("moe", "moe"), ("cm", label)):
            out[kind] = {int(e.parent.name.removeprefix("seed")): json.loads(e.read_text())["val_bpb"]
                         for e in sorted((path / lab).glob("seed*/eval.json"))}
        return out
    rep = json.loads((path / "report.json").read_text())
    out: dict[str, dict[int, float]] = {}
    for m in rep["models"]:
        if m["label"] in ("moe", label):
            out["moe" if m["label"] == "moe" else "cm"] = dict(zip(m["seeds"], m["val_bpb_seeds"]))
    return out


def per_seed_of_summary(path: Path, label: str) -> dict[str, dict[int, float]]:
    """A round-2 summarize.py summary, or a record this script wrote (its ``per_seed``)."""
    rep = json.loads(path.read_text())
    if "per_seed" in rep:
        return {k: {int(s): v for s, v in d.items()} for k, d in rep["per_seed"].items()}
    out: dict[str, dict[int, float]] = {}
    for m in rep["models"]:
        if m["label"] in ("moe", label):
            out["moe" if m["label"] == "moe" else "cm"] = {int(s): r["val_bpb"] for s, r in m["per_seed"].items()}
    return out


UNKNOWN = "unknown"


def provenance_of_run(run: Path, jobs: int | str = UNKNOWN) -> dict:
    """What one finished run says about how it was made (``UNKNOWN`` where it says nothing)."""
    cfg = json.loads((run / "config.json").read_text())
    env = (cfg.get("environment") or {}).get("start", {})
    resumed = (cfg.get("environment") or {}).get("resumed_on", [])
    ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in line]
    prev, train_s = 0, 0.0
    for m in steps:  # tokens is cumulative, tokens_per_s is that step's: training time, validation excluded
        train_s += (m["tokens"] - prev) / m["tokens_per_s"]
        prev = m["tokens"]
    return {"machine": {"cpu_model": env.get("cpu_model", UNKNOWN), "cpu_flags": env.get("cpu_flags", UNKNOWN),
                        "gpu": env.get("gpu")},
            "commit": env.get("commit", UNKNOWN), "recipe": (run / "recipe.toml").read_text()
            if (run / "recipe.toml").is_file() else UNKNOWN,
            "precision": cfg.get("precision", UNKNOWN), "threads": env.get("threads", UNKNOWN),
            "processes": {"world": env.get("world", UNKNOWN), "jobs": jobs},
            "torch": env.get("torch", UNKNOWN), "resumed_on": len(resumed),
            "compression": ev.get("compression", UNKNOWN), "train_s": round(train_s, 1) if steps else UNKNOWN,
            "wall_s": UNKNOWN, "source": str(run)}


def provenance_of_report(path: Path, label: str, jobs: int | str) -> dict[str, dict[str, dict]]:
    """Each seed's runs of a compare output (finished runs only)."""
    out: dict[str, dict[str, dict]] = {}
    for kind, lab in (("moe", "moe"), ("cm", label)):
        for run in sorted((path / lab).glob("seed*")):
            if (run / "eval.json").is_file():
                out.setdefault(run.name.removeprefix("seed"), {})[kind] = provenance_of_run(run, jobs)
    return out


def merge(sources: list[dict[str, dict[int, float]]]) -> dict[str, dict[int, float]]:
    merged: dict[str, dict[int, float]] = {"moe": {}, "cm": {}}
    for src in sources:
        for kind, seeds in src.items():
            for s, v in seeds.items():
                if s in merged[kind] and abs(merged[kind][s] - v) > 1e-9:  # a rerun, e.g. on another machine
                    print(f"note: seed {s} of the {kind} model: {merged[kind][s]:.6f} kept, {v:.6f} here "
                          f"({v - merged[kind][s]:+.6f}); the later source counts")
                merged[kind][s] = v
    return merged


def interval(gaps: list[float]) -> dict:
    n = len(gaps)
    mean = statistics.fmean(gaps)
    sd = statistics.stdev(gaps) if n > 1 else None
    half = t95(n - 1) * sd / math.sqrt(n) if sd is not None else None
    lo, hi = (mean - half, mean + half) if half is not None else (None, None)
    if half is None:
        verdict = "unresolved (one seed)"
    elif -LEVEL <= lo and hi <= LEVEL:
        verdict = "level"
    elif hi < 0:
        verdict = "ConceptMoE ahead"
    elif lo > 0:
        verdict = "MoE ahead"
    else:
        verdict = "unresolved"
    return {"n": n, "mean": mean, "sd": sd, "ci95": [lo, hi], "verdict": verdict}


def ci_text(res: dict) -> str:
    """An interval's 95% CI as "[lo, hi]", or "-" when there is none (one seed)."""
    lo, hi = res["ci95"]
    return f"[{lo:+.4f}, {hi:+.4f}]" if lo is not None else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("dirs", nargs="*", type=Path)
    p.add_argument("--label", default="topk-R2")
    p.add_argument("--keep", action="append", type=Path, default=[])
    p.add_argument("--jobs", default=UNKNOWN, help="runs trained at once by the compare of DIRS (not in its files)")
    a = p.parse_intermixed_args()
    sources = [per_seed_of_summary(k, a.label) for k in a.keep]
    sources += [per_seed_of_report(d, a.label) for d in a.dirs if d.is_dir()]
    m = merge(sources)
    seeds = sorted(set(m["moe"]) & set(m["cm"]))
    if not seeds:
        raise SystemExit("error: no seed has both models")
    gaps = [m["cm"][s] - m["moe"][s] for s in seeds]
    prov: dict[str, dict] = {}
    for k in a.keep:  # a record's hand-recovered provenance, then what run directories say
        prov.update(json.loads(k.read_text()).get("provenance", {}))
    for d in a.dirs:
        if d.is_dir():
            for s, runs in provenance_of_report(d, a.label, a.jobs).items():
                prov[s] = {**prov.get(s, {}), **runs}
    res = {"label": a.label, "seeds": seeds, "moe": [m["moe"][s] for s in seeds], "cm": [m["cm"][s] for s in seeds],
           "gaps": gaps, **interval(gaps),
           "per_seed": {k: {str(s): v for s, v in sorted(d.items())} for k, d in m.items()},  # unpaired too
           "provenance": {str(s): prov.get(str(s), {"moe": UNKNOWN, "cm": UNKNOWN}) for s in seeds}}
    (HERE / f"{a.name}.json").write_text(json.dumps(res, indent=2, allow_nan=False) + "\n")
    print(f"{a.name}: {res['n']} seeds, gap {res['mean']:+.4f} (sd {res['sd'] or 0:.4f}), 95% CI {ci_text(res)}: "
          f"{res['verdict']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
