#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, stage by stage, for a machine with no network and calls of at most
# 10 minutes: `pack` (here, with the network) gathers what the machine lacks into gpu_pack/
# (git-ignored; carry it along), then one call per stage there. A stage that fails says FAILED loudly,
# the next stage still runs, and the script exits nonzero at the end.
#
#   bash bench/gpu_check.sh pack                  # here: Multi30k + the sacremoses and CTranslate2 wheels -> gpu_pack/
#   bash bench/gpu_check.sh env tests             # on the GPU machine (stages and their times below)
#   bash bench/gpu_check.sh demo                  # the GPU recipe as written: 8 minutes of training
#   bash bench/gpu_check.sh demo --set train.compile=true   # the same under torch.compile
#   bash bench/gpu_check.sh demo --members 1      # one model (the demo's default on one GPU: four at once)
#   bash bench/gpu_check.sh cpu-smoke             # every stage at tiny size on the CPU (4.3 CPU-minutes)
#   bash bench/gpu_check.sh cpu-smoke real demo   # those stages only, tiny, on the CPU
#
# Stages (H100/H200; each fits one 10-minute call; the times are an H200's, 2026-11-27, where measured):
#   env        the device, torch and the packages; fails where the demo's (sacremoses, sacrebleu,
#              sentencepiece) are missing                                               5 s
#   tests      the CUDA tests (tests/gpu) and the CPU halves of the GPU paths (240 s cap) 28 s before
#              the derived bounds of the gradients and masks (about 75 s more on a 2-core CPU)
#   train      training tok/s, synthetic batches, base and big, bf16: aiayn (and with train.cast_weights_once)
#              against HF Marian and torch.nn.Transformer, and a profile of aiayn's step  66 s
#   compile    aiayn plain, under torch.compile, and with the unfused loss, base and big ~6 min (not run)
#   real       Multi30k prepared from gpu_pack/, then real length-bucketed batches (base, bf16):
#              aiayn, with cuDNN's attention, HF Marian, torch.nn; then aiayn under torch.compile
#              68 s, then up to 300 s
#   translate  beam search against HF generate, then CTranslate2 (aiayn's own model, exported) in a
#              process of its own: aiayn fp32 and bf16, each also with its steps as CUDA graphs
#              (DecodeConfig.cuda_graphs), and fp16 beside CTranslate2; HF fp32 and bf16;
#              CTranslate2 fp32, bf16, fp16 and int8 (int8_bfloat16); base and big  147 s (before graphs)
#   memory     torch.cuda.max_memory_allocated of aiayn's step, base and big at 3,125 and 25,000
#              tokens a batch, beside `aiayn estimate`'s peak (aiayn/cost/memory.py)  ~1 min (not run)
#   small      the GPU demo's model (recipes/multi30k-gpu.json) at 4,096 + 4,096 tokens a step (and with
#              train.cast_weights_once) against HF Marian of the same shape, and its profile: device
#              time against wall time  28 s;
#              then aiayn plain against train.compile                         (not run)
#   demo       `aiayn demo --minutes M` (default 8, the recipe's own) on gpu_pack's Multi30k, against
#              the target test_2016 >= 42.0 in <= 10 minutes; then test_2016 translated in fp32, bf16 and
#              bf16 with --cuda-graphs, timed, where the call has time left   M + 0.6 min, then 0.7 min
#
# Results go to $RESULTS (default bench/results/<device>-<date>/) as they come: a log per stage and
# the benchmarks' JSON, written after every measurement, so a stage stopped at its limit keeps what it
# measured; a system that fails (out of memory, say) drops out and the others are still measured.
# Work files go to $WORK (default /tmp/aiayn-gpu). PY names the interpreter (.venv/bin/python when
# there is one, else python3).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
PACK=${PACK:-$ROOT/gpu_pack}
W=${WORK:-/tmp/aiayn-gpu}
MINUTES=8
DEMO_SETS=()
SMOKE=0
STAGES=()
while [ $# -gt 0 ]; do
  case $1 in
    --minutes) MINUTES=$2; shift 2 ;;
    --minutes=*) MINUTES=${1#*=}; shift ;;
    --set) DEMO_SETS+=(--set "$2"); shift 2 ;;
    --members) DEMO_SETS+=(--members "$2"); shift 2 ;;
    cpu-smoke) SMOKE=1; shift ;;
    all) STAGES+=(env tests train compile real translate memory small demo); shift ;;
    pack|env|tests|train|compile|real|translate|memory|small|demo) STAGES+=("$1"); shift ;;
    *) echo "unknown stage or option: $1 (stages: pack env tests train compile real translate memory small demo all cpu-smoke;" \
            "options: --minutes M; for the demo --set SECTION.FIELD=VALUE, --members N)" >&2; exit 2 ;;
  esac
