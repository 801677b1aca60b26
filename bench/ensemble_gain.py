"""What an ensemble of trained models adds over each of them, on Multi30k's validation set.

Two (or more) finished ``aiayn demo`` runs of one recipe, trained apart, and the ensemble of their
averaged models (``model.pt``; the mean of their next-token probabilities, as ``aiayn translate
--checkpoint a.pt b.pt``), each translating validation at every α (``aiayn.evaluate.alpha.tune_alpha``,
Multi30k tokenized BLEU as ``aiayn demo`` scores it), then test_2016 at the α validation scored best
(reported, never chosen on). The question it answers for ``aiayn demo --members N``: where N models
can train at once at full speed each (a GPU the step leaves mostly idle), how much do they add.

    python bench/ensemble_gain.py runs/demo-a runs/demo-b [--src-lang en] [--data-root DIR]
    python bench/ensemble_gain.py runs/gpu/member1 ... runs/gpu/member4 --sizes 2,4

Results: ``$BENCH_RESULTS/ensemble_gain.json`` (default bench/results/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchlib as bl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dirs", nargs="+", help="aiayn demo output directories of one recipe (each holds model.pt)")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--alphas", default="0.6,1.0,1.4")
    ap.add_argument("--data-root", default="")
    ap.add_argument("--sizes", default="", help="ensembles of the first K models for each K given (e.g. 2,4); "
                                                 "default: all the models as one")
    args = ap.parse_args(argv)
    if len(args.demo_dirs) < 2:
        ap.error("give two or more demo directories")

    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.alpha import ValidationSet, tune_alpha
    from aiayn.evaluate.multi30k import multi30k_bleu

    ev = bl.multi30k_eval_sets(args.src_lang, args.data_root)
    valid = ValidationSet(ev["val_src"], ev["val_tok"], ev["tgt"])
    models = {d: Path(d) / "model.pt" for d in args.demo_dirs}
    sizes = [int(k) for k in args.sizes.split(",")] if args.sizes else [len(models)]
    if not all(2 <= k <= len(models) for k in sizes):
        ap.error(f"--sizes: each between 2 and the {len(models)} models given")
    ensembles = {("ensemble" if k == len(models) else f"ensemble of {k}"): args.demo_dirs[:k] for k in sizes}
    systems = {}
    for name, dirs in {**{d: [d] for d in models}, **ensembles}.items():
        paths = [models[d] for d in dirs]
        tr = Translator.from_checkpoint(paths)
        tuning, _ = tune_alpha(tr, valid, args.alphas, 4)
        best = max(tuning, key=lambda a: tuning[a]["valid_multi30k_bleu"])
        tr.cfg = DecodeConfig(beam_size=4, alpha=best)
        bleu = multi30k_bleu(tr.translate(ev["test_src"]), ev["test_tok"], ev["tgt"])
        systems[name] = {"valid": {str(a): r for a, r in tuning.items()}, "alpha": best,
                         "test_2016": {"multi30k_bleu": round(bleu.score, 2), "length_ratio": round(bleu.length_ratio, 3)}}
        print(f"{name}: valid {' / '.join(str(r['valid_multi30k_bleu']) for r in tuning.values())} at α {args.alphas}; "
              f"test_2016 {systems[name]['test_2016']['multi30k_bleu']} at α {best}", flush=True)
    best_of = lambda s: s["valid"][str(s["alpha"])]["valid_multi30k_bleu"]  # noqa: E731
    gains = {}
    for name, dirs in ensembles.items():
        gains[name] = round(best_of(systems[name]) - max(best_of(systems[d]) for d in dirs), 2)
        print(f"{name} over the best of its models on validation (each at its α): {gains[name]:+.2f} BLEU")
    bl.write_result("ensemble_gain", {"direction": f"{ev['src']}-{ev['tgt']}", "alphas": args.alphas,
                                      "systems": systems, "valid_gain_over_best_single": gains})
    return 0


if __name__ == "__main__":
    sys.exit(main())
