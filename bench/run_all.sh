#!/usr/bin/env bash
# Every speed benchmark at full settings, then bench/results/summary.md.
#
#   bash bench/run_all.sh                 # all parts; about 12-15 minutes on 2 quiet cores
#   bash bench/run_all.sh train_base      # only the named part(s)
#   FORCE=1 bash bench/run_all.sh         # rerun parts whose JSON already exists
#   SMOKE=1 bash bench/run_all.sh         # harness check: tiny shapes, 1 thread, under a minute;
#                                         # results in a temporary folder, never in bench/results
#   HOLD_ISA=avx2 bash bench/run_all.sh   # every system held to AVX2 arithmetic on a newer CPU:
#                                         # PyTorch, oneDNN, MKL, aiayn's C kernels and CTranslate2
#
# Parts, in order: matmul train_small train_base translate_small translate_base attention.
# Resumable: a part whose JSON is already in the results folder is skipped, so after an
# interruption the same command picks up where it stopped. A part that fails is logged and
# the others still run; inside a part, a rival that fails drops out and the others still run.
# Needs the rivals' venv (bench/setup_rivals.sh): PY defaults to $BENCH_VENV/bin/python,
# BENCH_VENV to the folder benchvenv beside the checkout. Measure on an otherwise idle
# machine: the summary records load and cores used.
set -uo pipefail
BENCH="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$BENCH")"
BENCH_VENV="${BENCH_VENV:-$(dirname "$REPO")/benchvenv}"
PY="${PY:-$BENCH_VENV/bin/python}"
if [ ! -x "$PY" ]; then
  echo "no python at $PY: run bash bench/setup_rivals.sh first (or set PY)" >&2
  exit 2
fi

case "${HOLD_ISA:-}" in
  "") ;;
  avx2)
    # CTranslate2 picks its own instruction set at run time: held too, or its rows would run AVX-512
    export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
      AIAYN_KERNELS_MARCH=x86-64-v3 CT2_FORCE_CPU_ISA=AVX2 ;;
  *) echo "HOLD_ISA=$HOLD_ISA: only avx2 is known" >&2; exit 2 ;;
esac

if [ "${SMOKE:-0}" = "1" ]; then
  export BENCH_RESULTS="${BENCH_RESULTS:-$(mktemp -d -t bench_smoke.XXXXXX)}"
  export BENCH_THREADS=1 OMP_NUM_THREADS=1
  TINY_TRAIN=(--size tiny --batch 8 --src-len 8 --tgt-len 8 --reps 2 --warmup 1 --min-reps 1)
  TINY_TRANSLATE=(--size tiny --batch 4 --src-len 6 --out-len 5 --reps 2 --warmup 1 --min-reps 1)
  declare -A ARGS=(
    [matmul]="matmul_peak.py --scale 0.125 --reps 2 --warmup 1"
    [train_small]="train_throughput.py ${TINY_TRAIN[*]} --name train_small"
    [train_base]="train_throughput.py ${TINY_TRAIN[*]} --name train_base"
    [translate_small]="translate_throughput.py ${TINY_TRANSLATE[*]} --name translate_small"
    [translate_base]="translate_throughput.py ${TINY_TRANSLATE[*]} --name translate_base"
    [attention]="attention_sweep.py --tokens 256 --n 16,64,256 --reps 2 --warmup 1"
  )
else
  export BENCH_RESULTS="${BENCH_RESULTS:-$BENCH/results}"
  export BENCH_THREADS="${BENCH_THREADS:-2}"
  BASE_TRANSLATE_SYSTEMS="${BASE_TRANSLATE_SYSTEMS:-aiayn-fp32,aiayn-int8bf16,aiayn-fp32-inter,aiayn-bf16w-inter,\
aiayn-int8bf16-inter,hf-fp32,ct2-fp32,ct2-int8,ct2-fp32-inter}"
  declare -A ARGS=(
    [matmul]="matmul_peak.py"
    [train_small]="train_throughput.py --size small"
    [train_base]="train_throughput.py --size base"
    [translate_small]="translate_throughput.py --size small"
    # base: the systems the targets are judged on (live processes at base size: the default twelve,
    # ~21 GB together, leave too little of a 24 GiB machine; bench/README.md)
    [translate_base]="translate_throughput.py --size base --systems $BASE_TRANSLATE_SYSTEMS"
    [attention]="attention_sweep.py"
  )
fi
declare -A JSON=([matmul]=matmul_peak [train_small]=train_small [train_base]=train_base
                 [translate_small]=translate_small [translate_base]=translate_base [attention]=attention_sweep)
ORDER=(matmul train_small train_base translate_small translate_base attention)
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${ORDER[@]}")

# absolute, since every part runs from $BENCH (a relative path would put its JSON under bench/ while
# this script looks for it beside the caller)
mkdir -p "$BENCH_RESULTS/logs"
BENCH_RESULTS="$(cd "$BENCH_RESULTS" && pwd)"
export BENCH_RESULTS
LOG="$BENCH_RESULTS/logs/run_all.log"
say() { echo "[run_all $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
say "results in $BENCH_RESULTS; python $PY; threads $BENCH_THREADS; instruction set held to ${HOLD_ISA:-none}; load $(cut -d' ' -f1-3 /proc/loadavg)"
T0=$SECONDS
FAILED=()
for part in "${PARTS[@]}"; do
  if [ -z "${ARGS[$part]+x}" ]; then
    say "unknown part '$part' (known: ${ORDER[*]})"; FAILED+=("$part"); continue
  fi
  if [ -f "$BENCH_RESULTS/${JSON[$part]}.json" ] && [ "${FORCE:-0}" != "1" ]; then
    say "$part: ${JSON[$part]}.json exists, skipped (FORCE=1 reruns)"; continue
  fi
  t=$SECONDS
  say "$part: start (load $(cut -d' ' -f1 /proc/loadavg))"
  # shellcheck disable=SC2086  # ARGS entries are word lists on purpose
  if (cd "$BENCH" && "$PY" ${ARGS[$part]}) >"$BENCH_RESULTS/logs/$part.log" 2>&1; then
    say "$part: done in $((SECONDS - t))s"
  else
    say "$part: FAILED after $((SECONDS - t))s; see $BENCH_RESULTS/logs/$part.log"; FAILED+=("$part")
  fi
  grep -v '^[0-9][0-9]:[0-9][0-9]:[0-9][0-9] ' "$BENCH_RESULTS/logs/$part.log" | tail -n 20
done
(cd "$BENCH" && "$PY" summarize.py) >"$BENCH_RESULTS/logs/summarize.log" 2>&1 || FAILED+=(summarize)
say "total $((SECONDS - T0))s; summary: $BENCH_RESULTS/summary.md"
grep -A 14 '^### Targets' "$BENCH_RESULTS/summary.md" 2>/dev/null
if [ ${#FAILED[@]} -gt 0 ]; then
  say "failed: ${FAILED[*]}"
  exit 1
fi
