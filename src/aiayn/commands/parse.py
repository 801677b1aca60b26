"""``aiayn parse``: English constituency parsing (§6.3).

``aiayn parse --checkpoint F`` (or ``aiayn parse text --checkpoint F``) parses tokenized text, one
sentence a line, into one bracketed tree a line; the subcommands ``demo``, ``prepare``, ``train``,
``decode``, ``score`` and ``baseline`` make and measure a parser.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

from aiayn.commands.demo import add_demo_arguments, config_with_sets
from aiayn.config import add_arguments, doc_help, from_args, replace
from aiayn.data.prepare import PrepareConfig
from aiayn.data.textio import check_readable
from aiayn.decode.config import DecodeConfig, add_device_argument
from aiayn.errors import UserError
from aiayn.files import check_output_folder, check_output_path, refuse_input_as_output, write_text_output
from aiayn.model.config import PRESETS
from aiayn.parsing import demo as parse_demo
from aiayn.parsing.baseline import right_branching
from aiayn.parsing.decode import (PARSE_DECODE, ParseOptions, bracketed_lines, check_constrainable, parse_trees,
                                  parse_words, read_gold_trees)
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS, read_params
from aiayn.parsing.evalb_report import format_report, format_summary
from aiayn.parsing.linearize import DEFAULT_TAG, LINEARIZATIONS, SLOTS
from aiayn.parsing.prepare import PARSE_DATA_DEFAULTS, SPLIT_SCHEMES, SplitConfig, prepare_parsing

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "parse", help="constituency parsing (§6.3): parse text; demo, prepare, train, decode, score, baseline",
        description="English constituency parsing as translation (§6.3). Without a subcommand, parse "
                    "tokenized text (as `aiayn parse text`): `echo 'The cat sat .' | aiayn parse --checkpoint F`.",
        allow_abbrev=False)
    _add_text_arguments(p, required=False)
    p.set_defaults(func=run_text)
    sub = p.add_subparsers(dest="parse_command", metavar="PARSE_COMMAND")
    _register_text(sub)
    _register_prepare(sub)
    _register_train(sub)
    _register_decode(sub)
    _register_score(sub)
    _register_baseline(sub)
    _register_demo(sub)


def _register_demo(sub) -> None:
    p = sub.add_parser("demo", help="the NLTK WSJ sample end to end: prepare, train, average, parse, score",
                       description=doc_help(parse_demo.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    add_demo_arguments(p, parse_demo.ParseDemoConfig, "--set train.seed=2")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    parse_demo.run_parse_demo(config_with_sets(parse_demo.ParseDemoConfig, args))
    return 0


def _register_score(sub) -> None:
    p = sub.add_parser(
        "score", help="EVALB bracket scoring of a test file against a gold file",
        description="Score bracketed trees (one per line) the way EVALB does and print its summary "
                    "(recall, precision, F-measure, complete match, crossing, tagging accuracy; all "
                    "sentences and those within CUTOFF_LEN). Without --param the settings of "
                    "COLLINS.prm are used.",
        allow_abbrev=False)
    p.add_argument("--gold", type=Path, required=True, help="gold trees, one bracketing per line")
    p.add_argument("--test", type=Path, required=True, help="trees to score, line-aligned with --gold")
    p.add_argument("--param", type=Path, default=None, help="EVALB parameter file (default: COLLINS.prm settings)")
    p.add_argument("--sentences", action="store_true",
                   help="also print EVALB's per-sentence table (as DEBUG >= 1 in the parameter file does)")
    p.set_defaults(func=run_score)


def run_score(args: argparse.Namespace) -> int:
    from aiayn.data.textio import check_line_counts
    params = read_params(args.param) if args.param else COLLINS
    gold, test = read_lines(args.gold), read_lines(args.test)
    # EVALB only warns and scores the lines both have: a truncated prediction file would score as whole
    check_line_counts(args.gold, len(gold), args.test, len(test))
    if params.delete_labels and _preterminal_labels(test) == {DEFAULT_TAG} != _preterminal_labels(gold):
        log.warning("%s: every preterminal is %s, as `aiayn parse` writes them; EVALB deletes punctuation by its "
                    "tag (DELETE_LABEL), so a line with punctuation will not align with %s: `aiayn parse decode` "
                    "puts the gold tags on the leaves", args.test, DEFAULT_TAG, args.gold)
    result = evalb(gold, test, params, gold_name=str(args.gold), test_name=str(args.test))
    if args.sentences or params.debug >= 1:
        print(format_report(result), end="")
    else:
        print(format_summary(result), end="")
    return 0


_PRETERMINAL = re.compile(r"\(([^\s()]+)\s+[^\s()]+\s*\)")


def _preterminal_labels(lines: list[str]) -> set[str]:
    """The tags of the ``(TAG word)`` terminals in ``lines``."""
    return {m.group(1) for line in lines for m in _PRETERMINAL.finditer(line)}


SCHEME_VOCAB = {"wsj": 16000}  # §6.3: a 16K vocabulary for the WSJ-only setting


def _register_prepare(sub) -> None:
    schemes = "; ".join(f"{k}: train {v.train_files}, dev {v.dev_files}, test {v.test_files}"
                        for k, v in SPLIT_SCHEMES.items())
    p = sub.add_parser(
        "prepare", help="treebank -> split words/linearized/gold files and a data directory",
        description=f"Read a Penn Treebank in bracket format (a zip of wsj_NNNN.mrg files such as NLTK's sample, "
                    f"or a directory holding them at any depth, such as the LDC's parsed/mrg/wsj), strip empty "
                    f"elements, traces and function tags, split it by WSJ file number ({schemes}), write "
                    f"OUT/{{split}}.words, .linear, .gold, and build the data directory OUT/data from the "
                    f"words -> linearized pairs (dev as its valid split).",
        allow_abbrev=False)
    p.add_argument("--treebank", type=Path, required=True, help="treebank.zip or a directory of .mrg files")
    p.add_argument("--splits", choices=list(SPLIT_SCHEMES), default="sample",
                   help="named split of WSJ files (default: sample); --train-files etc. override its ranges; "
                        "wsj also sets the paper's 16K vocabulary (§6.3) unless --vocab-size is given")
    add_arguments(p, SplitConfig, defaults=_Unset())
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--linearization", choices=list(LINEARIZATIONS), default=SLOTS,
                   help="target form: slots = Vinyals et al.'s XX per word (default); words = the words themselves, "
                        "copied under constrained decoding (docs/parsing.md)")
    p.add_argument("--no-data", action="store_true", help="write the text files only, no data directory")
    p.add_argument("--overwrite", "--force", dest="force", action="store_true",
                   help="replace an earlier output at OUT, in one step once the new one is complete")
    add_arguments(p, PrepareConfig, defaults=replace(PARSE_DATA_DEFAULTS, num_workers=os.cpu_count() or 1))
    p.set_defaults(func=run_prepare, vocab_size=None)


def run_prepare(args: argparse.Namespace) -> int:
    if args.vocab_size is None:
        args.vocab_size = SCHEME_VOCAB.get(args.splits, PARSE_DATA_DEFAULTS.vocab_size)
    cfg = None if args.no_data else from_args(PrepareConfig, args)
    done = prepare_parsing(args.treebank, args.out, cfg, force=args.force, splits=_splits(args),
                           linearization=args.linearization)
    for split, n in done.counts.items():
        print(f"{split}: {n} trees -> {', '.join(str(p) for p in done.files[split].values())}")
    if done.data_dir is not None:
        print(f"wrote {done.data_dir}")
    return 0


class _Unset:
    """Defaults for the --*-files options: None, so the --splits scheme fills what is not given."""

    def __getattr__(self, name):
        return None


def _splits(args: argparse.Namespace) -> SplitConfig:
    given = {f: getattr(args, f) for f in ("train_files", "dev_files", "test_files") if getattr(args, f) is not None}
    return replace(SPLIT_SCHEMES[args.splits], **given)


def _register_baseline(sub) -> None:
    p = sub.add_parser(
        "baseline", help="right-branching trees over the words of a gold file",
        description="Write the right-branching tree (all constituents labeled S) over the words of "
                    "each gold tree; preterminals keep the gold tags so EVALB removes the same "
                    "punctuation. Score it with `aiayn parse score`.",
        allow_abbrev=False)
    p.add_argument("--gold", type=Path, required=True, help="gold trees, one bracketing per line")
    p.add_argument("--out", type=Path, required=True, help="file to write, one tree per line")
    p.set_defaults(func=run_baseline)


def run_baseline(args: argparse.Namespace) -> int:
    refuse_input_as_output(args.out, [args.gold])
    _, gold = read_gold_trees(args.gold)
    lines = [right_branching(g.words(), g.tags()).to_bracketed() for g in gold]
    write_text_output(args.out, "".join(line + "\n" for line in lines))
    print(f"wrote {len(lines)} right-branching trees to {args.out}")
    return 0


# A CPU-sized starting point for the NLTK sample (3.4K training trees, ~83 steps per epoch of
# 4096 target tokens), not a tuned recipe: the paper's parsing model is 4 x 1024 (preset
# "parsing") with dropout, learning rate and beam tuned on WSJ 22. "multi30k" is our small
# regularized model (3 x 256, pre-norm, P_drop 0.3); warmup and length are cut to the sample.
PARSE_TRAIN_PRESET = "multi30k"
PARSE_TRAIN_SETS = ("train.warmup_steps=1000", "train.max_steps=4000", "train.validate_every_steps=250")


def _register_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a parser on OUT/data of `aiayn parse prepare`",
        description=f"`aiayn train` with parsing defaults: preset {PARSE_TRAIN_PRESET} and "
                    f"{' '.join('--set ' + s for s in PARSE_TRAIN_SETS)} (your --set and --max-steps "
                    f"come after them). See `aiayn train --help` for every --set key.",
        allow_abbrev=False)
    p.add_argument("--data", type=Path, required=True, help="data directory (OUT/data of `aiayn parse prepare`)")
    p.add_argument("--out", type=Path, required=True, help="run directory; resumed if it holds last.pt")
    p.add_argument("--preset", default=PARSE_TRAIN_PRESET, choices=list(PRESETS),
                   help=f"model preset (default {PARSE_TRAIN_PRESET}; the paper's is 'parsing')")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a model or train field (repeatable)")
    p.add_argument("--max-steps", type=int, default=None, help="shortcut for --set train.max_steps=N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from aiayn.commands.train import resolve_run_config
    from aiayn.train.loop import train
    cfg = resolve_run_config(argparse.Namespace(recipe=None, preset=args.preset, max_steps=args.max_steps,
                                                set=args.set), defaults=PARSE_TRAIN_SETS)
    train(args.data, args.out, cfg, progress=not args.no_progress)
    return 0


def _register_decode(sub) -> None:
    p = sub.add_parser(
        "decode", help="parse the sentences of a gold file with a checkpoint and score",
        description="Parse the words of each gold tree with beam search (defaults are §6.3's: beam 21, "
                    "alpha 0.3, max length = input + 300), constrained to well-formed trees over the words "
                    "unless --constrained false, rebuild each tree over the words (gold POS tags on the "
                    "leaves; ill-formed outputs repaired and counted), write the trees to --out and print "
                    "EVALB's summary and the repair counts.",
        allow_abbrev=False)
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint written by `aiayn parse train`")
    p.add_argument("--gold", type=Path, required=True, help="gold trees, one per line (e.g. OUT/test.gold)")
    p.add_argument("--out", type=Path, required=True, help="file for the predicted trees, one per line")
    p.add_argument("--param", type=Path, default=None, help="EVALB parameter file (default: COLLINS.prm settings)")
    add_device_argument(p)
    add_arguments(p, DecodeConfig, defaults=PARSE_DECODE)
    add_arguments(p, ParseOptions)
    p.set_defaults(func=run_decode)


def _check_output(path: Path, option: str) -> None:
    """An output file's path, before the work: not a folder, its folder there and writable."""
    check_output_path(path, option)
    check_output_folder(path)


