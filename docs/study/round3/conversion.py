"""The paper's conversion over independent pretrained MoEs (issue 44, round 3 §3): one table.

    python docs/study/round3/conversion.py NAME CT_DIR_OR_REPORT ... [--scratch RUN ...]

Each CT is one seed's ``conceptmoe compare --init`` output (its report.json, or the directory
holding it): the pretrained MoE of that seed continued beside its conversions (R = 1.5 / 2,
``topk`` / ``loop``), all on the same batches. Per conversion it pairs each seed's held-out BPB
with that seed's continued MoE: gap ConceptMoE - MoE, mean and Student-t 95% interval
(interval.py; the verdict reads lower as better). Activated FLOPs per token stand beside each
(a loop conversion at R = 1.5 cannot match the MoE by whole loops).

``--scratch``: ConceptMoEs trained from scratch for the conversion's total tokens (run
directories, one per seed, ``train --tokens 3600000``): the control the issue asks for. The
conversions are validated on the first ``val_tokens`` (32,768) held-out tokens, so each scratch
run is scored on that same slice (``conceptmoe eval RUN --val-tokens N --json``, cached in
RUN/eval-slice-N.json; its full held-out BPB is kept beside it). Their seeds are paired with the
conversion's seeds where both exist.

Writes docs/study/round3/NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interval import ci_text, interval  # noqa: E402


def read_ct(path: Path) -> dict:
    """{seed, pretrained, tokens, val_tokens, moe: {bpb, flops, compression}, variants: {label: the same}}."""
    rep = json.loads((path / "report.json" if path.is_dir() else path).read_text())
    seed = int(rep["settings"]["seed"])
    out = {"seed": seed, "pretrained": rep["init"], "tokens": rep["settings"]["tokens"],
           "val_tokens": rep["settings"].get("val_tokens", 32768), "variants": {}}
    for m in rep["models"]:
        if m["seeds"] != [seed]:
            raise SystemExit(f"error: {path}: one seed per conversion record (got {m['seeds']} for {m['label']})")
        fig = {"bpb": m["val_bpb"], "flops": m["activated_flops_per_token"], "compression": m["compression"]}
        if m["label"] == "moe":
            out["moe"] = fig
        else:
            out["variants"][m["label"]] = fig
    return out


def read_scratch(run: Path, val_tokens: int) -> tuple[int, dict]:
    cfg = json.loads((run / "config.json").read_text())
    cached = run / f"eval-slice-{val_tokens}.json"
    if not cached.is_file():
        r = subprocess.run([sys.executable, "-m", "conceptmoe", "eval", str(run), "--val-tokens", str(val_tokens), "--json"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"error: conceptmoe eval {run} failed: {r.stderr.strip().splitlines()[-1:]}")
        cached.write_text(r.stdout)
    full = run / "eval.json"
    return int(cfg["train"]["seed"]), {"bpb": json.loads(cached.read_text())["val_bpb"],
                                       "bpb_heldout": json.loads(full.read_text())["val_bpb"] if full.is_file() else None,
                                       "tokens": cfg["train"]["tokens"]}


def build(cts: list[dict], scratch: dict[int, dict]) -> dict:
    seeds = sorted(c["seed"] for c in cts)
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"error: a seed given twice ({seeds})")
    by = {c["seed"]: c for c in cts}
    labels = sorted({lab for c in cts for lab in c["variants"]}, key=lambda s: (float(s[1:].split("-")[0]), "loop" in s, s))
    rows = []
    for lab in labels:
        have = [s for s in seeds if lab in by[s]["variants"]]
        gaps = [by[s]["variants"][lab]["bpb"] - by[s]["moe"]["bpb"] for s in have]
        rows.append({"label": lab, "seeds": have, "moe": [by[s]["moe"]["bpb"] for s in have],
                     "cm": [by[s]["variants"][lab]["bpb"] for s in have], "gaps": gaps, **interval(gaps),
                     "flops_vs_moe": statistics.fmean(by[s]["variants"][lab]["flops"] / by[s]["moe"]["flops"]
                                                      for s in have),
                     "compression": statistics.fmean(by[s]["variants"][lab]["compression"] for s in have)})
    rec = {"seeds": seeds, "pretrained": {str(s): by[s]["pretrained"] for s in seeds},
           "continued_tokens": sorted({c["tokens"] for c in cts}), "rows": rows}
    if scratch:
        both = [s for s in seeds if s in scratch]
        rec["scratch"] = {"seeds": sorted(scratch), "bpb": {str(s): v["bpb"] for s, v in sorted(scratch.items())},
                          "bpb_heldout": {str(s): v["bpb_heldout"] for s, v in sorted(scratch.items())},
                          "tokens": sorted({v["tokens"] for v in scratch.values()})}
        if both:  # scratch against the continued MoE of the same seed (same total tokens)
            gaps = [scratch[s]["bpb"] - by[s]["moe"]["bpb"] for s in both]
            rec["scratch"]["vs_continued_moe"] = {"seeds": both, "gaps": gaps, **interval(gaps)}
    return rec


def markdown(rec: dict) -> str:
    out = [f"Conversions of {len(rec['seeds'])} independently pretrained MoE(s) (seeds "
           f"{', '.join(map(str, rec['seeds']))}), each continued {rec['continued_tokens']} tokens beside the "
           "continued MoE on the same batches. Gap = ConceptMoE - continued MoE, BPB on the conversions' "
           "validation slice (the first val_tokens held-out tokens).", "",
           "| conversion | seeds | activated FLOPs vs MoE | compression | continued MoE | converted | gap | "
           "95% interval | answer |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        out.append(f"| {r['label']} | {len(r['seeds'])} | {r['flops_vs_moe']:.2f}x | {r['compression']:.2f} | "
                   f"{statistics.fmean(r['moe']):.4f} | {statistics.fmean(r['cm']):.4f} | {r['mean']:+.4f} | "
                   f"{ci_text(r)} | {r['verdict']} |")
    sc = rec.get("scratch")
    if sc:
        out += ["", f"From scratch ({sc['tokens']} tokens, the conversion's total), on the conversions' "
                "validation slice: BPB " + ", ".join(f"seed {s} {v:.4f}" for s, v in sc["bpb"].items())]
        v = sc.get("vs_continued_moe")
        if v:
            out[-1] += f"; against the continued MoE of the same seed: {v['mean']:+.4f} {ci_text(v)} ({v['verdict']})."
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("cts", nargs="+", type=Path)
    ap.add_argument("--scratch", type=Path, action="extend", nargs="+", default=[])
    ap.add_argument("--record-dir", type=Path, default=HERE)
    a = ap.parse_args()
    cts = [read_ct(p) for p in a.cts]
    slices = {c["val_tokens"] for c in cts}
    if len(slices) != 1:
        raise SystemExit(f"error: the conversions were validated on different slices ({sorted(slices)} tokens)")
    val_tokens = slices.pop()
    scratch = dict(read_scratch(p, val_tokens) for p in a.scratch)
    rec = build(cts, scratch)
    path = a.record_dir / f"{a.name}.json"
    path.write_text(json.dumps(rec, indent=1, allow_nan=False) + "\n")
    path.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec), end="")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
