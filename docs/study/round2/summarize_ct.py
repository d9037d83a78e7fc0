"""Collect the continual-training runs of round 2 (issue 22) over seeds.

    python docs/study/round2/summarize_ct.py NAME runs/study22/ct-s0 runs/study22/ct-s1 ...
    python docs/study/round2/summarize_ct.py NAME runs/study22/ct/s0 runs/study22/ct/s1 ...

Each directory is one seed, either a folder holding ``moe/`` (the MoE pretrained with `conceptmoe
train --model moe`) and ``compare/`` (`conceptmoe compare --init DIR/moe`: the MoE continued and its
conversions, the same extra tokens, the same seed), or a `compare --init` output itself (its
pretrained MoE is the run named in its report.json ``init``; several seeds may continue one
pretrained MoE). Pairs the conversions with the continued MoE of their seed and writes
docs/study/round2/NAME/: summary.json and table.md (per model: held-out BPB at the switch and at the
end, the switch cost and the final gap to the continued MoE as mean ± sd over seeds, the tokens each
seed took to get back to the MoE's starting BPB), plus each seed's report.md, report.json and
curves.png under a folder named as its directory (ct-sS, sS).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _ms(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _fmt(m: float, s: float | None, signed: bool = False) -> str:
    v = f"{m:+.4f}" if signed else f"{m:.4f}"
    return v if s is None else f"{v} ± {s:.4f}"


def collect(dirs: list[Path]) -> dict:
    seeds, models = {}, {}
    for d in dirs:
        ct = d / "compare" if (d / "compare" / "report.json").is_file() else d
        rep = json.loads((ct / "report.json").read_text())
        seed = d.name  # the directory's name (ct-sS: the pretraining seed; sS: the CT seed)
        pre = json.loads((Path(rep["init"]) / "eval.json").read_text())
        seeds[seed] = {"pretrain_val_bpb": pre["val_bpb"], "pretrained": rep["init"],
                       "ct_seed": rep["settings"]["seed"], "dir": str(ct)}
        base = rep["models"][0]  # the continued MoE
        for r in rep["models"]:
            cell = models.setdefault(r["label"], {"label": r["label"], "name": r["name"], "per_seed": {}})
            cell["per_seed"][seed] = {
                "val_bpb_start": r["val_bpb_start"], "val_bpb": r["val_bpb"],
                "switch_cost": r["val_bpb_start"] - base["val_bpb_start"],
                "gap": r["val_bpb"] - base["val_bpb"], "recovered_at_tokens": r["recovered_at_tokens"],
                "compression_start": r["compression_start"], "compression": r["compression"],
                "activated_mflops": r["activated_flops_per_token"] / 1e6}
    for cell in models.values():
        rows = list(cell["per_seed"].values())
        for key in ("val_bpb_start", "val_bpb", "switch_cost", "gap", "compression"):
            cell[key] = _ms([r[key] for r in rows])
        m, s = cell["gap"]
        cell["gap_in_sd"] = None if not s else m / s
    settings = rep["settings"]
    return {"settings": {k: settings[k] for k in ("tokens", "batch_size", "seq_len", "lr")},
            "seeds": seeds, "models": list(models.values())}


def table(summary: dict) -> str:
    lines = ["| run | model | seeds | BPB at the switch | BPB at the end | switch cost | gap to the continued MoE "
             "| gap / sd | back at (tokens, per seed) | compression (end) | MFLOPs/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["models"]:
        per = c["per_seed"]
        back = ", ".join("-" if r["recovered_at_tokens"] is None else f"{r['recovered_at_tokens']:,}"
                         for r in per.values())
        ratio = "" if c["gap_in_sd"] is None else f"{c['gap_in_sd']:+.1f}"
        lines.append(f"| {c['label']} | {c['name']} | {len(per)} | {_fmt(*c['val_bpb_start'])} | {_fmt(*c['val_bpb'])} "
                     f"| {_fmt(*c['switch_cost'], signed=True)} | {_fmt(*c['gap'], signed=True)} | {ratio} | {back} "
                     f"| {c['compression'][0]:.2f} | {next(iter(per.values()))['activated_mflops']:.2f} |")
    by_run: dict[str, list[str]] = {}  # pretrained MoE -> the seeds that continue it
    for s, v in sorted(summary["seeds"].items()):
        by_run.setdefault(v["pretrained"], []).append(s)
    pre = "; ".join(f"{Path(run).parent.name}/{Path(run).name} ({', '.join(ss)}): "
                    f"{summary['seeds'][ss[0]]['pretrain_val_bpb']:.4f}" for run, ss in by_run.items())
    note = (" Every seed continues the same pretrained MoE: the sd is the spread over batch orders and "
            "boundary samples only, not over pretrained models." if len(by_run) == 1 < len(summary["seeds"]) else "")
    return ("\n".join(lines) + f"\n\nThe pretrained MoEs' held-out BPB at the end of pretraining, on the whole "
            f"held-out split (the columns above use the CT runs' validation slice): {pre}.{note}\n")


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: summarize_ct.py NAME SEED_DIR [SEED_DIR ...]")
    name, dirs = argv[0], [Path(a) for a in argv[1:]]
    summary = collect(dirs)
    out = HERE / name
    out.mkdir(parents=True, exist_ok=True)
    for seed, info in summary["seeds"].items():
        dst = out / seed
        dst.mkdir(exist_ok=True)
        for f in ("report.md", "report.json", "curves.png"):
            shutil.copyfile(Path(info["dir"]) / f, dst / f)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (out / "table.md").write_text(table(summary))
    print(table(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
