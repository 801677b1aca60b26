#!/usr/bin/env bash
# WMT14 as the paper ran it (§5, §6.1, Table 2), from statmt.org's archives to BLEU on newstest2014.
# docs/wmt14.md is the page to read; `scripts/wmt14.sh --help` lists the options.
#
# Stages (each can be rerun; a finished one is skipped, training resumes from its last checkpoint):
#   fetch     aiayn data wmt14: the pair's archives into RAW/wmt14, each checked against its pinned
#             size and checksum (resumable; $AIAYN_WMT14_URL: a mirror), and the files the clean stage
#             reads extracted beside them; skipped when RAW already holds those files (unpacked by hand)
#   clean     the training corpora concatenated into WORK/text/train.{en,XX}: pairs with an empty
#             side or a tab dropped (counted); newstest2013 (dev) and newstest2014 (test) as plain
#             text, taken from the SGML of test-full.tgz when that is what RAW holds
#   prepare   aiayn prepare: one shared SentencePiece vocabulary (En-De: 37,000 BPE; En-Fr: 32,000
#             unigram pieces, the word-piece form), train pairs over 250 tokens or a 3:1 length
#             ratio dropped
#   train     aiayn train with the recipe (recipes/wmt14-<pair>-<model>.json) on GPUS devices
#             (torchrun), each batch at most TOKENS_PER_GPU tokens, batches accumulated up to
#             25,000 source + 25,000 target tokens per step (§5.1); a checkpoint every 1,500
#             (base) or 600 (big) steps, the paper's 10 minutes on 8 P100s (docs/wmt14.md)
#   average   the last 5 (base) or 20 (big) checkpoints averaged (§6.1)
#   evaluate  newstest2014 translated with beam 4, alpha 0.6, max length input + 50 (§6.1), scored
#             with sacreBLEU and the paper's tokenized compound-split BLEU
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
VENV=$HERE/.venv/bin  # the checkout's environment (scripts/setup.sh), where it has one
if [ -x "$VENV/python" ]; then PY=${PYTHON:-$VENV/python}; else PY=${PYTHON:-python}; fi
if [ -x "$VENV/torchrun" ]; then TORCHRUN=${TORCHRUN:-$VENV/torchrun}; fi
aiayn() { "$PY" -m aiayn.cli "$@"; }

usage() {
  cat <<'EOF'
usage: scripts/wmt14.sh --work DIR [--raw DIR] [--pair ende|enfr] [--model base|big] [--gpus N]
                        [--tokens-per-gpu T] [--stages fetch,clean,prepare,train,average,evaluate]
                        [--max-steps N] [--set SECTION.FIELD=VALUE]... [--ci]
  --work DIR         text, data directory, run, translations and scores go here
  --raw DIR          the WMT14 files, found by name in any subfolder: archives unpacked by hand, or
                     where the fetch stage downloads and unpacks them, DIR/wmt14 (default: WORK/raw)
  --pair             ende (default) or enfr
  --model            base (default) or big; En-Fr has recipes/wmt14-enfr-big.json, its base uses
                     the En-De base recipe (the vocabulary comes from the data)
  --gpus N           devices to train on (default: nvidia-smi's count; 0 = CPU, one process)
  --tokens-per-gpu T tokens in one batch on one device (default: the recipe's 3125, the paper's
                     25,000 over 8 GPUs); accumulation makes up the rest of 25,000 per step
  --stages LIST      stages to run, comma-separated (default: all six); "plan" alone prints the
                     batch split "TOKENS_PER_GPU ACCUM_STEPS" for --gpus and exits
  --max-steps N      stop training after N steps (default: the recipe's 100K / 300K)
  --set K=V          a training override passed to aiayn train (repeatable)
  --ci               a check of the whole way in seconds on a CPU: a one-layer model of width 32,
                     4 steps of 2 x 300 tokens, a 1000-piece vocabulary, PyTorch's operations
                     instead of the C kernels (no compiler run); nothing here is WMT14's
                     result (tests/test_wmt14.py runs it on stand-in text)
Environment: PYTHON (default: the checkout's .venv/bin/python, else python), TORCHRUN (default:
the checkout's .venv/bin/torchrun, else torchrun), AIAYN_WMT14_URL (a mirror of
statmt.org for the fetch stage).
EOF
}

PAIR=ende MODEL=base RAW="" WORK="" GPUS="" TOKENS_PER_GPU="" STAGES=fetch,clean,prepare,train,average,evaluate
MAX_STEPS="" CI=0 SETS=()
die() { echo "wmt14.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in  # an option that takes a value, given none: one line, not bash's "$2: unbound variable"
    --pair|--model|--raw|--work|--gpus|--tokens-per-gpu|--stages|--max-steps|--set) [ $# -ge 2 ] || die "$1 needs a value" ;;
  esac
  case "$1" in
    --pair) PAIR=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --raw) RAW=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --tokens-per-gpu) TOKENS_PER_GPU=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --max-steps) MAX_STEPS=$2; shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    --ci) CI=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "wmt14.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
