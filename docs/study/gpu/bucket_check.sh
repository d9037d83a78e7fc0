#!/bin/bash
# The GPU check of the CUDA concept bucket (issue 44), one command on one GPU (~6 min):
#   1. bench train --router (fresh boundaries every step, as in training), with the bucket (64,
#      the CUDA default) and without it (--concept-bucket 1), side by side;
#   2. the study at the 36M-token record's settings (same seed, same batches), now with the bucket,
#      to compare the real training loop's tokens/s with h200-seq2048-36M.
# Run from the repository root: OUT=folder bash docs/study/gpu/bucket_check.sh
# Writes OUT/log.txt, OUT/bench.tgz and OUT/study.tgz (weights and checkpoints left out).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
PY=${PY:-python3}
W=${WORK:-/tmp/bucket-check}
mkdir -p "$W" "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for b in 64 1; do
  echo "== bench train --router --concept-bucket $b"
  $PY -m conceptmoe bench train --device cuda --router --concept-bucket $b --preset small --seq-lens 2048 \
      --tokens 65536 --dtype bf16 --repeats 20 --out "$W/bench-bucket$b"
done
tar czf "$OUT/bench.tgz" -C "$W" bench-bucket64 bench-bucket1
echo "== study, 36M tokens per model, with the bucket"
timeout ${STUDY_S:-330} $PY docs/study/gpu/run_gpu_study.py --out "$W/study" --minutes 6.5 \
    --max-tokens 36000000 --latency-lens 4096,16384,65536
echo "study exit $?"
tar czf "$OUT/study.tgz" -C "$W" --exclude='*.safetensors' --exclude=checkpoints study