def run_decode(args: argparse.Namespace) -> int:
    from aiayn.decode.translator import Translator
    refuse_input_as_output(args.out, [args.checkpoint, args.gold, args.param])
    _check_output(Path(args.out), "--out")
    cfg = from_args(DecodeConfig, args)
    params = read_params(args.param) if args.param else COLLINS
    gold_lines, gold = read_gold_trees(args.gold)
    translator = Translator.from_checkpoint(args.checkpoint, cfg, device=args.device)
    trees, stats = parse_trees(translator, gold, from_args(ParseOptions, args), str(args.gold))
    text = bracketed_lines(trees)
    write_text_output(args.out, text)
    test_lines = text.split("\n")[:-1]
    result = evalb(gold_lines, test_lines, params, gold_name=str(args.gold), test_name=str(args.out))
    print(format_summary(result), end="")
    print(f"\n{stats.summary()}")
    return 0


def _add_text_arguments(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--checkpoint", type=Path, required=required, nargs="+",
                   help="checkpoint written by `aiayn parse train` (or `aiayn average`)")
    p.add_argument("--input", type=Path, default=None, help="tokenized sentences, one per line (default: stdin)")
    p.add_argument("--output", type=Path, default=None, help="file for the trees, one per line (default: stdout)")
    add_device_argument(p)
    add_arguments(p, DecodeConfig, defaults=PARSE_DECODE)
    add_arguments(p, ParseOptions)


