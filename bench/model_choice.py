"""Which weights to translate with: chosen by validation BLEU, by validation loss, the last, the
average of the last 5 (§6.1) or the moving average (train.ema_decay), all scored on test_2016.

    aiayn demo --out runs/bleu --set train.valid_bleu=true,train.best_metric=bleu
    aiayn demo --out runs/ema --set train.ema_decay=0.999
    python bench/model_choice.py runs/bleu runs/ema

For each demo folder: ``best.pt`` (what train.best_metric chose), the step checkpoint of the
lowest validation loss (every checkpoint records its validation), ``last.pt``, the demo's
``model.pt`` (the last 5 averaged) and ``ema.pt`` where the run kept one, each translated with the
length penalty the demo chose on the validation set (its results.json) and scored like the demo
(Multi30k tokenized BLEU, sacreBLEU). Also reports the share of training time validation took.
Writes results/model_choice.json (or $BENCH_RESULTS).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import benchlib as bl


def evaluate(checkpoint: Path, files: dict, alpha: float, threads: int) -> dict:
    cmd = [sys.executable, "-m", "aiayn.cli", "evaluate",
           "--checkpoint", str(checkpoint), "--src", str(files["src"]), "--ref", str(files["ref"]),
           "--tok-ref", str(files["tok"]), "--alpha", str(alpha), "--json", "--quiet"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return {r["label"]: round(r["score"], 2) for r in json.loads(out[out.index("{"):])["scores"]}


def candidates(run: Path) -> dict[str, Path]:
    """The weights to compare in one demo folder, by name."""
    from aiayn.checkpoint import load_checkpoint, step_checkpoints
    out = {"best.pt (train.best_metric)": run / "run" / "best.pt"}
    if (run / "run" / "ema.pt").exists():  # the validations scored the average, not the step's weights
        out["ema.pt (train.ema_decay)"] = run / "run" / "ema.pt"
    else:
        steps = [(load_checkpoint(p).get("valid") or {}, p) for p in step_checkpoints(run / "run")]
        by_loss = min((v["valid_loss"], p) for v, p in steps if "valid_loss" in v)[1]
        out[f"lowest valid loss ({by_loss.name})"] = by_loss
    return {**out, "last.pt": run / "run" / "last.pt", "model.pt (last 5 averaged)": run / "model.pt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="aiayn demo output folders")
    ap.add_argument("--data-root", default="")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bl.setup_logging()
    from aiayn.data.multi30k import default_data_root, multi30k_files
    result = {"machine": bl.machine_info(args.threads), "runs": {}}
    for run in map(Path, args.runs):
        demo = json.loads((run / "results.json").read_text())
        src = demo["direction"].split("-")[0]
        tgt = demo["direction"].split("-")[1]
        f = multi30k_files(Path(args.data_root or default_data_root()), src, tgt)
        files = {"src": f[f"raw.test.{src}"], "ref": f[f"raw.test.{tgt}"], "tok": f[f"tok.test.{tgt}"]}
        t = demo["train"]
        entry = {"sets": demo["config"]["sets"], "alpha": demo["alpha"], "steps": t["steps"],
                 "train_seconds": t["train_seconds"], "valid_seconds": t.get("valid_seconds"),
                 "valid_bleu_seconds": t.get("valid_bleu_seconds"), "scores": {}}
        for name, path in candidates(run).items():
            entry["scores"][name] = evaluate(path, files, demo["alpha"], args.threads)
            bl.log.info("%s %s: %s", run.name, name, entry["scores"][name])
        result["runs"][str(run)] = entry
    bl.write_result("model_choice", result)


if __name__ == "__main__":
    main()
