#!/usr/bin/env bash
# Set up aiayn in a fresh virtual environment at .venv (or $AIAYN_VENV).
# CPU machines get torch from constraints/cpu.txt (the one place the CPU pin lives);
# GPU users: install your CUDA torch into the venv first and run with AIAYN_TORCH=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AIAYN_VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ "${AIAYN_TORCH:-cpu}" = "cpu" ]; then
  "$VENV/bin/python" -m pip install -q -c constraints/cpu.txt torch
fi
"$VENV/bin/python" -m pip install -q -c constraints/cpu.txt -e ".[test,serve,ct2,hf]"
echo "aiayn installed in $VENV" >&2
