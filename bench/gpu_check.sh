#!/usr/bin/env bash
# The GPU checks in one go, from the checkout, with what torch, sentencepiece, sacrebleu and
# transformers provide (wheels in .whl/ are installed first if present: sacremoses for the
# tokenized BLEU). Stages are independent and time-boxed; logs and JSON go to $OUT (or
# bench/results/gpu-check).
#
#   bash bench/gpu_check.sh quick   # CUDA tests, a profile of the step, training and decoding throughput (~5 min)
#   bash bench/gpu_check.sh demo    # `aiayn demo` timed end to end, then translate test_2016 fp32 / bf16 (~10 min)
#   bash bench/gpu_check.sh all
#
# Data: $AIAYN_SHARED_DATA, else .gpu/data (a git-ignored copy of ../shared/data/multi30k), else ../shared/data.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
STAGES=${1:-all}
OUT=${OUT:-$ROOT/bench/results/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT/src:$ROOT:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -z "${AIAYN_SHARED_DATA:-}" ]; then
  if [ -d .gpu/data/multi30k ]; then export AIAYN_SHARED_DATA=$ROOT/.gpu/data; else export AIAYN_SHARED_DATA=$ROOT/../shared/data; fi
fi
A="$PY -m aiayn.cli"
W=${WORK:-/tmp/aiayn-gpu}; mkdir -p "$W"
export BENCH_RESULTS=$OUT
step() { echo; echo "=== $1 $(date +%T)"; }

step env
nvidia-smi -L 2>/dev/null
$PY -c "import torch, sentencepiece, sacrebleu; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', 'sacrebleu', sacrebleu.__version__)"

if [ "$STAGES" = quick ] || [ "$STAGES" = all ]; then
  step cuda-tests
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/gpu tests/train/test_objective.py tests/decode/test_search.py 2>&1 | tail -5
  step train-throughput-synthetic
  timeout 200 $PY bench/gpu_train.py --sizes base,big --precisions bf16,fp16 --steps 5 --rounds 3 --profile \
    > "$OUT/gpu_train.log" 2>&1; echo "rc=$?"
  grep -E "device|tok/s|x$|failed" "$OUT/gpu_train.log" | cut -c1-200
  grep -B2 -A28 "Name " "$OUT/gpu_train.log" | head -34 | cut -c1-200
  step translate-throughput
  timeout 120 $PY bench/gpu_translate.py --sizes base,big --rounds 3 > "$OUT/gpu_translate.log" 2>&1; echo "rc=$?"
  grep -E "tok/s|x$|failed" "$OUT/gpu_translate.log" | cut -c1-200
fi

if [ "$STAGES" = demo ] || [ "$STAGES" = all ]; then
  step demo
  SECONDS=0
  timeout 560 $A demo --out "$W/demo" > "$OUT/demo.log" 2>&1; echo "demo rc=$? ${SECONDS}s"
  grep -E "BLEU|trained|tok/s|model:|translations:|recipe|\[2/7\]" "$OUT/demo.log" | grep -v '%|' | tail -20 | cut -c1-300
  cp "$W/demo/results.json" "$OUT/demo_results.json" 2>/dev/null
  M=$(grep -E '^model: ' "$OUT/demo.log" | tail -1 | cut -d' ' -f2-)
  D=$AIAYN_SHARED_DATA/multi30k/raw
  if [ -n "$M" ]; then
    step translate-test2016
    for p in fp32 bf16; do
      SECONDS=0
      zcat "$D/test_2016_flickr.en.gz" | timeout 60 $A translate --checkpoint "$M" --precision $p > "$W/t.$p" 2> "$W/t.$p.err"
      echo "translate (device auto) $p rc=$? ${SECONDS}s lines $(wc -l < "$W/t.$p")"
      $PY -c "import sacrebleu,gzip,sys;h=open(sys.argv[1]).read().splitlines();r=gzip.open(sys.argv[2],'rt').read().splitlines();print('  sacreBLEU',round(sacrebleu.corpus_bleu(h,[r]).score,2))" "$W/t.$p" "$D/test_2016_flickr.de.gz"
    done
    step train-throughput-real
    timeout 120 $PY bench/gpu_train.py --sizes base --precisions bf16 --data "$W/demo/data" --steps 10 --rounds 3 \
      > "$OUT/gpu_train_real.log" 2>&1; echo "rc=$?"
    grep -E "tok/s|x$|failed" "$OUT/gpu_train_real.log" | cut -c1-200
  fi
fi
step done
