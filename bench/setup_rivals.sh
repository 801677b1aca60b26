#!/usr/bin/env bash
# The virtual environment the speed benchmarks run in: aiayn (editable) plus its rivals,
# Hugging Face transformers (MarianMTModel) and CTranslate2, with the same CPU torch as aiayn.
#
#   bash bench/setup_rivals.sh            # venv at ../benchvenv beside the checkout
#   BENCH_VENV=/some/where bash bench/setup_rivals.sh
#
# The rivals live in their own venv so that aiayn's own environment (.venv, CI) never needs
# them. torch comes from constraints/cpu.txt, the one place the CPU pin lives. Nothing else
# is downloaded later: the rival models are built from configurations with random weights.
set -euo pipefail
BENCH="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$BENCH")"
BENCH_VENV="${BENCH_VENV:-$(dirname "$REPO")/benchvenv}"
PY="${PYTHON:-python3}"
[ -x "$BENCH_VENV/bin/python" ] || "$PY" -m venv "$BENCH_VENV"
PIP=("$BENCH_VENV/bin/python" -m pip install -q -c "$REPO/constraints/cpu.txt")
"${PIP[@]}" torch transformers sentencepiece sacrebleu ctranslate2
"${PIP[@]}" -e "$REPO"
"$BENCH_VENV/bin/python" - <<'EOF'
import ctranslate2, torch, transformers
import aiayn
print(f"bench venv ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"ctranslate2 {ctranslate2.__version__}, aiayn {aiayn.__version__}")
EOF
