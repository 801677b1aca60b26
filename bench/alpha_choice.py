"""How ``aiayn demo`` chooses the length penalty α, on finished ``aiayn demo`` runs: for each run's averaged
model (``model.pt``), validation BLEU at each α, the α each rule chooses, and test_2016 at every α.

    python bench/alpha_choice.py runs/a runs/b [--src-lang en] [--p-level 0.05]

The two rules (aiayn.evaluate.alpha.choose_alpha): "best", the highest validation score however small its lead
(``--alpha-significance 0``); "paired", the first α (§6.1's 0.6) unless another beats it on validation at
p < --p-level in Koehn (2004)'s paired bootstrap. Translation only: about 50 s per run on 2 threads. Writes
results/alpha_choice_<src>-<tgt>.json. Test is reported at every α so that nothing is hidden; it chooses nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchlib as bl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dirs", nargs="+", help="aiayn demo output directories (each holds model.pt)")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--alphas", default="0.6,1.0,1.4,1.8")
    ap.add_argument("--p-level", type=float, default=0.05)
    ap.add_argument("--data-root", default="")
    args = ap.parse_args(argv)

    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.alpha import ValidationSet, choose_alpha, tune_alpha
    from aiayn.evaluate.multi30k import multi30k_bleu

    ev = bl.multi30k_eval_sets(args.src_lang, args.data_root)
    src, tgt = ev["src"], ev["tgt"]
    out = {"direction": f"{src}-{tgt}", "alphas": args.alphas, "p_level": args.p_level, "runs": {}}
    rows = []
    for demo_dir in args.demo_dirs:
        tr = Translator.from_checkpoint(Path(demo_dir) / "model.pt")
        tuning, val_hyps = tune_alpha(tr, ValidationSet(ev["val_src"], ev["val_tok"], tgt), args.alphas, 4)
        best, _ = choose_alpha(val_hyps, ev["val_tok"], tgt, 0.0)
        paired, p = choose_alpha(val_hyps, ev["val_tok"], tgt, args.p_level)
        test = {}
        for a in tuning:
            tr.cfg = DecodeConfig(beam_size=4, alpha=a)
            bleu = multi30k_bleu(tr.translate(ev["test_src"]), ev["test_tok"], tgt)
            test[a] = {"multi30k_bleu": round(bleu.score, 2), "length_ratio": round(bleu.length_ratio, 3)}
        out["runs"][demo_dir] = {"valid": {str(a): r for a, r in tuning.items()}, "p_vs_first": {str(a): v for a, v in p.items()},
                                 "best": best, "paired": paired, "test": {str(a): r for a, r in test.items()}}
        rows.append([demo_dir, " / ".join(f"{r['valid_multi30k_bleu']:.2f}" for r in tuning.values()),
                     " / ".join(f"{v:.3f}" for v in p.values()), f"{best}", f"{paired}",
                     " / ".join(f"{r['multi30k_bleu']:.2f}" for r in test.values()),
                     f"{test[best]['multi30k_bleu']:.2f}", f"{test[paired]['multi30k_bleu']:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    bl.print_table(["run", f"val BLEU at α {args.alphas}", "p vs first", "α best", f"α paired (p < {args.p_level})",
                    "test BLEU at each α", "test (best)", "test (paired)"], rows)
    bl.write_result(f"alpha_choice_{src}-{tgt}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
