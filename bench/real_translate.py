"""Translation on real data: a trained model in aiayn and the same weights in CTranslate2.

    python bench/real_translate.py --checkpoint runs/demo/model.pt [--alpha 1.4] [--src-lang en]

The checkpoint is exported with ``aiayn export`` (aiayn/interop/ct2_export.py) into a temporary folder.
Every system translates all of Multi30k test_2016 (1,000 sentences) per call, from raw text
to raw text (SentencePiece encoding and decoding included), beam 4, maximum length |x| + 50:
  aiayn-fp32     Translator, DecodeConfig(beam 4, α, batches of 4,096 padded source tokens
                 sorted by length), as ``aiayn translate`` runs
  aiayn-bf16     the same with precision bf16 (weights cast to bfloat16)
  aiayn-int8     the same with precision int8 (int8 linear maps, aiayn/decode/int8.py)
  aiayn-int8bf16 the same with precision int8-bf16 (int8 linear maps, bfloat16 between them)
  ct2-fp32       ctranslate2.Translator on the exported model, translate_batch(beam_size=4,
                 max_batch_size=4096, batch_type="tokens", min_decoding_length=0, <pad>/<s>
                 suppressed); the source pieces + </s>, per-sentence maximum length |x| + 50
                 (CTranslate2's max_decoding_length is per call, so sentences are grouped by it)
  ct2-int8       the same with compute_type int8
Each system in its own process, interleaved, 2 threads. α: --alpha, else the ``alpha`` in
results.json beside the checkpoint (the demo's validation choice). CTranslate2 normalizes by
length^α instead of the GNMT ((5 + length) / 6)^α, so its outputs can differ; the table gives
every system's BLEU (Multi30k tokenized BLEU and sacreBLEU) beside its speed.
Writes results/real_translate_<src>-<tgt>.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

import benchlib as bl

log = logging.getLogger("bench.real")

CT2_OPTIONS = {"beam_size": 4, "max_batch_size": 4096, "batch_type": "tokens", "min_decoding_length": 0,
               "suppress_sequences": [["<pad>"], ["<s>"]]}


def _lines(path: Path) -> list[str]:
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def build_aiayn(checkpoint: str, precision: str, alpha: float, lines: list[str]):
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator

    tr = Translator.from_checkpoint(checkpoint, cfg=DecodeConfig(beam_size=4, alpha=alpha, precision=precision))

    def run() -> dict:
        return {"hyps": tr.translate(lines)}

    return run


def build_ct2(ct2_dir: str, compute_type: str, alpha: float, lines: list[str], threads: int):
    import ctranslate2
    import sentencepiece as spm

    tr = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type, inter_threads=1,
                                intra_threads=threads)
    sp_src = spm.SentencePieceProcessor(model_file=str(Path(ct2_dir) / "source.spm"))
    sp_tgt = spm.SentencePieceProcessor(model_file=str(Path(ct2_dir) / "target.spm"))

    def run() -> dict:
        pieces = [sp_src.encode(x, out_type=str) + ["</s>"] if x.strip() else [] for x in lines]
        out = [""] * len(lines)
        by_limit: dict[int, list[int]] = {}
        for i, p in enumerate(pieces):
            if p:
                by_limit.setdefault(len(p) + 50, []).append(i)
        for limit, idx in by_limit.items():
            res = tr.translate_batch([pieces[i] for i in idx], length_penalty=alpha, max_decoding_length=limit,
                                     **CT2_OPTIONS)
            for i, r in zip(idx, res):
                out[i] = sp_tgt.decode(r.hypotheses[0])
        return {"hyps": out}

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--alpha", type=float, default=None)
    ap.add_argument("--src-lang", default="en", choices=["en", "de"])
    ap.add_argument("--data-root", default="", help="folder holding multi30k/ (default: as aiayn demo finds it)")
    ap.add_argument("--lines", type=int, default=0, help="only the first N test sentences (0 = all; for smoke runs)")
    bl.add_common_args(ap)
    args = ap.parse_args(argv)
    bl.fill_defaults(args, {"reps": 3, "warmup": 1, "min_reps": 2, "budget_s": 120.0})
    bl.setup_logging()
    src, tgt = args.src_lang, "de" if args.src_lang == "en" else "en"
    ckpt = Path(args.checkpoint)
    alpha = args.alpha
    if alpha is None:
        alpha = float(json.loads((ckpt.parent / "results.json").read_text())["alpha"])
    from aiayn.data.multi30k import default_data_root

    root = Path(args.data_root or default_data_root()) / "multi30k"
    n = args.lines or None
    lines = _lines(root / "raw" / f"test_2016_flickr.{src}.gz")[:n]
    ref_raw = _lines(root / "raw" / f"test_2016_flickr.{tgt}.gz")[:n]
    ref_tok = _lines(root / "tok" / f"test_2016_flickr.lc.norm.tok.{tgt}.gz")[:n]
    machine = bl.machine_info(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench_real_ct2_")
    try:
        from aiayn.cli import main as aiayn_main

        ct2_dir = str(Path(workdir) / "ct2")
        if aiayn_main(["export", "--checkpoint", str(ckpt), "--out", ct2_dir]) != 0:
            raise SystemExit("export failed")
        systems = [bl.System(f"aiayn-{p.replace('-', '')}", build_aiayn, {"checkpoint": str(ckpt), "precision": p, "alpha": alpha,
                                                         "lines": lines}, **bl.AIAYN_PROCESS)
                   for p in ("fp32", "bf16", "int8", "int8-bf16")]
        systems += [bl.System(f"ct2-{name}", build_ct2, {"ct2_dir": ct2_dir, "compute_type": ct, "alpha": alpha,
                                                         "lines": lines, "threads": args.threads})
                    for name, ct in (("fp32", "float32"), ("int8", "int8"))]
        systems = bl.pick(systems, args.systems)
        res = bl.measure_interleaved(systems, threads=args.threads, warmup=args.warmup, reps=args.reps,
                                     min_reps=args.min_reps, budget_s=args.budget_s, timeout_s=args.timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, ckpt, alpha, src, tgt, machine, res, ref_raw, ref_tok)
    return 0


def report(args, ckpt: Path, alpha: float, src: str, tgt: str, machine: dict, res: dict,
           ref_raw: list[str], ref_tok: list[str]) -> None:
    from aiayn.evaluate.bleu import sacre_bleu
    from aiayn.evaluate.multi30k import multi30k_bleu

    rows = []
    for name, r in res.items():
        hyps = r.get("info", {}).pop("hyps", None)
        if "time" not in r or hyps is None:
            rows.append([name, "FAILED", "-", "-", "-", "-"])
            continue
        med = r["time"]["median"]
        r["sentences_per_s"] = len(ref_raw) / med
        r["multi30k_bleu"] = round(multi30k_bleu(hyps, ref_tok, tgt).score, 2)
        r["sacrebleu"] = round(sacre_bleu(hyps, ref_raw).score, 2)
        rows.append([name, f"{r['sentences_per_s']:.1f}", f"{med:.2f}", str(r["time"]["n"]),
                     f"{r['multi30k_bleu']:.2f}", f"{r['sacrebleu']:.2f}"])
    ratios = {}
    for a, b in (("aiayn-fp32", "ct2-fp32"), ("aiayn-bf16", "ct2-fp32"), ("aiayn-bf16", "ct2-int8"),
                 ("aiayn-int8", "ct2-fp32"), ("aiayn-int8", "ct2-int8"), ("aiayn-int8", "aiayn-fp32"),
                 ("aiayn-int8bf16", "ct2-int8"), ("aiayn-int8bf16", "aiayn-fp32")):
        ratios[f"{a}/{b}"] = bl.ratio(res.get(a, {}).get("sentences_per_s"), res.get(b, {}).get("sentences_per_s"))
    print(f"\nMulti30k test_2016 {src}->{tgt}, {ckpt}, beam 4, alpha {alpha}, {args.threads} threads")
    bl.print_table(["system", "sentences/s", "call s (median)", "n", "Multi30k BLEU", "sacreBLEU"], rows)
    for k, v in ratios.items():
        print(f"{k}: {bl.fmt(v, '.2f')}x")
    bl.write_result(args.name or f"real_translate_{src}-{tgt}",
                    {"machine": machine, "checkpoint": str(ckpt), "alpha": alpha, "ct2_options": CT2_OPTIONS,
                     "systems": res, "ratios": ratios})


if __name__ == "__main__":
    raise SystemExit(main())
