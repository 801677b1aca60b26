"""NLTK's sample of the Penn Treebank (Marcus et al. 1993): the WSJ files wsj_0001-wsj_0199, about
3,900 trees, as ``treebank.zip``; what ``aiayn parse demo`` (§6.3) trains and scores on. Where it
is, and fetching it when it is nowhere here; ``aiayn data ptb-sample`` does only the fetch.

A data root holds it as ``ptb-wsj-nltk-sample/treebank.zip``. Looked up as Multi30k is
(``aiayn.data.multi30k``): ``--data-root``; ``$AIAYN_SHARED_DATA``; ``../shared/data`` beside the
checkout (or the current directory); the cache; and last, a download into the cache from the NLTK
data repository (nltk/nltk_data on GitHub; ``$AIAYN_NLTK_DATA_URL`` replaces its base URL, the
path below it stays the repository's), checked against the size and SHA-256 pinned below.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from aiayn.data.fetch import Pinned, fetch_all
from aiayn.data.multi30k import cache_root, local_roots
from aiayn.errors import UserError

BASE_URL = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/"
ENV = "AIAYN_NLTK_DATA_URL"
TERMS = ("NLTK's treebank sample (github.com/nltk/nltk_data, packages/corpora/treebank.xml) is a 10% "
         "fragment of the Penn Treebank, (C) LDC 1995, made available under fair use for illustrating NLTK's "
         "tools; it is for non-commercial use only")
# The repository's file as served (last changed in nltk_data commit 9373d81, 2016): 807 zip entries.
PINNED = Pinned("packages/corpora/treebank.zip", "ptb-wsj-nltk-sample/treebank.zip", 1740034,
                "9da92d76c3666cfb6cddeaed0f7e86b344cce0f0928a286d439e555f19c37399")
COMMAND = "aiayn data ptb-sample"


def download_ptb_sample(root: Path, *, base_url: str | None = None, quiet: bool = False) -> Path:
    """``root``/ptb-wsj-nltk-sample/treebank.zip, downloaded unless it is there, from ``base_url``,
    else $AIAYN_NLTK_DATA_URL, else the NLTK data repository; the terms of use are printed first."""
    base = base_url or os.environ.get(ENV) or BASE_URL
    dest = root / PINNED.local
    if not dest.is_file():
        print(f"Downloading NLTK's treebank sample into {dest.parent} from {base}\n{TERMS}.", file=sys.stderr,
              flush=True)
    return fetch_all(base, [PINNED], root, quiet=quiet, env=ENV)[0]


def find_ptb_sample(data_root: str | Path | None, *, quiet: bool = False) -> Path:
    """``treebank.zip`` under ``data_root`` when it is given (missing: an error naming the command
    that fetches it there); else under the first of ``local_roots()`` that holds it; else
    downloaded into the cache."""
    if data_root:
        path = Path(data_root) / PINNED.local
        if not path.is_file():
            raise UserError(f"{path}: no treebank there; `{COMMAND} --out {shlex.quote(str(data_root))}` downloads NLTK's sample "
                            f"there (without --data-root the demo downloads it itself, into the cache), "
                            f"or give --treebank")
        return path
    for root in local_roots():
        if (root / PINNED.local).is_file():
            return root / PINNED.local
    return download_ptb_sample(cache_root(), quiet=quiet)
