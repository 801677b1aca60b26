"""``aiayn score``: BLEU and chrF of translations against references (§6.1)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from aiayn.errors import UserError
from aiayn.evaluate.bleu import score_all


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file without their newlines; a missing file is a UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "score", help="BLEU / chrF of translations against references",
        description="Score translations. Detokenized text (default): sacreBLEU with its signature, "
                    "chrF2, and the paper's tokenized BLEU with compound splitting (Moses tokenizer + "
                    "##AT## splitting, as tensor2tensor's get_ende_bleu.sh). --tokenized: text that is "
                    "already tokenized (e.g. lowercased Moses-tokenized Multi30k) is scored as "
                    "multi-bleu.perl / fairseq-score do.")
    p.add_argument("--ref", nargs="+", required=True, metavar="FILE", help="reference file(s), one sentence per line")
    p.add_argument("--hyp", metavar="FILE", help="translations, one per line (default: stdin)")
    p.add_argument("--tokenized", action="store_true", help="inputs are already tokenized: score whitespace tokens")
    p.add_argument("--lc", action="store_true", help="case-insensitive BLEU: with --tokenized, lowercase both sides (multi-bleu -lc); "
                                               "otherwise add sacreBLEU -lc after cased sacreBLEU")
    p.add_argument("--lang", default="de", help="target language for the Moses tokenizer (default: de)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hyps = read_lines(args.hyp) if args.hyp else sys.stdin.read().splitlines()
    refs = [read_lines(r) for r in args.ref]
    for path, stream in zip(args.ref, refs):
        if len(stream) != len(hyps):
            raise UserError(f"{path}: {len(stream)} lines but {args.hyp or 'stdin'} has {len(hyps)}")
    results = score_all(hyps, refs, lang=args.lang, tokenized=args.tokenized, lowercase=args.lc)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(r.format())
    return 0
