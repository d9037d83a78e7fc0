"""Does today's code train the 1.2M study's models as an earlier commit did? One machine, two commits (issue 53).

    OMP_NUM_THREADS=1 python docs/study/round3/code_check.py --old fb457dc --new HEAD --steps 40 \\
        --work /tmp/code-check --out code-check-1.2M

A rerun on another machine cannot show that the code did not move: the kernels differ (AVX2 /
AVX-512), and after a few steps so do the bits. This holds the machine fixed instead: it exports
both commits' ``conceptmoe/`` with ``git archive``, trains the study's two models (the `small` MoE,
lr 2e-3, and the default ConceptMoE at R = 2, `topk`, lr 1e-3; python-stdlib, batch 8 x 256, fp32,
seed 0, one thread) for ``--steps`` steps with each, and compares every logged training figure
step by step, and the final weights byte for byte. Writes docs/study/round3/OUT.json: per model,
whether the metrics, the weights and the resolved model configs (fields the old commit did not
have listed apart, with their values) are identical, the first step that differs and the largest
difference. Finished runs under --work are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
MODELS = {"moe": ["--model", "moe", "--lr", "2e-3"],
          "topk-R2": ["--model", "conceptmoe", "--strategy", "topk", "--ratio", "2", "--lr", "1e-3"]}
COMMON = ["--preset", "small", "--data", "python-stdlib", "--batch-size", "8", "--seq-len", "256",
          "--dtype", "fp32", "--seed", "0", "--eval-every", "0", "--val-tokens", "32768"]
FIGURES = ("loss", "ce_loss", "bpb", "compression", "ratio_loss", "balance_loss", "grad_norm", "lr")


def export(commit: str, where: Path) -> str:
    full = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], check=True, capture_output=True,
                          text=True).stdout.strip()
    where.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", full, "conceptmoe"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=tar.stdout, check=True)
    return full


def train(tree: Path, model: str, steps: int, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    if not (out / "eval.json").is_file():  # a finished run in --work is reused
        subprocess.run([sys.executable, "-m", "conceptmoe", "train", *MODELS[model], *COMMON, "--max-steps", str(steps),
                    "--out", str(out)], check=True, env=env, cwd=tree)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"grad_norm"' in line]


def compare(a: list[dict], b: list[dict]) -> dict:
    first, worst = None, 0.0
    for x, y in zip(a, b):
        for k in FIGURES:
            if k in x and x.get(k) != y.get(k):
                first = first or {"step": x["step"], "figure": k, "old": x[k], "new": y.get(k)}
                if isinstance(y.get(k), (int, float)):
                    worst = max(worst, abs(x[k] - y[k]))
    return {"steps": [len(a), len(b)], "identical": first is None and len(a) == len(b),
            "first_difference": first, "largest_difference": worst}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", default="HEAD")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", default="code-check-1.2M")
    a = p.parse_args()
    commits = {side: export(c, a.work / side) for side, c in (("old", a.old), ("new", a.new))}
    res: dict = {"commits": commits, "steps": a.steps, "settings": COMMON, "models": {}}
    for model in MODELS:
        runs = {side: train(a.work / side, model, a.steps, a.work / f"{side}-{model}") for side in commits}
        cfg = {side: json.loads((a.work / f"{side}-{model}" / "config.json").read_text()) for side in commits}
        old, new = cfg["old"]["model"], cfg["new"]["model"]
        weights = [(a.work / f"{side}-{model}" / "model.safetensors").read_bytes() for side in commits]
        res["models"][model] = {**compare(runs["old"], runs["new"]),
                                "weights_identical": weights[0] == weights[1],
                                "model_config_identical": {k: v for k, v in new.items() if k in old} == old,
                                "fields_only_new": {k: v for k, v in new.items() if k not in old},
                                "precision": {s: c.get("precision") for s, c in cfg.items()},
                                "environment": cfg["new"].get("environment", {}).get("start")}
    (HERE / f"{a.out}.json").write_text(json.dumps(res, indent=1, allow_nan=False) + "\n")
    for m, r in res["models"].items():
        print(f"{m}: metrics {'identical' if r['identical'] else 'differ'} over {r['steps']} steps, weights "
              f"{'identical' if r['weights_identical'] else 'differ'}, model config "
              f"{'identical' if r['model_config_identical'] else 'differs'} (new fields: {r['fields_only_new']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