say() { echo "== $*" >&2; }
[ -n "$WORK" ] || die "--work is required"
RAW=${RAW:-$WORK/raw}
case "$PAIR" in ende) TGT=de ;; enfr) TGT=fr ;; *) die "--pair must be ende or enfr, got $PAIR" ;; esac
case "$MODEL" in base) AVERAGE=5 ;; big) AVERAGE=20 ;; *) die "--model must be base or big, got $MODEL" ;; esac
has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }

RECIPE=$HERE/recipes/wmt14-$PAIR-$MODEL.json
[ -f "$RECIPE" ] || RECIPE=$HERE/recipes/wmt14-ende-$MODEL.json
if [ "$PAIR" = ende ]; then
  CORPORA="europarl-v7.de-en commoncrawl.de-en news-commentary-v9.de-en"
  VOCAB=37000 SPM=bpe
else
  CORPORA="europarl-v7.fr-en commoncrawl.fr-en news-commentary-v9.fr-en undoc.2000.fr-en giga-fren.release2.fixed"
  VOCAB=32000 SPM=unigram
fi
TEST_PLAIN=newstest2014-${TGT}en  # newstest2014-deen / newstest2014-fren, as in test-full.tgz
if [ -z "$GPUS" ]; then
  GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
TRAIN_SETS=() PREP_OPTS=() EVAL_OPTS=() TOKENS_PER_STEP=25000 DEVICE=cuda
if [ "$CI" = 1 ]; then
  GPUS=0 VOCAB=1000 TOKENS_PER_GPU=${TOKENS_PER_GPU:-300} TOKENS_PER_STEP=600 MAX_STEPS=${MAX_STEPS:-4}
  PREP_OPTS=(--num-workers 1)
  TRAIN_SETS=(--set model.n_layers=1 --set model.d_model=32 --set model.d_ff=64 --set model.n_heads=2
              --set model.d_k=16 --set model.d_v=16 --set train.warmup_steps=2 --set train.save_every_steps=1
              --set train.save_every_min=0 --set train.validate_every_steps=0 --set train.precision=fp32
              --set train.threads=1 --set train.log_every_steps=1 --set train.c_kernels=false)
  EVAL_OPTS=(--c-kernels false)
fi
[ "$GPUS" -ge 0 ] 2>/dev/null || die "--gpus must be a number, got $GPUS"
[ "$GPUS" = 0 ] && DEVICE=cpu

