"""``aiayn score``: BLEU and chrF of translations against references (§6.1)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from aiayn.data.textio import check_line_counts, decode_lines, read_input
from aiayn.errors import UserError
from aiayn.evaluate.bleu import sacre_metric, score_all
from aiayn.evaluate.significance import compare_systems, format_p


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "score", help="BLEU / chrF of translations against references",
        description="Score translations. Detokenized text (default): sacreBLEU with its signature, "
                    "chrF2, and the paper's tokenized BLEU with compound splitting (Moses tokenizer + "
                    "##AT## splitting, as tensor2tensor's get_ende_bleu.sh). --tokenized: text that is "
                    "already tokenized (e.g. lowercased Moses-tokenized Multi30k) is scored as "
                    "multi-bleu.perl / fairseq-score do.",
        allow_abbrev=False)
    p.add_argument("--ref", nargs="+", required=True, metavar="FILE", help="reference file(s), one sentence per line")
    p.add_argument("--hyp", metavar="FILE", help="translations, one per line (default: stdin)")
    p.add_argument("--tokenized", action="store_true", help="inputs are already tokenized: score whitespace tokens")
    p.add_argument("--lc", action="store_true", help="case-insensitive BLEU: with --tokenized, lowercase both sides (multi-bleu -lc); "
                                               "otherwise add sacreBLEU -lc after cased sacreBLEU")
    p.add_argument("--lang", default="de", help="target language: the Moses tokenizer's (default: de); zh, ja and ko "
                                                "also choose sacreBLEU's tokenizer, as sacrebleu -l does")
    p.add_argument("--compare", nargs="+", metavar="FILE", default=[],
                   help="other systems' translations of the same input: does --hyp's BLEU beat each by more than "
                        "chance? Koehn (2004)'s paired bootstrap on sacreBLEU --paired-bs's resampled sets (same seed "
                        "and --samples), but its one-sided p, not sacreBLEU's two-sided one; one reference "
                        "(docs/commands.md)")
    p.add_argument("--samples", type=int, default=1000, help="resampled sets for --compare (default: 1000)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hyps = read_input(args.hyp, "--hyp") if args.hyp else list(decode_lines(sys.stdin.buffer, "<stdin>"))
    refs = [read_input(r, "--ref") for r in args.ref]
    for path, stream in zip(args.ref, refs):
        check_line_counts(path, len(stream), args.hyp or "<stdin>", len(hyps))
    results = score_all(hyps, refs, lang=args.lang, tokenized=args.tokenized, lowercase=args.lc)
    comparisons = []
    if args.compare:
        if args.samples < 1:
            raise UserError(f"--samples must be >= 1, got {args.samples}")
        if len(refs) != 1:
            raise UserError(f"--compare takes one reference file, not {len(refs)}")
        others = {}
        for path in args.compare:
            others[path] = read_input(path, "--compare")
            check_line_counts(path, len(others[path]), args.hyp or "<stdin>", len(hyps))
        comparisons = compare_systems(hyps, others, refs[0], args.tokenized, args.lc, args.samples, args.lang)
    if args.json:
        out = [dataclasses.asdict(r) for r in results]
        print(json.dumps({"scores": out, "paired_bootstrap": comparisons} if args.compare else out, indent=2))
        return 0
    for r in results:
        print(r.format())
    tokens = ("given" if args.tokenized else sacre_metric(args.lang).tokenizer.signature()) + " tokens" \
        + (", lowercased" if args.lc else "")
    for c in comparisons:
        p = format_p(c["p_value"], args.samples)
        print(f"paired bootstrap ({args.samples} sets, {tokens}, no smoothing): "
              f"{args.hyp or 'stdin'} {c['hyp_bleu']:.2f} {c['hyp_interval_95']} vs {c['system']} {c['bleu']:.2f} "
              f"{c['interval_95']}: difference {c['difference']:+.2f}, p {p if p.startswith('<') else '= ' + p}")
    return 0
