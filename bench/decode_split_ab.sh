#!/bin/bash
# one process x 2 threads x 64 sentences  vs  two concurrent processes x 1 thread x 32 sentences
# (CTranslate2's inter_threads as two processes). Usage: bash bench/decode_split_ab.sh [PYTHON]
P=${1:-python}; S="$(dirname "$0")/decode_ab.py"
for size_mode in "small fp32" "small bf16w" "base fp32" "base bf16w"; do
  set -- $size_mode
  n=8; [ $1 = base ] && n=4
  for round in 1 2; do
    $P $S $1 $2 sdpa $n 2 64
    $P $S $1 $2 sdpa $n 1 32 & $P $S $1 $2 sdpa $n 1 32; wait
  done
done