done
[ ${#STAGES[@]} -gt 0 ] || [ "$SMOKE" = 1 ] || { sed -n '2,/^[^#]/{/^#/p;}' "$0"; exit 2; }  # the header above
[ ${#STAGES[@]} -gt 0 ] || STAGES=(env tests train compile real translate memory small demo)  # cpu-smoke alone: all

export PYTHONPATH=$ROOT/src:$ROOT/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SHARED=${AIAYN_SHARED_DATA:-$ROOT/../shared/data}  # what `pack` copies (the folder holding multi30k/)
if [ -d "$PACK/data/multi30k" ]; then DATA_ROOT=$PACK/data; else DATA_ROOT=$SHARED; fi
export AIAYN_SHARED_DATA=$DATA_ROOT
A="$PY -m aiayn.cli"

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu
  RESULTS=${RESULTS:-${TMPDIR:-/tmp}/aiayn-cpu-smoke}
  W=$W-cpu-smoke
  TRAIN_SIZES=(--sizes tiny --vocab 500 --batch 8 --len 12 --steps 2 --rounds 2 --warmup 1 --device cpu)
  REAL_SIZES=(--sizes tiny --batch-tokens 600 --real-batches 6 --steps 2 --rounds 2 --warmup 1 --device cpu)
  TRANSLATE_SIZES=(--sizes tiny --batch 4 --out-len 8 --vocab 300 --rounds 2 --device cpu)
  SMALL_SIZES=(--sizes recipes/multi30k-gpu.json --vocab 500 --batch 8 --len 12 --steps 2 --rounds 2 --warmup 1
               --device cpu)
  MEMORY_SIZES=(--sizes tiny --tokens 240 --vocab 500 --steps 2 --device cpu)
else
  DEVICE=cuda
  if [ -z "${RESULTS:-}" ] && [ "${STAGES[*]}" != pack ]; then
    name=$($PY -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>/dev/null)
    RESULTS=$ROOT/bench/results/$(echo "${name:-unknown}" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-$//')-$(date +%F)
  fi
  TRAIN_SIZES=(--sizes base,big --steps 10 --rounds 3 --warmup 3)
  REAL_SIZES=(--sizes base --batch-tokens 12500 --real-batches 40 --steps 10 --rounds 3 --warmup 3)
  TRANSLATE_SIZES=(--sizes base,big --rounds 3)
  SMALL_SIZES=(--sizes recipes/multi30k-gpu.json --vocab 8000 --batch 128 --len 32 --steps 20 --rounds 3 --warmup 5)
  MEMORY_SIZES=(--sizes base,big --tokens 3125,25000)
fi
export BENCH_RESULTS=${RESULTS:-}

# The wheels of the pack (sacremoses, CTranslate2) into a folder of their own ($WORK/site), ahead of the
# machine's packages; each on its own, so that one this Python cannot take (CTranslate2's, built for a
# PACK_PYTHON other than its own) is named and the others still go in.
if [ "$SMOKE" = 0 ] && ls "$PACK"/wheels/*.whl >/dev/null 2>&1 && [[ " ${STAGES[*]} " != *" pack "* ]]; then
  mkdir -p "$W/site"
  for whl in "$PACK"/wheels/*.whl; do
    if ! err=$($PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$W/site" "$whl" 2>&1); then
      echo "gpu_pack: $(basename "$whl") not installed: $(echo "$err" | grep -v '^ *$' | tail -1)"
    fi
  done
  export PYTHONPATH=$PYTHONPATH:$W/site
fi

# -- the stages ---------------------------------------------------------------------------------

stage_pack() {
  local src=$SHARED/multi30k ver
  [ -d "$src/raw" ] || { echo "no Multi30k at $src (set AIAYN_SHARED_DATA to the folder holding multi30k/)"; return 1; }
  [ "$(cd "$SHARED" && pwd)" != "$PACK/data" ] || { echo "AIAYN_SHARED_DATA is the pack itself"; return 1; }
  rm -rf "$PACK" && mkdir -p "$PACK/data/multi30k" "$PACK/wheels" || return 1
  cp -r "$src/raw" "$src/tok" "$PACK/data/multi30k/" && chmod -R u+w "$PACK" || return 1
  ver=$($PY -c "import importlib.metadata as m; print(m.version('sacremoses'))" 2>/dev/null)
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$PACK/wheels" "sacremoses${ver:+==$ver}" || return 1
  # CTranslate2 for the GPU machine's Python (PACK_PYTHON, default 3.12), whatever this one's is
  ver=$($PY -c "import importlib.metadata as m; print(m.version('ctranslate2'))" 2>/dev/null)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "${PACK_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$PACK/wheels" "ctranslate2${ver:+==$ver}" || return 1
  find "$PACK" -type f | sort
  du -sh "$PACK"
}

stage_env() {
  nvidia-smi -L 2>/dev/null
  $PY - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
needed = ("sacremoses", "sacrebleu", "sentencepiece")  # the demo's; the others' stages say what they miss
missing = []
for name in ("triton", *needed, "transformers", "ctranslate2"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no version)"))
    except ImportError as exc:
        print(name, "MISSING:", exc)
        missing += [name] if name in needed else []
raise SystemExit(f"missing: {', '.join(missing)}" if missing else 0)
EOF
}

stage_tests() {
  local tests=(tests/gpu)
  [ "$SMOKE" = 0 ] && tests+=(tests/decode/test_host_reads.py tests/train/test_cuda_choices.py)
  timeout 240 $PY -m pytest -q -p no:cacheprovider -ra "${tests[@]}"
}

stage_train() {
  local profile=(--profile); [ "$SMOKE" = 1 ] && profile=()
  timeout 420 $PY bench/gpu_train.py "${TRAIN_SIZES[@]}" --precisions bf16 --systems aiayn,aiayn-castonce,hf-marian,torch-nn \
    "${profile[@]}"
}

stage_compile() {
  timeout 480 $PY bench/gpu_train.py "${TRAIN_SIZES[@]}" --precisions bf16 --systems aiayn,aiayn-compile,aiayn-unfused \
    --out-name gpu_train_compile.json
}

prepare_multi30k() {  # $1: the data directory to make, from the pack's raw files (the first $2 lines; 0 = all)
  local raw=$DATA_ROOT/multi30k/raw out=$1 n=$2 vocab=8000 args=() f
  [ -f "$out/manifest.json" ] && return 0
  mkdir -p "$W/text"
  for f in train.en train.de val.en val.de; do
    if [ "$n" -gt 0 ]; then zcat "$raw/$f.gz" | head -n "$n" > "$W/text/$f"; else zcat "$raw/$f.gz" > "$W/text/$f"; fi
  done
  [ "$n" -gt 0 ] && vocab=500
  timeout 120 $A prepare --train-src "$W/text/train.en" --train-tgt "$W/text/train.de" --valid-src "$W/text/val.en" \
    --valid-tgt "$W/text/val.de" --vocab-size $vocab --out "$out"
}

stage_real() {
  local n=0 rc=0; [ "$SMOKE" = 1 ] && n=2000
  prepare_multi30k "$W/multi30k-data" $n || return 1
  timeout 240 $PY bench/gpu_train.py "${REAL_SIZES[@]}" --data "$W/multi30k-data" --precisions bf16 \
    --systems aiayn,aiayn-cudnn,hf-marian,torch-nn --out-name gpu_train_real.json || rc=1
  timeout 300 $PY bench/gpu_train.py "${REAL_SIZES[@]}" --data "$W/multi30k-data" --precisions bf16 \
    --systems aiayn,aiayn-compile --out-name gpu_train_real_compile.json || rc=1
  return $rc
}

cublas12_shim() {  # CTranslate2's CUDA build opens libcublas.so.12; beside a CUDA 13 torch, name cuBLAS 13 so
  local site lib lt
  [ "$SMOKE" = 1 ] && return 0
  $PY -c "import ctypes; ctypes.CDLL('libcublas.so.12')" 2>/dev/null && return 0
  site=$($PY -c "import site; print(' '.join(site.getsitepackages()))")
  ls $site/nvidia/cublas/lib/libcublas.so.12 >/dev/null 2>&1 && return 0  # nvidia-cublas-cu12: gpu_translate loads it
  lib=$(find $site /usr/local/cuda* -name 'libcublas.so.1[3-9]' 2>/dev/null | head -1)
  [ -n "$lib" ] || { echo "no cuBLAS found for CTranslate2"; return 0; }
  lt=$(dirname "$lib")/libcublasLt.so.${lib##*.so.}
  mkdir -p "$W/cublas12" && ln -sf "$lib" "$W/cublas12/libcublas.so.12" && ln -sf "$lt" "$W/cublas12/libcublasLt.so.12"
  export LD_LIBRARY_PATH=$W/cublas12:$(dirname "$lib"):${LD_LIBRARY_PATH:-} AIAYN_CUBLAS12="$lib as libcublas.so.12"
  echo "CTranslate2 on $AIAYN_CUBLAS12"
}

stage_translate() {  # aiayn and HF first, then CTranslate2 in a process of its own beside aiayn
  local rc=0 ct2=ct2-fp32,ct2-bf16,ct2-fp16,ct2-int8
  [ "$SMOKE" = 1 ] && ct2=ct2-fp32
  timeout 280 $PY bench/gpu_translate.py "${TRANSLATE_SIZES[@]}" \
    --systems aiayn-fp32,aiayn-graphs-fp32,aiayn-bf16,aiayn-graphs-bf16,hf-fp32,hf-bf16 || rc=1
  cublas12_shim
  local fp16=,aiayn-fp16; [ "$SMOKE" = 1 ] && fp16=  # float16 decoding is CUDA's
  timeout 200 $PY bench/gpu_translate.py "${TRANSLATE_SIZES[@]}" \
    --systems aiayn-fp32,aiayn-bf16,aiayn-graphs-bf16$fp16,$ct2 --out-name gpu_translate_ct2.json || rc=1
  return $rc
}

stage_small() {  # the GPU demo's model (recipes/multi30k-gpu.json) at its 4,096 + 4,096-token steps: host or device?
  local rc=0
  timeout 120 $PY bench/gpu_train.py "${SMALL_SIZES[@]}" --precisions bf16 --systems aiayn,aiayn-castonce,hf-marian --profile \
    --out-name gpu_train_small.json || rc=1
  # then under train.compile, its compile time in the warm-up line (the demo counts it in its minutes)
  timeout 240 $PY bench/gpu_train.py "${SMALL_SIZES[@]}" --precisions bf16 --systems aiayn,aiayn-compile \
    --out-name gpu_train_small_compile.json || rc=1
  return $rc
}

stage_memory() {
  timeout 300 $PY bench/gpu_memory.py "${MEMORY_SIZES[@]}"
}

demo_target() {  # $1: the demo's results.json, $2: its seconds end to end
  $PY - "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
bleu = next(v["score"] for k, v in r["test"].items() if k.startswith("Multi30k tokenized BLEU"))
s = int(sys.argv[2])
met = bleu >= 42.0 and s <= 600
print(f"target test_2016 tokenized BLEU >= 42.0 in <= 600 s end to end: {bleu:.2f} in {s} s, {'met' if met else 'NOT met'}")
EOF
}

stage_demo() {
  local out=$W/demo args=(--minutes "$MINUTES" ${DEMO_SETS[@]+"${DEMO_SETS[@]}"}) rc=0 p model
  [ "$SMOKE" = 1 ] && args=(--quick --minutes 0.2 --max-steps 6 --train-lines 1500 --eval-lines 20 --alphas 1.0
                           --vocab-size 1000 --processes 1 --threads 1 --average-last 1 ${DEMO_SETS[@]+"${DEMO_SETS[@]}"})
  rm -rf "$out"
  SECONDS=0
  # preparing, averaging, translating and plotting took 36 s beside 480 s of training on an H200 (one
  # model); an ensemble's members start, average and translate apiece
  timeout $(( ${MINUTES%.*} * 60 + 150 )) $A demo --out "$out" --data-root "$DATA_ROOT" "${args[@]}" --device $DEVICE \
    2>&1 | grep --line-buffered -v '%|'  # (the stages run under pipefail: the demo's exit status)
  rc=$?
  local took=$SECONDS
  echo "demo: ${took}s end to end, exit $rc"
  cp "$out/results.json" "$RESULTS/demo_results.json" 2>/dev/null
  # an ensemble's members, to take its gain apart elsewhere (bench/ensemble_gain.py): their weights in
  # float16, within what a call brings back (16 MiB a file; they load into the float32 model)
  for p in "$out"/run/member*/averaged.pt; do
    [ -f "$p" ] || continue
    $PY - "$p" "$RESULTS/demo_$(basename "$(dirname "$p")").pt" <<'EOF'
import sys, torch
from aiayn.checkpoint.format import atomic_save, load_checkpoint
c = dict(load_checkpoint(sys.argv[1]))
c["model"] = {k: v.half() if v.dtype == torch.float32 else v for k, v in c["model"].items()}
atomic_save(c, sys.argv[2])
EOF
  done
  [ -f "$out/results.json" ] && demo_target "$out/results.json" "$took"
  model=$out/model.pt
  [ -f "$model" ] || return 1
  if [ "$SMOKE" = 0 ] && [ "$took" -gt 500 ]; then
    echo "test_2016 in fp32 and bf16 not timed: the call's 10 minutes would not hold them (rerun with --minutes 6)"
    return $rc
  fi
  zcat "$DATA_ROOT/multi30k/raw/test_2016_flickr.en.gz" > "$W/test.en"
  [ "$SMOKE" = 1 ] && { head -n 20 "$W/test.en" > "$W/test.en.20"; mv "$W/test.en.20" "$W/test.en"; }
  for p in fp32 bf16 bf16-graphs; do  # bf16-graphs: each step a CUDA graph (--cuda-graphs), the same lines expected
    local flags=(--precision ${p%-graphs}); [ "$p" = bf16-graphs ] && flags+=(--cuda-graphs)
    SECONDS=0
    timeout 45 $A translate --checkpoint "$model" --device $DEVICE "${flags[@]}" < "$W/test.en" > "$W/test.$p" \
      2> "$W/test.$p.err" || { rc=1; tail -3 "$W/test.$p.err"; }
    echo "translate test_2016 $p: ${SECONDS}s, $(wc -l < "$W/test.$p") lines"
    $PY -c "import sacrebleu, gzip, sys; h = open(sys.argv[1]).read().splitlines(); \
r = gzip.open(sys.argv[2], 'rt').read().splitlines()[:len(h)]; print('  sacreBLEU', round(sacrebleu.corpus_bleu(h, [r]).score, 2))" \
      "$W/test.$p" "$DATA_ROOT/multi30k/raw/test_2016_flickr.de.gz"
  done
  echo "  lines bf16 and bf16-graphs translate differently: $(diff "$W/test.bf16" "$W/test.bf16-graphs" | grep -c '^<')"
  return $rc
}

# -- the driver -----------------------------------------------------------------------------------

if [ "${STAGES[*]}" != pack ]; then
  mkdir -p "$RESULTS" "$W"
  echo "results: $RESULTS"
fi
FAILED=()
for s in "${STAGES[@]}"; do
  echo; echo "=== $s $(date +%T)"
  start=$(date +%s)
  if [ "$s" = pack ]; then
    stage_pack; rc=$?
  else
    set -o pipefail
    "stage_$s" 2>&1 | tee "$RESULTS/$s.log"; rc=$?
    set +o pipefail
  fi
  took=$(( $(date +%s) - start ))
  if [ $rc -ne 0 ]; then
    FAILED+=("$s")
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    echo "!!! FAILED: stage $s (exit $rc, ${took}s)$( [ "$s" != pack ] && echo "; log: $RESULTS/$s.log")"
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  else
    echo "=== $s passed in ${took}s"
  fi
done
echo
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED stages: ${FAILED[*]} (of ${STAGES[*]})"
  exit 1
fi
echo "all stages passed: ${STAGES[*]}"
