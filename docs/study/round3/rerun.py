"""One recorded seed of the 1.2M study trained again on today's code, against its record (issue 53).

    OMP_NUM_THREADS=1 conceptmoe compare --config recipes/study/compare-1.2M.toml --seeds 0 --jobs 1 \\
        --out runs/rerun53/d1.2M-s0
    python docs/study/round3/rerun.py runs/rerun53/d1.2M-s0 --seed 0 --wall-s SECONDS --out rerun-1.2M-s0

Writes docs/study/round3/OUT.json: both runs' held-out BPB beside the values d1.2M-8seeds.json
holds for that seed, the differences, and each run's provenance (interval.provenance_of_run:
machine, commit, resolved recipe, precision, threads and processes, realised compression,
training seconds), with the comparison's wall time as measured outside it. A rerun on another
machine differs in its kernels (AVX2 / AVX-512 / AMX reduction order), so a difference of a few
thousandths is what another machine gives, not evidence that the code moved; bit-identical
agreement needs the same kind of machine (docs/training.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("round3_interval_r", HERE / "interval.py")
iv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(iv)


def build(out: Path, seed: int, label: str, jobs: int, wall_s: float | None, record: Path,
          commit: str | None = None) -> dict:
    rec = json.loads(record.read_text())
    runs = {k: out / lab / f"seed{seed}" for k, lab in (("moe", "moe"), ("cm", label))}
    bpb = {k: json.loads((r / "eval.json").read_text())["val_bpb"] for k, r in runs.items()}
    prov = {k: iv.provenance_of_run(r, jobs) for k, r in runs.items()}
    for p in prov.values():  # runs started before config.json named the commit: the one noted at the start
        if p["commit"] == iv.UNKNOWN and commit:
            p["commit"] = f"{commit} (noted by hand at the start, working tree clean)"
    then = rec["provenance"][str(seed)]
    recorded = {k: rec["per_seed"][k][str(seed)] for k in ("moe", "cm")}
    env = prov["moe"]
    flags = env["machine"]["cpu_flags"]
    kind = ("AMX-BF16" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2") if isinstance(
        flags, list) else "unknown flags"
    return {
        "seed": seed, "label": label, "compare_dir": str(out),
        "machine": {**env["machine"], "name": f"{env['machine']['cpu_model']}, {kind}"},
        "commit": commit or env["commit"], "precision": {k: p["precision"] for k, p in prov.items()},
        "wall_s": wall_s if wall_s is not None else iv.UNKNOWN,
        "bpb": bpb, "recorded": recorded, "recorded_round": then["cm"]["round"],
        "recorded_machine": then["cm"]["machine"]["name"],
        "note": "another machine than the record's: its fp32 kernels differ, so the bits are not expected to agree; "
                "code_check.py holds the machine fixed instead",
        "difference": {k: bpb[k] - recorded[k] for k in bpb},
        "gap": bpb["cm"] - bpb["moe"], "recorded_gap": recorded["cm"] - recorded["moe"],
        "provenance": prov,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the compare output of the rerun")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--label", default="topk-R2")
    p.add_argument("--jobs", type=int, default=1, help="runs the compare trained at once")
    p.add_argument("--wall-s", type=float, help="the compare's wall time, measured outside it")
    p.add_argument("--commit", help="the commit the runs started on, where their config.json does not name it")
    p.add_argument("--record", type=Path, default=HERE / "d1.2M-8seeds.json")
    p.add_argument("--out", default="rerun-1.2M-s0")
    a = p.parse_args()
    res = build(a.dir, a.seed, a.label, a.jobs, a.wall_s, a.record, a.commit)
    (HERE / f"{a.out}.json").write_text(json.dumps(res, indent=2, allow_nan=False) + "\n")
    print(f"seed {a.seed}: MoE {res['bpb']['moe']:.6f} ({res['difference']['moe']:+.6f} vs round "
          f"{res['recorded_round']}), ConceptMoE {res['bpb']['cm']:.6f} ({res['difference']['cm']:+.6f}); "
          f"gap {res['gap']:+.4f} (recorded {res['recorded_gap']:+.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
