#!/bin/bash
# Bit-identical reruns on CUDA (one GPU, ~4 min): the same recipe trained twice, compared by the
# SHA-256 of model.safetensors and the held-out BPB, under CONCEPTMOE_CUDA_DETERMINISM=warn (torch
# warns and runs non-deterministic attention backwards) and strict (the default).
# Run from the repository root: OUT=folder bash docs/study/gpu/determinism_check.sh
# Writes OUT/log.txt and OUT/determinism.json.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
PY=${PY:-python3}
W=${WORK:-/tmp/det-check}
mkdir -p "$W" "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
ARGS=${ARGS:-"--data python-stdlib --seq-len 1024 --batch-size 16 --tokens 655360 --val-tokens 65536 --device cuda --seed 0"}
for spec in ${SPECS:-warn:conceptmoe:bf16 strict:conceptmoe:bf16 strict:moe:bf16 strict:conceptmoe:fp32}; do
  IFS=: read -r mode model dtype <<< "$spec"
  for rep in 1 2; do
    out="$W/$mode-$model-$dtype-$rep"
    echo "== $out"
    CONCEPTMOE_CUDA_DETERMINISM=$mode $PY -m conceptmoe train --model $model --dtype $dtype $ARGS --out "$out" 2>&1 \
        | grep -v "it/s\|step/s\|batch/s" | tail -4
  done
done
$PY - "$W" "$OUT/determinism.json" <<'PY'
import hashlib, json, statistics, sys
from pathlib import Path
w, rows = Path(sys.argv[1]), []
for a in sorted(w.glob("*-1")):
    b = a.with_name(a.name[:-1] + "2")
    rec = {"run": a.name[:-2]}
    for tag, r in (("first", a), ("second", b)):
        if not (r / "eval.json").exists():
            rec[tag] = None
            continue
        ev = json.loads((r / "eval.json").read_text())
        tps = [m["tokens_per_s"] for m in map(json.loads, (r / "metrics.jsonl").read_text().splitlines()[1:]) if "tokens_per_s" in m] or [0.0]
        env = json.loads((r / "config.json").read_text())["environment"]["start"]
        rec[tag] = {"sha256": hashlib.sha256((r / "model.safetensors").read_bytes()).hexdigest(),
                    "val_bpb": ev.get("val_bpb"), "median_tokens_per_s": statistics.median(tps),
                    "deterministic": env.get("deterministic")}
    rec["identical"] = bool(rec["first"] and rec["second"] and rec["first"]["sha256"] == rec["second"]["sha256"])
    rows.append(rec)
    print(json.dumps(rec))
Path(sys.argv[2]).write_text(json.dumps({"runs": rows}, indent=2) + "\n")
PY
