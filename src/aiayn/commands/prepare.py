"""``aiayn prepare``: build a data directory from raw parallel text (``aiayn.data.prepare``)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from aiayn.config import ConfigError, add_arguments, from_args, replace
from aiayn.data.corpora import CORPUS_SPEC, Corpus, parse_corpus
from aiayn.data.prepare import TOKENIZER_FIELDS, PrepareConfig, SplitFiles, prepare, tokenizers_from_checkpoint
from aiayn.errors import UserError

NOT_GIVEN = object()  # the parsed value of a tokenizer option left off the command line (its default applies)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenize and binarize a parallel corpus into a data directory",
        description="Train a SentencePiece model (ids pad=0 unk=1 bos=2 eos=3) on the train split, "
                    "encode every split into memory-mappable arrays, clean train, and write a "
                    "manifest. Inputs: UTF-8, one sentence per line, aligned, plain or .gz. "
                    "Nothing is left at --out unless the whole run succeeds.",
        allow_abbrev=False)
    for split in ("train", "valid", "test"):
        for side, lang in (("src", "source"), ("tgt", "target")):
            p.add_argument(f"--{split}-{side}", type=Path, default=None,
                           help=f"{split} {lang} text file (give --{split}-src and --{split}-tgt together" +
                                ("; or --corpus, or both: this one is then the corpus called train, weight 1)"
                                 if split == "train" else ")"))
    p.add_argument("--corpus", action="append", default=[], metavar=CORPUS_SPEC,
                   help="a train corpus (repeatable; all form one train split and vocabulary): WEIGHT draws per "
                        "epoch (0.5: a random half), TAG starts its sources, LANG adds <2LANG> (docs/data.md); "
                        "e.g. bt=mono.en,mono.de,0.5,<bt>")
    p.add_argument("--out", type=Path, required=True, help="data directory to create")
    p.add_argument("--tokenizer-from", type=Path, default=None, metavar="MODEL.pt",
                   help="encode with the SentencePiece model(s) stored in this checkpoint instead of training new "
                        "ones (fine-tuning: `aiayn train --init-from MODEL.pt` then accepts the data directory)")
    p.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                   help="replace --out if it is an existing data directory, in one step once the new one is "
                        "complete (an empty folder needs no flag; anything else is never replaced)")
    add_arguments(p, PrepareConfig, defaults=replace(PrepareConfig(), num_workers=os.cpu_count() or 1))
    p.set_defaults(func=run, **dict.fromkeys(TOKENIZER_FIELDS, NOT_GIVEN))  # the help still shows the defaults


def run(args: argparse.Namespace) -> int:
    splits = {}
    for split in ("train", "valid", "test"):
        src, tgt = getattr(args, f"{split}_src"), getattr(args, f"{split}_tgt")
        if (src is None) != (tgt is None):
            raise UserError(f"--{split}-src and --{split}-tgt must be given together")
        if src is not None:
            splits[split] = SplitFiles(src, tgt)
    corpora = [parse_corpus(spec) for spec in args.corpus]
    if corpora and "train" in splits:
        train = splits.pop("train")
        corpora.insert(0, Corpus("train", train.src, train.tgt))
    if "train" not in splits and not corpora:
        raise UserError("give the train split: --train-src and --train-tgt, or --corpus (repeatable)")
    given = {f: getattr(args, f) for f in TOKENIZER_FIELDS if getattr(args, f) is not NOT_GIVEN}
    default = PrepareConfig()
    for f in TOKENIZER_FIELDS:
        if f not in given:
            setattr(args, f, getattr(default, f))
    try:
        cfg = from_args(PrepareConfig, args)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    tokenizers = None
    if args.tokenizer_from is not None:
        from aiayn.checkpoint import load_checkpoint
        tokenizers = tokenizers_from_checkpoint(load_checkpoint(args.tokenizer_from), args.tokenizer_from, given)
    manifest = prepare(splits, args.out, cfg, force=args.overwrite, tokenizers=tokenizers, corpora=corpora)
    for name, entry in manifest["splits"].items():
        print(f"{name}: {entry['pairs']} pairs, {entry['src']['tokens']} source / "
              f"{entry['tgt']['tokens']} target tokens")
        for c in entry.get("corpora", []):
            marks = "".join(f", {k} {c[k]}" for k in ("tag", "lang") if c[k])
            print(f"  {c['name']}: {c['end'] - c['start']} pairs, weight {c['weight']:g}{marks}")
    print(f"wrote {args.out}")
    return 0
