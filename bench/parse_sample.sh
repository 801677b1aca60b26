#!/usr/bin/env bash
# Constituency parsing (§6.3) on the NLTK WSJ sample: prepare, train, decode dev (constrained and
# not) and test (constrained), §6.3's beam 21 / alpha 0.3 / +300, right-branching baselines.
# Results in BENCHMARKS.md §6 and bench/results/*/parse_sample.json.
#   bench/parse_sample.sh OUT [MINUTES] [extra `aiayn parse train` options...]
set -euo pipefail
OUT=${1:?usage: bench/parse_sample.sh OUT [MINUTES] [train options]}
MINUTES=${2:-20}
shift $(( $# > 1 ? 2 : 1 ))
AIAYN=${AIAYN:-"python -m aiayn.cli"}
DATA=${AIAYN_SHARED_DATA:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread per process: much faster on busy shared cores
mkdir -p "$OUT"
[ -d "$OUT/ptb/data" ] || $AIAYN parse prepare --treebank "$DATA/ptb-wsj-nltk-sample/treebank.zip" --out "$OUT/ptb"
$AIAYN parse train --data "$OUT/ptb/data" --out "$OUT/run" --no-progress --set train.threads=1 \
    --set train.max_time_min="$MINUTES" --set train.max_steps=100000 --set train.warmup_steps=400 \
    --set train.lr_decay_frac=0.3 --set train.lr_decay_by_time=true --set model.p_drop=0.2 \
    --set train.save_every_min=3 --set train.validate_at_save=false --set train.validate_every_steps=0 "$@"
decode() {  # split constrained tag
    /usr/bin/time -f "decode $1 constrained=$2: %e s" $AIAYN parse decode --checkpoint "$OUT/run/last.pt" \
        --gold "$OUT/ptb/$1.gold" --out "$OUT/$1.$3.pred" --constrained "$2" | tee "$OUT/$1.$3.rsl"
}
decode dev true constrained
decode dev false free
decode test true constrained
sed 's/^LABELED 1/LABELED 0/' "$DATA/evalb/COLLINS.prm" > "$OUT/unlabeled.prm"
for split in dev test; do
    $AIAYN parse baseline --gold "$OUT/ptb/$split.gold" --out "$OUT/$split.rb"
    $AIAYN parse score --gold "$OUT/ptb/$split.gold" --test "$OUT/$split.rb" | tee "$OUT/$split.rb.rsl"
    $AIAYN parse score --gold "$OUT/ptb/$split.gold" --test "$OUT/$split.rb" --param "$OUT/unlabeled.prm" \
        | tee "$OUT/$split.rb.unlabeled.rsl"
done
