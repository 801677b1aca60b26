#!/usr/bin/env bash
# Constituency parsing (§6.3) on the NLTK WSJ sample: prepare, train, average, decode dev and test
# (constrained, §6.3's beam 21 / alpha 0.3 / +300), right-branching baselines. Results in BENCHMARKS.md.
#   bench/parse_sample.sh OUT [MINUTES] [extra `aiayn parse train` options...]
set -euo pipefail
OUT=${1:?usage: bench/parse_sample.sh OUT [MINUTES] [train options]}
MINUTES=${2:-18}
shift $(( $# > 1 ? 2 : 1 ))
AIAYN=${AIAYN:-"python -m aiayn.cli"}
DATA=${AIAYN_SHARED_DATA:-../shared/data}
mkdir -p "$OUT"
[ -d "$OUT/ptb/data" ] || $AIAYN parse prepare --treebank "$DATA/ptb-wsj-nltk-sample/treebank.zip" --out "$OUT/ptb"
/usr/bin/time -f "train wall %e s" $AIAYN parse train --data "$OUT/ptb/data" --out "$OUT/run" --no-progress \
    --set train.max_time_min="$MINUTES" --set train.max_steps=100000 --set train.warmup_steps=400 \
    --set train.lr_decay_frac=0.3 --set train.lr_decay_by_time=true --set model.p_drop=0.2 \
    --set train.save_every_min=3 --set train.validate_at_save=false --set train.validate_every_steps=0 "$@"
$AIAYN average "$OUT/run" --last 3 --out "$OUT/avg3.pt"
for split in dev test; do
    /usr/bin/time -f "decode $split wall %e s" $AIAYN parse decode --checkpoint "$OUT/avg3.pt" \
        --gold "$OUT/ptb/$split.gold" --out "$OUT/$split.pred" | tee "$OUT/$split.score"
    $AIAYN parse baseline --gold "$OUT/ptb/$split.gold" --out "$OUT/$split.rb"
    $AIAYN parse score --gold "$OUT/ptb/$split.gold" --test "$OUT/$split.rb" | tee "$OUT/$split.rb.score"
done
