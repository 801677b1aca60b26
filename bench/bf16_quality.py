"""Does bf16 mixed-precision training cost BLEU? A Multi30k recipe trained twice for the
same number of steps, once with bf16 autocast and once in float32, then averaged, α-tuned on
val and scored on test_2016 exactly as ``aiayn demo`` does (the bound: within 0.5 BLEU).

    python bench/bf16_quality.py --steps 1000 [--runs /tmp/aiayn-bf16-quality]

Both runs use the same seed, data, batches and recipe (recipes/multi30k-wide.json); only
train.precision differs, and checkpoints are written every steps/10 steps (not every 2.5
minutes) so that both average the same last 5 steps' checkpoints. Runs one after the other, each with the recipe's 2 threads: run it
on an otherwise idle machine (it also reports tokens/s of each). Writes
results/bf16_quality.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import benchlib as bl

REPO = Path(__file__).resolve().parent.parent


def run_demo(precision: str, steps: int, runs: Path, data_root: str) -> dict:
    recipe = json.loads((REPO / "recipes" / "multi30k-wide.json").read_text())
    recipe["train"]["precision"] = precision
    # checkpoints by step, not by minute, so that both runs average the same steps
    recipe["train"]["save_every_min"] = 0
    recipe["train"]["save_every_steps"] = max(1, steps // 10)
    recipe["description"] = f"recipes/multi30k-wide.json with train.precision={precision} (bench/bf16_quality.py)"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / f"multi30k-{precision}.json"
    path.write_text(json.dumps(recipe, indent=2))
    out = runs / precision
    cmd = [sys.executable, "-m", "aiayn.cli", "demo", "--recipe", str(path), "--max-steps", str(steps),
           "--out", str(out)] + (["--data-root", data_root] if data_root else [])
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--runs", default="/tmp/aiayn-bf16-quality", help="where the two runs go (checkpoints: ~1 GB)")
    ap.add_argument("--data-root", default="", help="as aiayn demo --data-root")
    args = ap.parse_args(argv)
    rows, out = [], {"steps": args.steps, "machine": bl.machine_info(2)}
    for precision in ("bf16", "fp32"):
        res = run_demo(precision, args.steps, Path(args.runs), args.data_root)
        test = res["test"]
        out[precision] = {
            "tokens_per_s": res["train"]["tokens_per_s"], "train_seconds": res["train"]["train_seconds"],
            "steps": res["train"]["steps"], "alpha": res["alpha"], "valid_multi30k_bleu": res["valid"]["multi30k_bleu"],
            "test_multi30k_bleu": test["Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)"]["score"],
            "test_sacrebleu": test["sacreBLEU"]["score"],
        }
    b, f = out["bf16"], out["fp32"]
    out["bleu_difference_bf16_minus_fp32"] = round(b["test_multi30k_bleu"] - f["test_multi30k_bleu"], 2)
    out["speed_ratio_bf16_over_fp32"] = round(b["tokens_per_s"] / f["tokens_per_s"], 2)
    for p in ("bf16", "fp32"):
        r = out[p]
        rows.append([p, str(r["steps"]), f"{r['tokens_per_s']:,.0f}", f"{r['train_seconds']:.0f}", f"{r['alpha']}",
                     f"{r['valid_multi30k_bleu']:.2f}", f"{r['test_multi30k_bleu']:.2f}", f"{r['test_sacrebleu']:.2f}"])
    bl.print_table(["precision", "steps", "tok/s", "train s", "α", "val BLEU", "test BLEU", "test sacreBLEU"], rows)
    print(f"bf16 - fp32 test BLEU: {out['bleu_difference_bf16_minus_fp32']:+.2f} (target: within 0.5); "
          f"speed {out['speed_ratio_bf16_over_fp32']:.2f}x")
    bl.write_result("bf16_quality", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
