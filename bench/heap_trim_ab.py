"""When training trims glibc's heap (``AIAYN_HEAP_TRIM``, aiayn/host/allocator.py): speed and memory.

    python bench/heap_trim_ab.py --data runs/demo/data --steps 400 --rounds 3

Each system is a real ``aiayn train`` of ``recipes/multi30k.json`` as ``aiayn demo`` runs it (2
data-parallel processes of one thread each) on a prepared Multi30k data directory (``aiayn demo``
writes one to OUT/data), for --steps steps (the recipe's 45-minute schedule, no checkpoints), with
one value of ``AIAYN_HEAP_TRIM``:
  always   a trim every 10 steps (``malloc_trim``; the rule before ``HeapGrowth``)
  grown    a trim every 10 steps where the heap has grown by a quarter since the last (the default)
  never    no trim between validations
Systems run one after another, interleaved over rounds, never at once. Prints a table and writes
results/heap_trim_ab.json ($BENCH_RESULTS moves it): target tokens/s over the whole run (the run's
own summary), and the peak resident memory of the largest process (``wait4``'s ru_maxrss over the
launcher and its ranks).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import benchlib as bl

from aiayn.demo.config import RECIPES
from aiayn.host.allocator import TRIM_CHOICES, TRIM_ENV

RECIPE = RECIPES / "multi30k.json"


def run_system(choice: str, data: Path, steps: int, work: Path) -> dict:
    out = work / f"{choice}-{time.monotonic_ns()}"
    s, usage = bl.train_as_demo(data, out, RECIPE, 2, 1, [f"train.max_steps={steps}", "train.save_every_min=0"],
                                env={TRIM_ENV: choice})
    return {"system": choice, "tokens_per_s": s["tokens_per_s"], "steps": s["steps"],
            "peak_rss_mb": usage.ru_maxrss / 1024, "valid_loss": s["valid"]["valid_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="a prepared Multi30k data directory (aiayn demo: OUT/data)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default=",".join(TRIM_CHOICES))
    args = ap.parse_args()
    names = args.systems.split(",")
    machine = bl.machine_info(threads=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names:
                rows.append({"round": r, **run_system(name, args.data, args.steps, Path(tmp))})
                print(json.dumps(rows[-1]), flush=True)
    base_name = "always" if "always" in names else names[0]
    base = statistics.median(x["tokens_per_s"] for x in rows if x["system"] == base_name)
    print(f"\n| AIAYN_HEAP_TRIM | target tok/s (per round) | median / {base_name} | peak RSS MB (per round) | "
          "valid loss |")
    print("|---|---|---|---|---|")
    for name in names:
        mine = [x for x in rows if x["system"] == name]
        tps = [x["tokens_per_s"] for x in mine]
        print(f"| {name} | {' / '.join(f'{v:,.0f}' for v in tps)} | {statistics.median(tps) / base:.3f}x | "
              f"{' / '.join(format(x['peak_rss_mb'], ',.0f') for x in mine)} | "
              f"{' / '.join(format(x['valid_loss'], '.4f') for x in mine)} |")
    path = bl.write_result("heap_trim_ab", {"machine": machine, "steps": args.steps, "recipe": RECIPE.name,
                                            "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
