"""How many checkpoints to average (§6.1), from finished ``aiayn demo`` runs: for each run and
each k, average the run's last k checkpoints, measure the validation loss of the average,
choose α on val and score test_2016 at that α, as ``aiayn demo`` would have done with
``--average-last k``.

    python bench/average_sweep.py runs/a runs/b --counts 3,5,8,10 [--src-lang en]
    python bench/average_sweep.py runs/a --counts 5 --every 1,2,4,8   # their spacing: each 1st, 2nd, ...

``--every E`` takes every E-th checkpoint counting back from the newest: from a run that saved
densely, the average ``aiayn demo`` would have made had the run saved E times less often.

Translation only (no training): about 45 s per (run, k) on 2 threads. Writes
results/average_sweep_<src>-<tgt>.json. k and α are for validation to choose; test is
reported, never used to choose.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import benchlib as bl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dirs", nargs="+", help="aiayn demo output directories (each holds run/ and data/)")
    ap.add_argument("--counts", default="3,5,8,10", help="numbers of last checkpoints to average")
    ap.add_argument("--every", default="1", help="spacings to try: every E-th checkpoint back from the newest")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--alphas", default="0.6,1.0,1.4,1.8")
    ap.add_argument("--p-level", type=float, default=0.05, help="aiayn demo --alpha-significance")
    ap.add_argument("--data-root", default="")
    args = ap.parse_args(argv)
    import torch

    from aiayn.data.dataset import DataDir
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.alpha import ValidationSet, choose_alpha, tune_alpha
    from aiayn.evaluate.bleu import sacre_bleu
    from aiayn.evaluate.multi30k import multi30k_bleu
    from aiayn.model.transformer import Transformer
    from aiayn.checkpoint import atomic_save, average_checkpoints, step_checkpoints
    from aiayn.train.config import run_config_from_dict
    from aiayn.train.runtime import Dist, Place
    from aiayn.train.validation import validate

    ev = bl.multi30k_eval_sets(args.src_lang, args.data_root)
    src, tgt = ev["src"], ev["tgt"]
    out = {"direction": f"{src}-{tgt}", "counts": args.counts, "every": args.every, "runs": {}}
    rows = []
    for demo_dir in args.demo_dirs:
        ckpts = step_checkpoints(Path(demo_dir) / "run")
        valid = DataDir(Path(demo_dir) / "data").split("valid")
        out["runs"][demo_dir] = recs = []
        for k, every in [(int(c), int(e)) for c in args.counts.split(",") for e in args.every.split(",")]:
            last = ckpts[::-1][::every][:k][::-1]
            if len(last) < k:
                print(f"{demo_dir}: {len(ckpts)} checkpoints, too few for {k} every {every}; skipped")
                continue
            ckpt = average_checkpoints(last)
            with tempfile.TemporaryDirectory() as tmp:
                avg = Path(tmp) / "avg.pt"
                atomic_save(ckpt, avg)
                tr = Translator.from_checkpoint(avg)
            cfg = run_config_from_dict(ckpt["run_config"])
            model = Transformer(cfg.model)
            model.load_state_dict(ckpt["model"])
            loss = validate(model, valid, cfg.train, Place(Dist(), torch.device("cpu"), "fp32"))
            tuning, val_hyps = tune_alpha(tr, ValidationSet(ev["val_src"], ev["val_tok"], tgt), args.alphas, 4)
            val = {a: r["valid_multi30k_bleu"] for a, r in tuning.items()}
            alpha = choose_alpha(val_hyps, ev["val_tok"], tgt, args.p_level)[0]
            tr.cfg = DecodeConfig(beam_size=4, alpha=alpha)
            hyps = tr.translate(ev["test_src"])
            rec = {"k": k, "every": every, "checkpoints": [p.name for p in last], "valid_loss": round(loss["valid_loss"], 4),
                   "valid_nll": round(loss["valid_nll"], 4), "valid_bleu_by_alpha": val, "alpha": alpha,
                   "valid_multi30k_bleu": val[alpha],
                   "test_multi30k_bleu": round(multi30k_bleu(hyps, ev["test_tok"], tgt).score, 2),
                   "test_sacrebleu": round(sacre_bleu(hyps, ev["test_raw"]).score, 2)}
            recs.append(rec)
            rows.append([demo_dir, str(k), str(every), last[0].name, f"{rec['valid_loss']:.4f}", " / ".join(f"{v:.2f}" for v in val.values()),
                         f"{alpha}", f"{rec['test_multi30k_bleu']:.2f}", f"{rec['test_sacrebleu']:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    bl.print_table(["run", "k", "every", "oldest", "val loss", f"val BLEU at α {args.alphas}", "α (val)", "test BLEU", "test sacreBLEU"],
                   rows)
    bl.write_result(f"average_sweep_{src}-{tgt}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
