"""Per-seed, per-run provenance of round 3's long-context and conversion records (issue 53).

    python docs/study/round3/provenance.py     # writes docs/study/round3/provenance.json

The run directories are gone; what each run left is committed beside the records: its compare
report (precision, realised compression, training seconds, settings), its resolved recipe.toml,
the training environment long_context.py copied from each run's config.json (machine, threads,
processes, torch), the scratch runs' own config.json, and the commit that first recorded it. The
commit a run trained on was not recorded then (runs record it since issue 53): a run's commit
field gives the one that first committed its results, an upper bound. Anything else missing is
"unknown". ``--jobs`` (runs at once) comes from the command the round 3 README gives for it.
The 1.2M record (d1.2M-8seeds.json) holds its provenance itself.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
U = "unknown"
JOBS = {"long": 2, "ct": 2, "scratch": 1}  # round3/README.md §2 and §3: --jobs 2 per pair; train: one process


def first_commit(rel: Path) -> str:
    out = subprocess.run(["git", "-C", str(HERE), "log", "--reverse", "--format=%h %ad", "--date=iso-strict", "--",
                          str(rel)], capture_output=True, text=True).stdout.splitlines()
    return f"unknown; its results first committed in {out[0]}" if out else U


def _machine(env: dict | None) -> dict:
    env = env or {}
    return {"cpu_model": env.get("cpu_model", U), "cpu_flags": env.get("cpu_flags", U),
            "cpu_count": env.get("cpu_count", U)}


def _entry(env: dict | None, folder: Path, model: dict | None, jobs, **extra) -> dict:
    env = env or {}
    secs = model.get("curve_seconds") if model else None
    return {"round": 3, "machine": _machine(env), "commit": first_commit(folder.relative_to(HERE)),
            "recipe": str(folder.relative_to(HERE.parent.parent.parent) / "recipe.toml")
            if (folder / "recipe.toml").is_file() else U,
            "precision": (model or {}).get("precision", [U])[0], "threads": env.get("threads", U),
            "processes": {"world": env.get("world", U), "jobs": jobs}, "torch": env.get("torch", U),
            "compression": (model or {}).get("compression", U),
            "train_s": secs[-1][0] if secs else U, "train_tokens_per_s": (model or {}).get("train_tokens_per_s", U),
            "wall_s": U, **extra}


def long_context() -> dict:
    rec = json.loads((HERE / "long-context.json").read_text())
    out: dict = {}
    for L, by in rec["runs"].items():
        for seed, runs in by.items():
            folder = HERE / f"long{L}-s{seed}"
            rep = json.loads((folder / "report.json").read_text())
            models = {m["label"]: m for m in rep["models"]}
            out.setdefault(L, {})[seed] = {lab: _entry(r.get("environment"), folder, models.get(lab), JOBS["long"])
                                           for lab, r in runs.items()}
    return out


def conversion() -> dict:
    rec = json.loads((HERE / "conversion.json").read_text())
    long = json.loads((HERE / "long-context.json").read_text())["runs"]["256"]
    out: dict = {}
    for seed in map(str, rec["seeds"]):
        folder = HERE / f"ct-s{seed}"
        rep = json.loads((folder / "report.json").read_text())
        pre = long[seed]["moe"].get("environment")  # the pretrained MoE: long256-sN's MoE
        out[seed] = {m["label"]: _entry(None, folder, m, JOBS["ct"],
                                        pretrained=f"long256-s{seed} MoE (machine {_machine(pre)['cpu_model']})")
                     for m in rep["models"]}
        sfolder = HERE / f"scratch3.6M-s{seed}"
        cfg = json.loads((sfolder / "config.json").read_text())
        ev = json.loads((sfolder / "eval.json").read_text())
        out[seed]["scratch"] = {**_entry((cfg.get("environment") or {}).get("start"), sfolder,
                                         {"precision": [cfg.get("precision", U)], "compression": ev.get("compression", U)},
                                         JOBS["scratch"])}
    return out


def build() -> dict:
    return {"about": __doc__.split("\n\n")[0], "long-context": long_context(), "conversion": conversion()}


def main() -> int:
    (HERE / "provenance.json").write_text(json.dumps(build(), indent=1, allow_nan=False) + "\n")
    print("wrote docs/study/round3/provenance.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
