"""``aiayn evaluate``: translate a test set with a checkpoint and score it with both metrics.

For WMT14 (§6.1, Table 2): ``aiayn evaluate --checkpoint avg.pt --src newstest2014-deen.en.gz
--ref newstest2014-deen.de.gz`` decodes with the paper's settings (beam 4, α 0.6, +50) and
prints sacreBLEU (with its signature), chrF2 and the paper's tokenized BLEU with compound
splitting, each labelled. ``--tok-ref`` adds the Multi30k lowercased tokenized BLEU, ``--ter``
sacreBLEU's TER; ``--tokenize`` chooses sacreBLEU's tokenizer, as in ``aiayn score``.
``--testset wmt14 [--langpair en-de]`` takes the source and reference through sacreBLEU's own
test-set downloader instead of --src and --ref (``aiayn.evaluate.testsets``).
"""
from __future__ import annotations

import argparse
import json
import time

from aiayn.config import add_arguments, doc_help
from aiayn.commands.decode_settings import decode_config
from aiayn.commands.score import TOKENIZE_HELP
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig, add_device_argument
from aiayn.errors import UserError
from aiayn.files import check_output_folder, refuse_input_as_output, write_text_output
from aiayn.progress import progress_bar


def _inputs(args) -> tuple[list[str], list[str], str]:
    """Source and reference lines, from --src and --ref or from --testset; and the source's name."""
    from aiayn.data.textio import check_line_counts, read_input
    if args.testset:
        if args.src or args.ref:
            raise UserError("--testset gives the source and the reference: leave out --src and --ref")
        from aiayn.evaluate.testsets import fetch_testset
        src, ref, name = fetch_testset(args.testset, args.langpair)
        return src, ref, f"{name}:{args.langpair}"
    if not (args.src and args.ref):
        raise UserError("give --src and --ref, or --testset (e.g. --testset wmt14 --langpair en-de)")
    src, ref = read_input(args.src, "evaluation input"), read_input(args.ref, "evaluation input")
    check_line_counts(args.src, len(src), args.ref, len(ref))
    return src, ref, args.src


def run(args) -> int:
    from aiayn.data.textio import check_line_counts, read_input
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.bleu import sacre_metric, score_all, target_language
    from aiayn.evaluate.multi30k import multi30k_bleu

    refuse_input_as_output(args.out, [*args.checkpoint, args.src, args.ref, args.tok_ref])
    src, ref, source = _inputs(args)
    lang = args.lang or (args.langpair.split("-")[-1] if args.testset else target_language(None, args.ref))
    sacre_metric(lang, args.tokenize)  # sacreBLEU's tokenizer (zh, ja, ko, --tokenize): a missing package said first
    if args.out:
        check_output_folder(args.out)  # written after the translations: said before them
    tok_ref = None
    if args.tok_ref:  # read before translating: a wrong file is said before the work
        tok_ref = read_input(args.tok_ref, "evaluation input")
        check_line_counts(args.tok_ref, len(tok_ref), source, len(src))
    decode_cfg = decode_config(args, args.checkpoint)  # the flags, else the model's own settings
    if decode_cfg.nbest > 1:
        raise UserError(f"--nbest {decode_cfg.nbest}: evaluate scores each sentence's best translation; "
                        f"for n-best lists, aiayn translate --nbest")
    with Translator.from_checkpoint(args.checkpoint, cfg=decode_cfg, device=args.device) as translator:
        t0 = time.perf_counter()  # the workers (decode.workers) start inside this call
        with progress_bar(len(src), unit=" lines", desc="evaluate") as bar:
            hyps = translator.translate(src, source=source, progress=bar.update)
        seconds = time.perf_counter() - t0
        lowercases = translator.tgt_tok is not None and translator.tgt_tok.lowercases  # lowercase output
    if args.out:
        write_text_output(args.out, "".join(h + "\n" for h in hyps))
    results = score_all(hyps, ref, lang, lowercase=lowercases,  # a lowercasing model: sacreBLEU -lc beside
                        tokenize=args.tokenize, with_ter=args.ter)
    if tok_ref is not None:
        results.append(multi30k_bleu(hyps, tok_ref, lang))
    if args.json:
        print(json.dumps({"seconds": seconds, "sentences": len(src),
                          "scores": [{"label": r.label, "score": r.score, "signature": r.signature} for r in results]},
                         indent=2))
    else:
        print(f"translated {len(src)} sentences in {seconds:.1f} s ({len(src) / max(seconds, 1e-9):.1f} sent/s)")
        for r in results:
            print(r.format())
    return 0


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="translate a test set and score it (sacreBLEU, chrF, the paper's BLEU)",
                       description=doc_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="FILE",
                   help="checkpoint (e.g. the average of the last 5); several (or an ensemble file from `aiayn "
                        "ensemble`) translate with their ensemble, as in aiayn translate")
    p.add_argument("--src", help="source sentences (plain or .gz)")
    p.add_argument("--ref", help="reference translations, raw text (plain or .gz)")
    p.add_argument("--testset", metavar="NAME",
                   help="instead of --src and --ref: a test set sacreBLEU fetches into its cache; wmt14 = "
                        "newstest2014 as the paper scores it, wmt13 = newstest2013, others sacreBLEU's (docs/data.md)")
    p.add_argument("--langpair", default="en-de", help="language pair of --testset (default en-de)")
    p.add_argument("--tok-ref", help="lowercased Moses-tokenized references (Multi30k tok/ files)")
    p.add_argument("--lang", default=None,
                   help="target language for the Moses tokenizer, and for zh, ja, ko sacreBLEU's (default: "
                        "--langpair's target with --testset, else the language --ref's suffix names, as ref.fr, else de), "
                        "unless --tokenize")
    p.add_argument("--tokenize", metavar="NAME", help=TOKENIZE_HELP)
    p.add_argument("--ter", action="store_true", help="add sacreBLEU's TER (case-insensitive, lower is better)")
    p.add_argument("--out", help="also write the translations here")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="JSON output")
    add_arguments(p, DecodeConfig, defaults=TRANSLATE_DECODE)
    p.set_defaults(func=run, **{name: None for name in CHECKPOINT_FIELDS})  # None: not given (``decode_config``)
