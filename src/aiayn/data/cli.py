"""``aiayn prepare``: build a data directory from raw parallel text (see ``aiayn.data.prepare``);
``aiayn data multi30k``: fetch Multi30k's files (see ``aiayn.data.multi30k``); ``aiayn data wmt14``:
the WMT14 archives of a pair (see ``aiayn.data.wmt14``)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from aiayn.config import ConfigError, add_arguments, from_args, replace
from aiayn.data.corpora import CORPUS_SPEC, Corpus, parse_corpus
from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare, tokenizers_from_checkpoint
from aiayn.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenize and binarize a parallel corpus into a data directory",
        description="Train a SentencePiece model (ids pad=0 unk=1 bos=2 eos=3) on the train split, "
                    "encode every split into memory-mappable arrays, clean train, and write a "
                    "manifest. Inputs: UTF-8, one sentence per line, aligned, plain or .gz. "
                    "Nothing is left at --out unless the whole run succeeds.")
    for split in ("train", "valid", "test"):
        for side, lang in (("src", "source"), ("tgt", "target")):
            p.add_argument(f"--{split}-{side}", type=Path, default=None,
                           help=f"{split} {lang} text file (give --{split}-src and --{split}-tgt together" +
                                ("; or --corpus, or both: this one is then the corpus called train, weight 1)"
                                 if split == "train" else ")"))
    p.add_argument("--corpus", action="append", default=[], metavar=CORPUS_SPEC,
                   help="a train corpus (repeatable; the corpora form one train split, one vocabulary sampled "
                        "over all in proportion to their sizes): source and target files; WEIGHT (default 1) "
                        "draws it that many times an epoch in training (0.5: a new random half each epoch); TAG "
                        "(e.g. <bt>) starts each of its source sentences; LANG (e.g. de) puts <2LANG> after the "
                        "tag; an empty field is its default. Example: --corpus bt=mono.en,mono.de,0.5,<bt>")
    p.add_argument("--out", type=Path, required=True, help="data directory to create")
    p.add_argument("--tokenizer-from", type=Path, default=None, metavar="MODEL.pt",
                   help="encode with the SentencePiece model(s) stored in this checkpoint instead of training new "
                        "ones (fine-tuning: `aiayn train --init-from MODEL.pt` then accepts the data directory)")
    p.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                   help="replace --out if it is an existing data directory, in one step once the new one is "
                        "complete (an empty folder needs no flag; anything else is never replaced)")
    add_arguments(p, PrepareConfig, defaults=replace(PrepareConfig(), num_workers=os.cpu_count() or 1))
    p.set_defaults(func=run)

    d = subparsers.add_parser(
        "data", help="download a data set's files (checked against pinned SHA-256 sums, resumable)",
        description="Download a data set into a folder that --data-root then takes. Each file is checked "
                    "against its pinned SHA-256 (an MD5 where that is all that is published, said so) before "
                    "it gets its name; an interrupted download resumes "
                    "on the next run; files already there are kept.")
    which = d.add_subparsers(dest="dataset", metavar="DATASET")
    which.required = True
    m = which.add_parser("multi30k", help="Multi30k task 1 (raw and tokenized train, val, test_2016_flickr; en, de) "
                                          "from github.com/multi30k/dataset, or $AIAYN_DATA_URL")
    m.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="data root to fill (DIR/multi30k/raw, DIR/multi30k/tok); default: the cache, $AIAYN_CACHE "
                        "or ~/.cache/aiayn, where `aiayn demo` looks")
    m.set_defaults(func=run_data)
    w = which.add_parser("wmt14", help="the WMT14 archives of a pair (training corpora, newstest2013, newstest2014) "
                                       "from statmt.org, or $AIAYN_WMT14_URL")
    w.add_argument("--pair", choices=("en-de", "en-fr"), default="en-de",
                   help="en-de: Europarl v7, Common Crawl, News Commentary v9 (1.7 GB); en-fr: those and the UN and "
                        "10^9 corpora (6.6 GB); both with dev.tgz and test-full.tgz (default: en-de)")
    w.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="folder to fill (DIR/wmt14/); default: the cache, $AIAYN_CACHE or ~/.cache/aiayn")
    w.add_argument("--base-url", default=None, metavar="URL",
                   help="a mirror holding statmt.org's paths (default: $AIAYN_WMT14_URL, else https://www.statmt.org/)")
    w.add_argument("--unpack", action="store_true",
                   help="also extract the files scripts/wmt14.sh reads into DIR/wmt14 (where its --raw DIR finds them)")
    w.set_defaults(func=run_wmt14)


def run_data(args: argparse.Namespace) -> int:
    from aiayn.data.multi30k import cache_root, download_multi30k
    root = download_multi30k(args.out if args.out is not None else cache_root())
    print(f"multi30k: {root / 'multi30k'} (--data-root {root})")
    return 0


def run_wmt14(args: argparse.Namespace) -> int:
    from aiayn.data.multi30k import cache_root
    from aiayn.data.wmt14 import download_wmt14, unpack
    root = args.out if args.out is not None else cache_root()
    paths = download_wmt14(root, args.pair, base_url=args.base_url)
    print(f"wmt14 {args.pair}: {len(paths)} archives in {root / 'wmt14'}")
    if args.unpack:
        print(f"wmt14 {args.pair}: unpacked in {unpack(root, args.pair)} (scripts/wmt14.sh --raw {root})")
    return 0


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
    try:
        cfg = from_args(PrepareConfig, args)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    tokenizers = None
    if args.tokenizer_from is not None:
        from aiayn.checkpoint import load_checkpoint
        tokenizers = tokenizers_from_checkpoint(load_checkpoint(args.tokenizer_from), args.tokenizer_from, cfg)
    manifest = prepare(splits, args.out, cfg, force=args.overwrite, tokenizers=tokenizers, corpora=corpora)
    for name, entry in manifest["splits"].items():
        print(f"{name}: {entry['pairs']} pairs, {entry['src']['tokens']} source / "
              f"{entry['tgt']['tokens']} target tokens")
        for c in entry.get("corpora", []):
            marks = "".join(f", {k} {c[k]}" for k in ("tag", "lang") if c[k])
            print(f"  {c['name']}: {c['end'] - c['start']} pairs, weight {c['weight']:g}{marks}")
    print(f"wrote {args.out}")
    return 0
