"""Training with and without transparent huge pages (``aiayn.host.hugepages``), in whole runs.

    python bench/hugepages_ab.py --data runs/demo/data [--steps 2000 --pairs 2 --recipe R]

The effect shows over minutes, not in a few steps: a run slows as it goes, more without huge
pages than with them (measured, ``aiayn demo``'s first 2,000 steps: 12.1k -> 10.5k target tokens/s
without, 12.9k -> 11.6k with), which a short interleaved benchmark would not see. So this
runs ``aiayn train`` from scratch ``--pairs`` times in each setting, alternating on / off so that
machine drift hits both, each for ``--steps`` steps of the recipe on the same prepared data
(the same batches in the same order), and reports target tokens/s over the whole run and over
its last quarter (the mean of the logged 25-step rates), the ratio on / off per pair, and the
final validation loss (which must agree: huge pages change where memory lives, not what is
computed). Writes results/hugepages_ab.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl

from aiayn.host import hugepages
from aiayn.demo.config import RECIPES


def one_run(data: Path, recipe: Path, steps: int, threads: int, setting: str) -> dict:
    """``aiayn train`` for ``steps`` steps in a fresh process; its rates and validation loss."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, hugepages.ENV: setting}
        env.pop(hugepages.TORCH_ENV, None)  # a user's own setting would override ours
        cmd = [sys.executable, "-m", "aiayn.cli", "train", "--data", str(data), "--out", str(out),
               "--recipe", str(recipe), "--no-progress", "--set", f"train.max_steps={steps}",
               "--set", f"train.threads={threads}", "--set", "train.save_every_min=1000",
               "--set", "train.max_time_min=1000"]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((out / "summary.json").read_text())
        rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "tokens_per_s" in r]  # one row per 25 steps: the rate over those steps
    last = timed[(3 * len(timed)) // 4:]
    return {"hugepages": setting, "tokens_per_s": summary["tokens_per_s"],
            "last_quarter_tokens_per_s": statistics.mean(r["tokens_per_s"] for r in last),
            "train_seconds": summary["train_seconds"], "valid_loss": summary["valid"]["valid_loss"],
            "peak_rss_mb": max(r.get("rss_mb", 0) for r in timed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a prepared data directory (aiayn prepare, or a demo's OUT/data)")
    ap.add_argument("--recipe", default=str(RECIPES / "multi30k.json"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=bl.DEFAULT_THREADS)
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.pairs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            runs.append(one_run(Path(args.data), Path(args.recipe), args.steps, args.threads, mode))
            r = runs[-1]
            print(f"pair {i + 1} huge pages {mode:3}: {r['tokens_per_s']:8,.0f} tok/s, last quarter "
                  f"{r['last_quarter_tokens_per_s']:8,.0f}, valid loss {r['valid_loss']:.4f}, "
                  f"peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
    on = [r for r in runs if r["hugepages"] == "on"]
    off = [r for r in runs if r["hugepages"] == "off"]
    ratios = {k: [a[k] / b[k] for a, b in zip(on, off)] for k in ("tokens_per_s", "last_quarter_tokens_per_s")}
    payload = {"machine": bl.machine_info(args.threads), "recipe": args.recipe, "steps": args.steps, "runs": runs,
               "ratio_on_off": {k: statistics.median(v) for k, v in ratios.items()},
               "ratio_on_off_per_pair": ratios,
               "same_valid_loss": len({round(r["valid_loss"], 6) for r in runs}) == 1}
    print(f"huge pages on / off (median of {args.pairs} pairs): whole run "
          f"{payload['ratio_on_off']['tokens_per_s']:.3f}x, last quarter "
          f"{payload['ratio_on_off']['last_quarter_tokens_per_s']:.3f}x; same validation loss: "
          f"{payload['same_valid_loss']}")
    print(bl.write_result("hugepages_ab", payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
