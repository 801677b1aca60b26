"""How ``aiayn demo``'s training uses the cores: one process on all the threads, or one process
per core, synchronous (DDP: gradients all-reduced every step) or local SGD (weights averaged
every `train.local_sgd_period` steps).

    python bench/train_processes_ab.py --data runs/demo/data --minutes 3 --rounds 1

Each system is a real ``aiayn train`` of ``recipes/multi30k.json`` on a prepared Multi30k data
directory (``aiayn demo`` writes one to OUT/data) for --minutes of wall time, no checkpoints;
systems run one after another (interleaved over rounds), never at once. Prints a table and
writes results/train_processes_ab.json ($BENCH_RESULTS moves it): target tokens/s over the whole run (the run's own
summary: all ranks' tokens / wall time), steps, epochs and the final validation loss (for
runs this short the loss mostly reflects the number of updates, not the final quality).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import benchlib as bl

from aiayn.demo.config import RECIPES

RECIPE = RECIPES / "multi30k.json"

# name -> (processes, threads per process, local_sgd_period)
SYSTEMS = {
    "1proc-2thr": (1, 2, 0),
    "ddp-2proc-1thr": (2, 1, 0),
    "localsgd8-2proc-1thr": (2, 1, 8),
}


def run_system(name: str, data: Path, minutes: float, work: Path) -> dict:
    procs, threads, period = SYSTEMS[name]
    out = work / f"{name}-{time.monotonic_ns()}"
    s, _ = bl.train_as_demo(data, out, RECIPE, procs, threads, [f"train.local_sgd_period={period}",
                                                              f"train.max_time_min={minutes}", "train.save_every_min=0"])
    return {"system": name, "processes": procs, "threads_per_process": threads, "local_sgd_period": period,
            "tokens_per_s": s["tokens_per_s"], "steps": s["steps"], "epochs": s["epochs"],
            "target_tokens": s["target_tokens"], "valid_loss": s["valid"]["valid_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="a prepared Multi30k data directory (aiayn demo: OUT/data)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()
    names = args.systems.split(",")
    machine = bl.machine_info(threads=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names:
                row = run_system(name, args.data, args.minutes, Path(tmp))
                rows.append({"round": r, **row})
                print(json.dumps(rows[-1]), flush=True)
    base = [x["tokens_per_s"] for x in rows if x["system"] == names[0]]
    print(f"\n| system | target tok/s (per round) | / {names[0]} | steps | epochs | valid loss |")
    print("|---|---|---|---|---|---|")
    for name in names:
        mine = [x for x in rows if x["system"] == name]
        tps = [x["tokens_per_s"] for x in mine]
        ratio = sum(tps) / sum(base)
        print(f"| {name} | {' / '.join(f'{v:,.0f}' for v in tps)} | {ratio:.2f}x | "
              f"{' / '.join(str(x['steps']) for x in mine)} | {' / '.join(str(x['epochs']) for x in mine)} | "
              f"{' / '.join(format(x['valid_loss'], '.3f') for x in mine)} |")
    path = bl.write_result("train_processes_ab", {"machine": machine, "minutes": args.minutes, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
