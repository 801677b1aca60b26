"""``aiayn score``: BLEU, chrF and TER of translations against references (§6.1)."""
from __future__ import annotations

import argparse
import dataclasses
import json

from aiayn.data.textio import check_line_counts, read_input, stdin_lines
from aiayn.errors import UserError
from aiayn.evaluate.bleu import bleu_tokens, score_all, target_language
from aiayn.evaluate.significance import AR_TRIALS, SAMPLES, compare_systems, format_p

TOKENIZE_HELP = ("sacreBLEU's tokenizer for its BLEU, as sacrebleu --tokenize: 13a, intl, char, none, zh, ja-mecab, "
                 "ko-mecab, flores101, flores200 (default: --lang's, else 13a); it is in the signature, and one whose "
                 "package is missing says which to install")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "score", help="BLEU / chrF / TER of translations against references",
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
    p.add_argument("--lang", default=None, help="target language: the Moses tokenizer's (default: the language the first "
                                                "--ref's suffix names, as ref.fr, else de); zh, ja and ko also choose "
                                                "sacreBLEU's tokenizer, as sacrebleu -l does, unless --tokenize")
    p.add_argument("--tokenize", metavar="NAME", help=TOKENIZE_HELP)
    p.add_argument("--ter", action="store_true", help="add sacreBLEU's TER (sacrebleu -m ter: case-insensitive, lower is "
                                                      "better) with its signature")
    p.add_argument("--compare", nargs="+", metavar="FILE", default=[],
                   help="other systems' translations of the same input: does --hyp's BLEU beat each by more than "
                        "chance? Koehn (2004)'s paired bootstrap on sacreBLEU --paired-bs's resampled sets (same seed "
                        "and --samples), but its one-sided p, not sacreBLEU's two-sided one; one reference "
                        "(docs/commands.md)")
    p.add_argument("--paired-ar", action="store_true",
                   help="with --compare: approximate randomization instead of the bootstrap, as sacrebleu --paired-ar "
                        "(same shuffles and two-sided p)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"resampled sets for --compare (default: {SAMPLES}), or shuffles with --paired-ar "
                        f"(default: {AR_TRIALS:,})")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def _compare(args: argparse.Namespace, hyps: list[str], refs: list[list[str]], tokens) -> list[dict]:
    """The paired test of ``--hyp`` against each ``--compare`` file."""
    if args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    if len(refs) != 1:
        raise UserError(f"--compare takes one reference file, not {len(refs)}")
    others = {}
    for path in args.compare:
        others[path] = read_input(path, "--compare")
        check_line_counts(path, len(others[path]), args.hyp or "<stdin>", len(hyps))
    return compare_systems(hyps, others, refs[0], tokens, args.samples, "ar" if args.paired_ar else "bs")


def _comparison_line(args: argparse.Namespace, c: dict, tokens: str) -> str:
    name = args.hyp or "stdin"
    if args.paired_ar:
        return (f"paired approximate randomization ({args.samples} trials, {tokens}, no smoothing): {name} "
                f"{c['hyp_bleu']:.2f} vs {c['system']} {c['bleu']:.2f}: difference {c['difference']:+.2f}, "
                f"two-sided p = {c['p_value']:.4f}")
    p = format_p(c["p_value"], args.samples)
    return (f"paired bootstrap ({args.samples} sets, {tokens}, no smoothing): "
            f"{name} {c['hyp_bleu']:.2f} {c['hyp_interval_95']} vs {c['system']} {c['bleu']:.2f} "
            f"{c['interval_95']}: difference {c['difference']:+.2f}, p {p if p.startswith('<') else '= ' + p}")


def run(args: argparse.Namespace) -> int:
    if args.paired_ar and not args.compare:
        raise UserError("--paired-ar tests --hyp against the --compare files: give --compare")
    if args.samples is None:
        args.samples = AR_TRIALS if args.paired_ar else SAMPLES
    lang = target_language(args.lang, args.ref[0])
    hyps = read_input(args.hyp, "--hyp") if args.hyp else list(stdin_lines())
    refs = [read_input(r, "--ref") for r in args.ref]
    for path, stream in zip(args.ref, refs):
        check_line_counts(path, len(stream), args.hyp or "<stdin>", len(hyps))
    results = score_all(hyps, refs, lang=lang, tokenized=args.tokenized, lowercase=args.lc,
                        tokenize=args.tokenize, with_ter=args.ter)
    tokens, token_name = bleu_tokens(args.tokenized, args.lc, lang, args.tokenize) if args.compare else (None, "")
    comparisons = _compare(args, hyps, refs, tokens) if args.compare else []
    if args.json:
        out = [dataclasses.asdict(r) for r in results]
        test = "paired_ar" if args.paired_ar else "paired_bootstrap"
        print(json.dumps({"scores": out, test: comparisons} if args.compare else out, indent=2))
        return 0
    for r in results:
        print(r.format())
    for c in comparisons:
        print(_comparison_line(args, c, token_name))
    return 0
