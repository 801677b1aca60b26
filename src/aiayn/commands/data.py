"""``aiayn data multi30k``: fetch Multi30k's files (``aiayn.data.multi30k``); ``aiayn data wmt14``:
the WMT14 archives of a pair (``aiayn.data.wmt14``); ``aiayn data ptb-sample``: NLTK's Penn
Treebank sample for ``aiayn parse demo`` (``aiayn.data.ptb_sample``)."""
from __future__ import annotations

import argparse
from pathlib import Path


def _base_url(text: str) -> str:
    """``--base-url``: a mirror's URL or folder; an empty one (an unset variable, ``--base-url "$MIRROR"``)
    is refused rather than read as no mirror, which would fetch from the data set's own site."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give a mirror's URL or folder, or leave --base-url out")
    return text


def register(subparsers) -> None:
    d = subparsers.add_parser(
        "data", help="download a data set's files (checked against pinned SHA-256 sums, resumable)",
        description="Download a data set into a folder that --data-root then takes. Each file is checked "
                    "against its pinned SHA-256 (an MD5 where that is all that is published, said so) before "
                    "it gets its name; an interrupted download resumes "
                    "on the next run; files already there are kept.",
        allow_abbrev=False)
    which = d.add_subparsers(dest="dataset", metavar="DATASET")
    which.required = True
    m = which.add_parser("multi30k", help="Multi30k task 1 (raw and tokenized train, val, test_2016_flickr; en, de) "
                                          "from github.com/multi30k/dataset, or $AIAYN_DATA_URL",
                         allow_abbrev=False)
    m.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="data root to fill (DIR/multi30k/raw, DIR/multi30k/tok); default: the cache ($AIAYN_CACHE, "
                        "else $XDG_CACHE_HOME/aiayn or ~/.cache/aiayn), where `aiayn demo` looks")
    m.add_argument("--base-url", type=_base_url, default=None, metavar="URL",
                   help="a mirror holding the repository's paths data/task1/raw/... and data/task1/tok/..., a URL "
                        "or a local folder (default: $AIAYN_DATA_URL, else "
                        "https://raw.githubusercontent.com/multi30k/dataset/master/)")
    m.set_defaults(func=run_multi30k)
    w = which.add_parser("wmt14", help="the WMT14 archives of a pair (training corpora, newstest2013, newstest2014) "
                                       "from statmt.org, or $AIAYN_WMT14_URL",
                         allow_abbrev=False)
    w.add_argument("--pair", choices=("en-de", "en-fr"), default="en-de",
                   help="en-de: Europarl v7, Common Crawl, News Commentary v9 (1.7 GB); en-fr: those and the UN and "
                        "10^9 corpora (6.6 GB); both with dev.tgz and test-full.tgz (default: en-de)")
    w.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="folder to fill (DIR/wmt14/); default: the cache ($AIAYN_CACHE, else $XDG_CACHE_HOME/aiayn or "
                        "~/.cache/aiayn)")
    w.add_argument("--base-url", type=_base_url, default=None, metavar="URL",
                   help="a mirror holding statmt.org's paths, a URL or a local folder (default: $AIAYN_WMT14_URL, else "
                        "https://www.statmt.org/)")
    w.add_argument("--unpack", action="store_true",
                   help="also extract the files scripts/wmt14.sh reads into DIR/wmt14 (where its --raw DIR finds them)")
    w.set_defaults(func=run_wmt14)
    t = which.add_parser("ptb-sample", help="NLTK's Penn Treebank sample (treebank.zip: WSJ files 0001-0199), "
                                            "what `aiayn parse demo` trains on, from github.com/nltk/nltk_data",
                         allow_abbrev=False)
    t.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="data root to fill (DIR/ptb-wsj-nltk-sample/treebank.zip); default: the cache ($AIAYN_CACHE, "
                        "else $XDG_CACHE_HOME/aiayn or ~/.cache/aiayn), where `aiayn parse demo` looks")
    t.add_argument("--base-url", type=_base_url, default=None, metavar="URL",
                   help="a mirror holding the repository's path packages/corpora/treebank.zip, a URL or a local "
                        "folder (default: $AIAYN_NLTK_DATA_URL, else "
                        "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/)")
    t.set_defaults(func=run_ptb_sample)


def run_multi30k(args: argparse.Namespace) -> int:
    from aiayn.data.multi30k import cache_root, download_multi30k
    root = download_multi30k(args.out if args.out is not None else cache_root(), base_url=args.base_url)
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


def run_ptb_sample(args: argparse.Namespace) -> int:
    from aiayn.data.multi30k import cache_root
    from aiayn.data.ptb_sample import download_ptb_sample
    root = args.out if args.out is not None else cache_root()
    path = download_ptb_sample(root, base_url=args.base_url)
    print(f"ptb-sample: {path} (aiayn parse demo --data-root {root})")
    return 0
