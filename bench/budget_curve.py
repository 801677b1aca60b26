"""BLEU against the training budget, from one finished ``aiayn demo`` run: for each budget b,
average the last 5 checkpoints written within b minutes of training, choose α on val and
score test_2016, as ``aiayn demo`` would have done had it been given b minutes.

    python bench/budget_curve.py runs/demo --budgets 20,25,30,35,40,45 [--src-lang en]

The checkpoint times come from the run's train_log.jsonl (elapsed_s of the logged steps).
Translation only (no training): about 40 s per budget on 2 threads. Writes
results/budget_curve_<src>-<tgt>.json. α is chosen on val, never on test.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
from pathlib import Path

import benchlib as bl


def checkpoint_minutes(run_dir: Path) -> list[tuple[float, Path]]:
    """(training minutes, path) of each step checkpoint, from the steps' logged elapsed times."""
    from aiayn.checkpoint import STEP_RE, step_checkpoints

    steps, elapsed = [], []
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "elapsed_s" in rec:
            steps.append(rec["step"])
            elapsed.append(rec["elapsed_s"])
    out = []
    for p in step_checkpoints(run_dir):
        step = int(STEP_RE.search(p.name).group(1))
        i = min(bisect.bisect_left(steps, step), len(steps) - 1)  # first logged step >= step
        out.append((elapsed[i] / 60.0, p))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir", help="an aiayn demo output directory (holds run/)")
    ap.add_argument("--budgets", default="15,20,25,30,35,40,45")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--average-last", type=int, default=5)
    ap.add_argument("--alphas", default="0.6,1.0,1.4")
    ap.add_argument("--data-root", default="")
    args = ap.parse_args(argv)
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.alpha import ValidationSet, tune_alpha
    from aiayn.evaluate.bleu import sacre_bleu
    from aiayn.evaluate.multi30k import multi30k_bleu
    from aiayn.checkpoint import atomic_save, average_checkpoints

    ev = bl.multi30k_eval_sets(args.src_lang, args.data_root)
    src, tgt = ev["src"], ev["tgt"]
    ckpts = checkpoint_minutes(Path(args.demo_dir) / "run")
    rows, out = [], {"demo_dir": args.demo_dir, "direction": f"{src}-{tgt}", "budgets": []}
    for budget in [float(b) for b in args.budgets.split(",")]:
        within = [p for m, p in ckpts if m <= budget + 1e-6][-args.average_last:]
        if not within:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            avg = Path(tmp) / "avg.pt"
            atomic_save(average_checkpoints(within), avg)
            tr = Translator.from_checkpoint(avg)
        tuning = tune_alpha(tr, ValidationSet(ev["val_src"], ev["val_tok"], tgt), args.alphas, 4)[0]
        val = {a: r["valid_multi30k_bleu"] for a, r in tuning.items()}
        alpha = max(val, key=val.get)
        tr.cfg = DecodeConfig(beam_size=4, alpha=alpha)
        hyps = tr.translate(ev["test_src"])
        rec = {"budget_min": budget, "checkpoints": [p.name for p in within], "alpha": alpha,
               "valid_multi30k_bleu": val[alpha],
               "test_multi30k_bleu": round(multi30k_bleu(hyps, ev["test_tok"], tgt).score, 2),
               "test_sacrebleu": round(sacre_bleu(hyps, ev["test_raw"]).score, 2)}
        out["budgets"].append(rec)
        rows.append([f"{budget:g}", f"{within[0].name}..{within[-1].name}", f"{alpha}",
                     f"{rec['valid_multi30k_bleu']:.2f}", f"{rec['test_multi30k_bleu']:.2f}", f"{rec['test_sacrebleu']:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    bl.print_table(["minutes", "checkpoints averaged", "α (val)", "val BLEU", "test BLEU", "test sacreBLEU"], rows)
    bl.write_result(f"budget_curve_{src}-{tgt}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
