#!/usr/bin/env bash
# The beam-search attention kernel alone, this checkout's against a git revision's (default HEAD~1):
# bench/c/beam_attention_driver.c built against each beam_attention.c with the flags loader.py uses
# (-march=native, or $AIAYN_KERNELS_MARCH as the loader takes it),
# run alternately ROUNDS times (15) at self-attention n = 35 and cross-attention n = 21; the minimum
# per call of each is printed (the minimum, because this is for an A/B on a machine that may be busy),
# and the outputs of the two compared (max |difference|).
#
#   bash bench/beam_attention_ab.sh [REV]
set -euo pipefail
BENCH="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$BENCH")"
REV="${1:-HEAD~1}"
ROUNDS="${ROUNDS:-15}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
DEC="$REPO/src/aiayn/kernels"
git -C "$REPO" show "$REV:src/aiayn/kernels/beam_attention.c" > "$WORK/old.c"
cp "$DEC/beam_attention.c" "$WORK/new.c"
# loader.py's compiler flags (read from its _FLAGS, without those that make a shared library)
read -r -a FLAGS <<< "$(python3 -c "
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
flags = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and any(getattr(t, 'id', None) == '_FLAGS' for t in n.targets))
print(' '.join(f for f in flags if f not in ('-fPIC', '-shared')))" "$DEC/loader.py")"
MARCH="${AIAYN_KERNELS_MARCH:-native}"
for v in old new; do  # team.c: the thread split's entry points (split.h), none handed over here: own threads
  ${CC:-cc} "${FLAGS[@]}" -march="$MARCH" -I"$DEC" "$BENCH/c/beam_attention_driver.c" "$WORK/$v.c" "$DEC/team.c" \
    -o "$WORK/$v" -lm -pthread
done
for args in "35 50" "21 50 cross"; do
  best_old=""; best_new=""
  for _ in $(seq "$ROUNDS"); do
    for v in old new; do
      t=$("$WORK/$v" $args | sed 's/.*: \([0-9.]*\) us.*/\1/')
      b="best_$v"
      if [ -z "${!b}" ] || python3 -c "import sys; sys.exit(not $t < ${!b})"; then printf -v "$b" '%s' "$t"; fi
    done
  done
  DUMP="$WORK/o_old" "$WORK/old" ${args/50/1} >/dev/null
  DUMP="$WORK/o_new" "$WORK/new" ${args/50/1} >/dev/null
  diff=$(python3 -c "
import array
a, b = array.array('f'), array.array('f')
a.frombytes(open('$WORK/o_old', 'rb').read()); b.frombytes(open('$WORK/o_new', 'rb').read())
print(max(abs(x - y) for x, y in zip(a, b)))")
  echo "$args: $REV ${best_old} us, this checkout ${best_new} us (min of $ROUNDS), ratio $(python3 -c "print(f'{$best_new / $best_old:.2f}')"); max |difference| $diff"
done
