"""Reading the Penn Treebank WSJ ``.mrg`` files for the parsing experiment (§6.3).

Raw PTB trees carry annotation that WSJ parsing work removes before training and scoring
(as in Collins 1997 and every EVALB-scored parser since):

* the unlabeled outer bracket ``( (S ...) )`` is dropped (its only child becomes the root; the
  rare bracket with several children becomes a ``TOP`` node);
* empty elements (preterminals tagged ``-NONE-``: traces, null complementizers) are removed,
  and so is every constituent left with no words by that removal;
* phrase labels lose function tags and co-indices: ``NP-SBJ-1`` -> ``NP``, ``PP-LOC=2`` -> ``PP``.
  POS tags are kept as they are (``-LRB-``, ``-RRB-``, ``PRP$``); a phrase label that starts
  with ``-`` is kept whole.

Each tree remembers the file it came from (``wsj_0001``...), which the file-based splits use.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import zipfile
import zlib
from pathlib import Path

from aiayn.data.textio import decode_text, read_unpacked, text_mode
from aiayn.errors import InputError, UserError
from aiayn.files import UnpackBound
from aiayn.parsing.trees import BracketError, Tree, parse_bracketed

log = logging.getLogger(__name__)

EMPTY_TAG = "-NONE-"
TOP = "TOP"
_MRG_NAME = re.compile(r"(?:^|/)(wsj_\d{4})\.mrg$")


@dataclasses.dataclass(frozen=True)
class TreebankTree:
    """A normalized tree with its origin: ``file_id`` like ``wsj_0001``, ``index`` 0-based in that file."""

    file_id: str
    index: int
    tree: Tree


def strip_function_tags(label: str) -> str:
    """``NP-SBJ-1`` -> ``NP``, ``NP=2`` -> ``NP``; labels starting with ``-`` (``-NONE-``) unchanged."""
    if label.startswith("-"):
        return label
    return re.split(r"[-=]", label, maxsplit=1)[0]


def _clean(node: Tree) -> Tree | None:
    """``node`` without empty elements and function tags; None if nothing but empty elements."""
    if node.is_preterminal:
        return None if node.label == EMPTY_TAG else node
    children = tuple(c for c in (_clean(child) for child in node.children) if c is not None)
    if not children:
        return None
    return Tree(strip_function_tags(node.label), children)


def normalize(raw: Tree) -> Tree | None:
    """The tree WSJ parsers train on and EVALB scores (module docstring); None if it has no words."""
    root = raw
    if raw.label == "" and not raw.is_preterminal:
        root = raw.children[0] if len(raw.children) == 1 else Tree(TOP, raw.children)
    return _clean(root)


def read_mrg_text(text: str, file_id: str, path: str | Path) -> list[TreebankTree]:
    """Normalized trees of one ``.mrg`` text (``path`` is only used in error messages)."""
    try:
        raw_trees = parse_bracketed(text)
    except BracketError as exc:
        raise InputError(path, exc.line, str(exc)) from exc
    out = []
    for raw, line in raw_trees:
        tree = normalize(raw)
        if tree is None:
            raise InputError(path, line, "tree has no words once empty elements are removed")
        out.append(TreebankTree(file_id, len(out), tree))
    return out


def _read_zip(path: Path) -> list[TreebankTree]:
    """The trees of the ``wsj_NNNN.mrg`` members of the zip ``path``, each member read whole: all
    of them together no more than ``UnpackBound`` allows, checked before each is read."""
    trees: list[TreebankTree] = []
    bound = UnpackBound(path)
    where = str(path)
    try:
        with zipfile.ZipFile(path) as zf:
            members = sorted((i for i in zf.infolist() if _MRG_NAME.search(i.filename)), key=lambda i: i.filename)
            for info in members:
                bound.take(info.filename, info.file_size)
                where = f"{path}:{info.filename}"
                text = text_mode(decode_text(zf.read(info), where))
                trees += read_mrg_text(text, _MRG_NAME.search(info.filename).group(1), where)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # a damaged archive: its directory or a member
        raise UserError(f"{where}: a damaged zip ({exc})") from None
    if not trees:
        raise UserError(f"{path}: no wsj_NNNN.mrg files in this zip")
    return trees


def _read_text_file(path: Path) -> str:
    """The text of a ``.mrg`` file, plain or gzip (by content) as ``UnpackBound`` allows; invalid
    UTF-8 named by line, a BOM dropped, line ends as text mode reads them. Opened once, so a pipe
    (``<(zcat ...)``) will do."""
    bound = UnpackBound(path)
    data, gzipped = read_unpacked(path, bound.left + 1)
    if gzipped:
        bound.take(path.name.removesuffix(".gz"), len(data))
    return text_mode(decode_text(data, path))


def read_treebank(path: str | Path) -> list[TreebankTree]:
    """Trees from a zip of ``wsj_NNNN.mrg`` files (NLTK's ``treebank.zip``), a directory of them,
    or one ``.mrg`` / ``.mrg.gz`` file.

    Files are read in name order. A single file's trees get the file's name (without ``.mrg``,
    ``.gz``) as ``file_id``: a concatenation such as ``wsj_0001-0199.combined.mrg.gz`` holds
    no file boundaries, so per-file splits need the zip or the directory.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.mrg") if _MRG_NAME.search(p.as_posix()) and p.is_file())
        if not files:
            raise UserError(f"{path}: no wsj_NNNN.mrg files in this directory")
        trees: list[TreebankTree] = []
        for f in files:
            found = read_mrg_text(_read_text_file(f), f.stem, f)
            if not found:
                log.warning("%s: no trees in this file", f)
            trees += found
    elif path.is_file() and zipfile.is_zipfile(path):  # a pipe is not opened to look: it is read once
        trees = _read_zip(path)
    else:
        file_id = path.name.removesuffix(".gz").removesuffix(".mrg")
        trees = read_mrg_text(_read_text_file(path), file_id, path)
    log.info("%s: %d trees from %d file(s)", path, len(trees), len({t.file_id for t in trees}))
    return trees
