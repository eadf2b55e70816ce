#!/bin/bash
# usage: queue.sh NAME FLOOR KVMSPEC RATIO SEED MODEL SAMPLES  (runs task halves a and b side by side)
name=$1 floor=$2 spec=$3 ratio=$4 seed=$5 model=$6 ns=${7:-2}
A="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3"
B="niah_multivalue niah_multiquery vt cwe fwe"
for h in a b; do
  [ $h = a ] && T=$A || T=$B
  mkdir -p $name/$h
  FLOOR=$floor PYTHONPATH=/work/scratch/wt /work/venv/bin/python $(dirname $0)/run.py bench pretrained --model /root/.cache/kvmeans/models/$model --out $PWD/$name/$h --arms kvm --benches ruler --ruler-tasks $T --ruler-lengths 4096 --ruler-samples $ns --ratios $ratio --kvm $spec --threads 1 --seed $seed --no-progress > $name/$h/run.log 2>&1 &
done
wait
