"""What an ensemble of trained models adds over each of them, on Multi30k's validation set.

Two (or more) models of one recipe, trained apart, and the ensemble of their next-token
probabilities (``aiayn ensemble``), each scored by ``aiayn evaluate`` at the same α values: the
Multi30k tokenized BLEU (lc.norm.tok) and sacreBLEU. The question it answers for ``aiayn demo
--members N``: where N models can train at once at full speed each (a GPU the step leaves mostly
idle), how much do they add. Validation only by default; ``--test`` scores test_2016 as well at the
α that validation chose for each (reported, never chosen on).

    python bench/ensemble_gain.py --shared ../shared runs/demo-a/model.pt runs/demo-b/model.pt

Results: ``$BENCH_RESULTS/ensemble_gain.json`` (default bench/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

M30K = "Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)"


def evaluate(checkpoint: str, multi30k: Path, split: str, alpha: float) -> dict:
    """``aiayn evaluate`` of one checkpoint on a Multi30k split (val, test_2016_flickr) at ``alpha``."""
    cmd = [sys.executable, "-m", "aiayn.cli", "evaluate", "--checkpoint", checkpoint,
           "--src", str(multi30k / f"raw/{split}.en.gz"), "--ref", str(multi30k / f"raw/{split}.de.gz"),
           "--tok-ref", str(multi30k / f"tok/{split}.lc.norm.tok.de.gz"), "--alpha", str(alpha), "--json", "--quiet"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    scores = {s["label"]: round(s["score"], 2) for s in out["scores"]}
    return {"multi30k_bleu": scores[M30K], "sacrebleu": scores["sacreBLEU"], "seconds": round(out["seconds"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="checkpoints of one recipe sharing the tokenizers (two or more)")
    ap.add_argument("--shared", default="../shared", help="the folder holding data/multi30k")
    ap.add_argument("--alphas", default="0.6,1.0,1.4")
    ap.add_argument("--test", action="store_true", help="also test_2016, at each system's validation-chosen α")
    args = ap.parse_args()
    if len(args.models) < 2:
        ap.error("give two or more checkpoints")
    multi30k = Path(args.shared) / "data" / "multi30k"
    alphas = [float(a) for a in args.alphas.split(",")]
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results")) / "ensemble_gain.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ens = str(Path(tmp) / "ensemble.pt")
        subprocess.run([sys.executable, "-m", "aiayn.cli", "ensemble", *args.models, "--out", ens], check=True,
                       capture_output=True)
        systems = {**{m: m for m in args.models}, "ensemble": ens}
        res = {name: {"valid": {}} for name in systems}
        for a in alphas:
            for name, path in systems.items():
                res[name]["valid"][str(a)] = r = evaluate(path, multi30k, "val", a)
                print(f"valid α {a}: {name}: {r['multi30k_bleu']} (sacreBLEU {r['sacrebleu']})", flush=True)
        for name, path in systems.items():
            best = max(alphas, key=lambda a: res[name]["valid"][str(a)]["multi30k_bleu"])
            res[name]["alpha"] = best
            if args.test:
                res[name]["test_2016"] = r = evaluate(path, multi30k, "test_2016_flickr", best)
                print(f"test_2016 α {best}: {name}: {r['multi30k_bleu']} (sacreBLEU {r['sacrebleu']})", flush=True)
    singles = [res[m]["valid"][str(res[m]["alpha"])]["multi30k_bleu"] for m in args.models]
    gain = round(res["ensemble"]["valid"][str(res["ensemble"]["alpha"])]["multi30k_bleu"] - max(singles), 2)
    print(f"ensemble over the best single model on validation (each at its α): {gain:+.2f} BLEU")
    out.write_text(json.dumps({"models": args.models, "alphas": alphas, "systems": res,
                               "valid_gain_over_best_single": gain}, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
