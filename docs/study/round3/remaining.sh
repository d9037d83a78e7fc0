#!/bin/bash
# What round 3 (issue 44) still has to run, in the background: at most two single-thread
# processes. Run from the repository root; rerun it to resume (compare resumes from its
# checkpoints, train with --resume), finished runs are skipped.
#   nohup bash docs/study/round3/remaining.sh > runs/study3/remaining.log 2>&1 &
set -u
export OMP_NUM_THREADS=1
mkdir -p runs/study3

train_once() {  # train_once OUT ARGS...: train, resume, or skip a finished run
  local out=$1; shift
  if [ -f "$out/eval.json" ]; then return 0; fi
  if [ -d "$out/checkpoints" ]; then conceptmoe train --resume --out "$out"
  else conceptmoe train "$@" --out "$out"; fi
}

pretrained() {  # the pretrained MoE of seed $1: the 256 pair's MoE, or the same run trained alone
  local pair=runs/study3/long256-s$1/moe/seed$1
  if [ -f "$pair/eval.json" ]; then echo "$pair"; return; fi
  train_once runs/study3/pre-s$1 --model moe --data python-stdlib --tokens 2400000 --seed "$1" --dtype fp32 >&2
  echo runs/study3/pre-s$1
}

convert_seed() {  # the conversions of seed $1 beside its continued MoE, $2 jobs
  conceptmoe compare --init "$(pretrained "$1")" --ratios 1.5,2 --strategies topk,loop --split 2+4+2 \
      --tokens 1200000 --seeds "$1" --jobs "$2" --dtype fp32 --out runs/study3/ct-s"$1"
}

scratch() {  # the default ConceptMoE from scratch for the conversion's total tokens, seed $1
  train_once runs/study3/scratch3.6M-s$1 --data python-stdlib --tokens 3600000 --seed "$1" --dtype fp32 \
      > runs/study3/scratch3.6M-s$1.log 2>&1
}

# two lanes, one single-thread process each
( convert_seed 1 1 > runs/study3/ct-s1.log 2>&1; scratch 0; scratch 1; scratch 2 ) &
convert_seed 2 1 > runs/study3/ct-s2.log 2>&1
wait
# then: python docs/study/round3/conversion.py conversion docs/study/round3/ct-s0 runs/study3/ct-s1 \
#           runs/study3/ct-s2 --scratch runs/study3/scratch3.6M-s0 runs/study3/scratch3.6M-s1 ...