def _register_text(sub) -> None:
    p = sub.add_parser(
        "text", help="parse tokenized sentences (one per line) into bracketed trees (one per line)",
        description="Parse tokenized text (PTB tokens, one sentence per line, from --input or stdin) and write "
                    "one bracketed tree per line (to --output or stdout), in input order. The leaves are the "
                    "input tokens, with ( and ) written -LRB- and -RRB- as in the treebank; preterminals are "
                    "labeled XX (the model predicts brackets, not POS tags). An empty line gives an empty line. "
                    "Decoding is §6.3's (beam 21, alpha 0.3, max length = input + 300), constrained to "
                    "well-formed trees unless --constrained false.",
        allow_abbrev=False)
    _add_text_arguments(p, required=True)
    p.set_defaults(func=run_text)


PTB_ESCAPES = {"(": "-LRB-", ")": "-RRB-"}


def ptb_escaped(word: str) -> str:
    """``word`` with each bracket spelled as the treebank spells a bracket token (``(`` -> ``-LRB-``,
    ``:-)`` -> ``:--RRB-``): a bracket inside a leaf would end the tree there."""
    for bracket, name in PTB_ESCAPES.items():
        word = word.replace(bracket, name)
    return word


def run_text(args: argparse.Namespace) -> int:
    import sys

    from aiayn.data.textio import input_chunks
    from aiayn.decode.translator import Translator
    from aiayn.parsing.linearize import RepairStats
    if args.checkpoint is None:
        raise UserError("give --checkpoint to parse text (aiayn parse --checkpoint F < sentences), "
                        "or a subcommand (aiayn parse --help)")
    refuse_input_as_output(args.output, [*args.checkpoint, args.input], "--output")
    if args.output:  # said before the work, and no empty file left by a command that failed to start
        _check_output(args.output, "--output")
    if args.input:
        check_readable(args.input, "--input", stream=True)
    cfg, options = from_args(DecodeConfig, args), from_args(ParseOptions, args)
    if options.constrained:
        check_constrainable(cfg)
    source, stats = str(args.input or "<stdin>"), RepairStats()
    out = sys.stdout
    try:
        with Translator.from_checkpoint(args.checkpoint, cfg, device=args.device) as translator:
            if args.output:  # (written as it goes, as stdout is: a pipe's reader sees each chunk)
                try:
                    out = open(args.output, "w", encoding="utf-8")
                except OSError as exc:
                    raise UserError(f"{args.output}: cannot write ({exc.strerror})") from None
            for first, lines in input_chunks(str(args.input) if args.input else None):
                sentences = [[ptb_escaped(w) for w in line.split()] for line in lines]
                for result in parse_words(translator, sentences, options=options, source=source, first_line=first):
                    if result is not None:
                        stats.add(result)
                    out.write((result.tree.to_bracketed() if result is not None else "") + "\n")
                out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    log.info("parsed %d sentences; %s", stats.sentences, stats.summary())
    return 0
