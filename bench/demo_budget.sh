#!/usr/bin/env bash
# The demo's recipes by budget: `aiayn demo` with a recipe trained to a budget of counted FLOPs
# (train.max_flops) instead of minutes, so the run is the same on any machine (docs/recipe.md,
# "Sized to the machine"). Each run writes OUT/results.json; the summary goes to
# bench/results/$RESULTS/demo_budget.json.
#
#   RESULTS=amd-epyc-zen4-2026-11-28 bash bench/demo_budget.sh \
#       multi30k-quick:1.4e13:40:1 multi30k-small:1.7e14:160:1 ...
#
# each argument RECIPE:FLOPS:SAVE_EVERY_STEPS:SEED (the checkpoints the last 5 of which are
# averaged: about a third of the run's steps for the last 5). Runs go to runs/budget/NAME.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:?name the results folder, e.g. RESULTS=amd-epyc-zen4-2026-11-28}
AIAYN=${AIAYN:-.venv/bin/aiayn}
mkdir -p "bench/results/$RESULTS" runs/budget
for spec in "$@"; do
  IFS=: read -r recipe flops save seed <<<"$spec"
  name="$recipe-$flops-seed$seed"
  "$AIAYN" demo --recipe "recipes/$recipe.json" --out "runs/budget/$name" --alphas "${ALPHAS:-0.6,1.0,1.4,1.8}" \
    --set "train.max_flops=$flops" --set train.max_time_min=0 --set "train.save_every_steps=$save" \
    --set train.save_every_min=0 --set "train.seed=$seed" > "runs/budget/$name.log" 2>&1
  echo "$name: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['test']['Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)']['score'])" "runs/budget/$name/results.json")"
done
python3 bench/demo_budget_summary.py "bench/results/$RESULTS/demo_budget.json" runs/budget/*/results.json
