#!/usr/bin/env bash
# Set up aiayn in a virtual environment at .venv (or $AIAYN_VENV), made where missing.
#
#   bash scripts/setup.sh                                        # a CPU checkout; the tests run after it
#   AIAYN_TORCH=skip bash scripts/setup.sh                       # beside the CUDA torch already in the venv
#
# AIAYN_TORCH   cpu (default): torch and triton at the pins of constraints/cpu.txt, the one place the
#               CPU pins live. skip: the venv's torch is left as it is, whatever its version: no torch or
#               triton pin applies (pip adds a torch only where the venv has none).
# AIAYN_EXTRAS  pyproject.toml's extras, comma-separated. Default: test,serve,ct2,hf with the CPU torch
#               (a development checkout: the README's test command needs pytest), serve,ct2,hf with skip
#               (an install to use, without the test tools); "" installs aiayn alone.
# AIAYN_DRY_RUN=DIR  install nothing: each pip call resolves with --dry-run and writes what it would
#               install to DIR/torch.json and DIR/aiayn.json (pip's installation report).
# constraints/common.txt pins what every install takes (uvicorn and h11, whose internals the service reads).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AIAYN_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH=${AIAYN_TORCH:-cpu}
case $TORCH in
  cpu) EXTRAS=${AIAYN_EXTRAS-test,serve,ct2,hf}; PINS=(-c constraints/cpu.txt -c constraints/common.txt) ;;
  skip) EXTRAS=${AIAYN_EXTRAS-serve,ct2,hf}; PINS=(-c constraints/common.txt) ;;
  *) echo "scripts/setup.sh: AIAYN_TORCH must be cpu or skip, got '$TORCH'" >&2; exit 2 ;;
esac
DRY=${AIAYN_DRY_RUN:-}

pip_install() {  # $1: the report's name under AIAYN_DRY_RUN; the rest: pip install's arguments
  local name=$1; shift
  if [ -n "$DRY" ]; then
    mkdir -p "$DRY"
    "$VENV/bin/python" -m pip install -q --dry-run --report "$DRY/$name.json" "$@"
  else
    "$VENV/bin/python" -m pip install -q "$@"
  fi
}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -n "$DRY" ] || "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ "$TORCH" = cpu ]; then
  pip_install torch -c constraints/cpu.txt torch
elif ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('torch')" 2>/dev/null; then
  echo "scripts/setup.sh: AIAYN_TORCH=skip but $VENV has no torch: pip will add its default build" >&2
fi
pip_install aiayn "${PINS[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
if [ -n "$DRY" ]; then echo "aiayn planned for $VENV: $DRY" >&2; else echo "aiayn installed in $VENV" >&2; fi
