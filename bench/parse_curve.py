"""Dev F1 along a parsing run: the learning curve of `aiayn parse demo`, and averaging against the
last checkpoint.

For each minute mark M, the average of the last ``--average-last`` checkpoints written by minute M
of training (their wall time read from the run's train_log.jsonl) parses the dev split with the
demo's decoding (constrained, beam 21, alpha 0.3) and is scored with EVALB (COLLINS.prm). The
schedule of the run is measured in its whole time budget, so a point at minute M is the model on
its way, not what a run of M minutes would reach. ``--last-alone`` also scores the last checkpoint
by itself. Dev only: test is never looked at while choosing.

    python bench/parse_curve.py runs/parse-demo --minutes 5,10,20,30,45 --last-alone --out RESULT.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from aiayn.checkpoint import STEP_RE, atomic_save, average_checkpoints, step_checkpoints
from aiayn.config import replace
from aiayn.decode.translator import Translator
from aiayn.parsing.decode import PARSE_DECODE, parse_trees
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.trees import parse_tree


def minute_of_steps(run: Path) -> dict[int, float]:
    """Training minutes at each logged step (train_log.jsonl)."""
    out = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "elapsed_s" in rec:
            out[int(rec["step"])] = rec["elapsed_s"] / 60
    return out


def minute_of(step: int, logged: dict[int, float]) -> float:
    """The minute of ``step``: that of the first logged step at or after it."""
    later = [s for s in logged if s >= step]
    return logged[min(later)] if later else max(logged.values())


def dev_f1(model: dict, ptb: Path, tmp: Path) -> tuple[float, float]:
    """(labeled F1, seconds to parse) of ``model`` on ``ptb``/dev.gold."""
    atomic_save(model, tmp)
    translator = Translator.from_checkpoint(tmp, PARSE_DECODE, device="cpu")
    gold_lines = read_lines(ptb / "dev.gold")
    t0 = time.monotonic()
    trees, stats = parse_trees(translator, [parse_tree(g) for g in gold_lines])
    seconds = time.monotonic() - t0
    assert stats.repaired == 0
    return evalb(gold_lines, [t.to_bracketed() for t in trees], COLLINS).all.fmeasure, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("demo_out", type=Path, help="an `aiayn parse demo` output folder (holds ptb/ and run/)")
    ap.add_argument("--minutes", default="5,10,20,30,45")
    ap.add_argument("--average-last", type=int, default=5)
    ap.add_argument("--last-alone", action="store_true", help="also score the last checkpoint alone")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the points")
    args = ap.parse_args()
    run, ptb = args.demo_out / "run", args.demo_out / "ptb"
    logged = minute_of_steps(run)
    ckpts = [(minute_of(int(STEP_RE.search(p.name).group(1)), logged), p) for p in step_checkpoints(run)]
    tmp = args.demo_out / "curve.tmp.pt"
    points = []
    for m in (float(x) for x in args.minutes.split(",")):
        upto = [p for minute, p in ckpts if minute <= m + 0.5][-args.average_last:]
        if not upto:
            continue
        f1, seconds = dev_f1(average_checkpoints(upto), ptb, tmp)
        points.append({"minutes": m, "checkpoints": [p.name for p in upto], "dev_f1": round(f1, 2),
                       "parse_seconds": round(seconds, 1)})
        print(json.dumps(points[-1]), flush=True)
    result = {"run": str(args.demo_out), "points": points}
    if args.last_alone:
        last = step_checkpoints(run)[-1]
        f1, _ = dev_f1(average_checkpoints([last]), ptb, tmp)
        result["last_alone"] = {"checkpoint": last.name, "dev_f1": round(f1, 2)}
        print(json.dumps(result["last_alone"]), flush=True)
    tmp.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