# find FILE in RAW (any subfolder), plain or .gz; the first match
find_file() {
  local hit
  hit=$(find "$RAW" \( -name "$1" -o -name "$1.gz" \) -print 2>/dev/null | sort | head -n 1)
  [ -n "$hit" ] && echo "$hit"
}
need_file() { find_file "$1" || die "$RAW: no $1 (or $1.gz); docs/wmt14.md lists the files to download"; }
# whether RAW holds every file the clean stage reads (each newstest side plain or as SGML)
raw_complete() {
  local c f
  for c in $CORPORA; do
    find_file "$c.en" > /dev/null && find_file "$c.$TGT" > /dev/null || return 1
  done
  for f in "newstest2013.en|newstest2013-src.en.sgm" "newstest2013.$TGT|newstest2013-ref.$TGT.sgm" \
           "$TEST_PLAIN.en|$TEST_PLAIN-src.en.sgm" "$TEST_PLAIN.$TGT|$TEST_PLAIN-ref.$TGT.sgm"; do
    find_file "${f%|*}" > /dev/null || find_file "${f#*|}" > /dev/null || return 1
  done
}
# one side of newstest as plain text: NAME.LANG if present, else the segments of an SGML file
test_side() {  # plain-name lang sgm-name out
  local plain sgm
  if plain=$(find_file "$1.$2"); then
    zcat -f "$plain" | tr -d '\r' > "$4"
  else
    sgm=$(find_file "$3") || die "$RAW: neither $1.$2 nor $3 (newstest from dev.tgz / test-full.tgz)"
    zcat -f "$sgm" | sed -n 's|.*<seg[^>]*>\(.*\)</seg>.*|\1|p' > "$4"
  fi
}

# §5.1's batch on DEVICES devices: at most TOKENS_PER_GPU tokens in one batch, ACCUM batches per
# step (the rule of aiayn.cost.estimate.paper_batch, which `aiayn estimate --tokens-per-step` uses)
DEVICES=$(( GPUS > 0 ? GPUS : 1 ))
MAX_PER_DEVICE=${TOKENS_PER_GPU:-$(sed -n 's/.*"max_tgt_tokens": *\([0-9]*\).*/\1/p' "$RECIPE")}
[ "${MAX_PER_DEVICE:-0}" -gt 0 ] 2>/dev/null || die "--tokens-per-gpu must be a positive number"
ACCUM=$(( (TOKENS_PER_STEP + DEVICES * MAX_PER_DEVICE - 1) / (DEVICES * MAX_PER_DEVICE) ))
PER_DEVICE=$(( TOKENS_PER_STEP / (DEVICES * ACCUM) ))
if has_stage plan; then
  echo "$PER_DEVICE $ACCUM"
  exit 0
fi

# every stage but clean runs aiayn through $PY (and train on GPUs through torchrun): said now, not
# after the clean stage's minutes (a checkout without .venv, or PYTHON naming another Python)
if [ "$STAGES" != clean ] && ! "$PY" -c 'import aiayn' 2>/dev/null; then
  die "$PY cannot import aiayn: activate its virtual environment (. .venv/bin/activate) or give PYTHON=.venv/bin/python"
fi
if has_stage train && [ "$GPUS" -gt 0 ] && ! command -v "${TORCHRUN:-torchrun}" > /dev/null; then
  die "no ${TORCHRUN:-torchrun} to train on $GPUS GPU(s): activate the virtual environment or give TORCHRUN=.venv/bin/torchrun"
fi

TEXT=$WORK/text DATA=$WORK/data RUN=$WORK/run
mkdir -p "$WORK"

if has_stage fetch && [ ! -f "$TEXT/done" ]; then
  if raw_complete; then
    say "fetch: $RAW holds every file the clean stage reads: skipped"
  else
    say "fetch: the WMT14 en-$TGT archives -> $RAW/wmt14 (docs/wmt14.md: sizes, checksums, disk)"
    aiayn data wmt14 --pair "en-$TGT" --out "$RAW" --unpack
  fi
fi

if has_stage clean && [ ! -f "$TEXT/done" ]; then
  say "clean: $CORPORA -> $TEXT/train.{en,$TGT}"
  mkdir -p "$TEXT"
  : > "$TEXT/train.en.tmp"; : > "$TEXT/train.$TGT.tmp"
  for c in $CORPORA; do
    src=$(need_file "$c.en"); tgt=$(need_file "$c.$TGT")
    n_src=$(zcat -f "$src" | wc -l); n_tgt=$(zcat -f "$tgt" | wc -l)
    [ "$n_src" = "$n_tgt" ] || die "$src has $n_src lines but $tgt has $n_tgt"
    paste <(zcat -f "$src" | tr -d '\r') <(zcat -f "$tgt" | tr -d '\r') | awk -F '\t' \
      -v a="$TEXT/train.en.tmp" -v b="$TEXT/train.$TGT.tmp" -v name="$c" '
      NF == 2 && $1 ~ /[^ ]/ && $2 ~ /[^ ]/ { print $1 >> a; print $2 >> b; kept++; next }
      { dropped++ }
      END { printf "%s: %d pairs kept, %d dropped (an empty side or a tab)\n", name, kept, dropped > "/dev/stderr" }'
  done
  mv "$TEXT/train.en.tmp" "$TEXT/train.en"; mv "$TEXT/train.$TGT.tmp" "$TEXT/train.$TGT"
  test_side newstest2013 en "newstest2013-src.en.sgm" "$TEXT/valid.en"
  test_side newstest2013 "$TGT" "newstest2013-ref.$TGT.sgm" "$TEXT/valid.$TGT"
  test_side "$TEST_PLAIN" en "$TEST_PLAIN-src.en.sgm" "$TEXT/test.en"
  test_side "$TEST_PLAIN" "$TGT" "$TEST_PLAIN-ref.$TGT.sgm" "$TEXT/test.$TGT"
  for s in valid test; do
    [ "$(wc -l < "$TEXT/$s.en")" = "$(wc -l < "$TEXT/$s.$TGT")" ] || die "$TEXT/$s.en and $s.$TGT differ in length"
  done
  touch "$TEXT/done"
fi

if has_stage prepare && [ ! -f "$DATA/manifest.json" ]; then
  say "prepare: shared $SPM vocabulary of $VOCAB -> $DATA"
  aiayn prepare --train-src "$TEXT/train.en" --train-tgt "$TEXT/train.$TGT" \
    --valid-src "$TEXT/valid.en" --valid-tgt "$TEXT/valid.$TGT" --test-src "$TEXT/test.en" --test-tgt "$TEXT/test.$TGT" \
    --vocab-size "$VOCAB" --model-type "$SPM" --out "$DATA" "${PREP_OPTS[@]}"
fi

if has_stage train; then
  STEP_OPT=()
  [ -n "$MAX_STEPS" ] && STEP_OPT=(--max-steps "$MAX_STEPS")
  ARGS=(train --data "$DATA" --out "$RUN" --recipe "$RECIPE" --no-progress "${TRAIN_SETS[@]}"
        --set "train.max_src_tokens=$PER_DEVICE" --set "train.max_tgt_tokens=$PER_DEVICE"
        --set "train.accum_steps=$ACCUM" "${STEP_OPT[@]}" "${SETS[@]}")
  say "train: $(basename "$RECIPE") on $DEVICES $DEVICE device(s): $PER_DEVICE tokens x $DEVICES x $ACCUM accumulated per step -> $RUN"
  if [ "$GPUS" -gt 0 ]; then
    "${TORCHRUN:-torchrun}" --standalone --nproc_per_node "$GPUS" -m aiayn.cli "${ARGS[@]}"
  else
    aiayn "${ARGS[@]}"
  fi
fi

if has_stage average; then
  say "average: the last $AVERAGE checkpoints of $RUN -> $RUN/average.pt"
  # --overwrite: average.pt is this stage's own file, and a run trained further needs it again
  aiayn average "$RUN" --last "$AVERAGE" --out "$RUN/average.pt" --overwrite
fi

if has_stage evaluate; then
  say "evaluate: newstest2014 $PAIR, beam 4, alpha 0.6, max length input + 50 -> $WORK/newstest2014.$TGT"
  aiayn evaluate --checkpoint "$RUN/average.pt" --src "$TEXT/test.en" --ref "$TEXT/test.$TGT" --lang "$TGT" \
    --beam-size 4 --alpha 0.6 --max-len-a 1 --max-len-b 50 --device "$DEVICE" --out "$WORK/newstest2014.$TGT" \
    "${EVAL_OPTS[@]}" --json > "$WORK/scores.json"
  "$PY" - "$WORK/scores.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"newstest2014: {r['sentences']} sentences in {r['seconds']:.1f} s")
for s in r["scores"]:
    print(f"  {s['label']}: {s['score']:.2f}  {s['signature']}")
EOF
fi
