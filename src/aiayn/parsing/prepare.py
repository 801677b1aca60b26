"""``aiayn parse prepare``: treebank -> split text files and a training data directory (§6.3).

Splits are by WSJ file, so no document is shared between them. The full WSJ setting of the
paper (train 02-21, dev 22, test 23) needs the LDC treebank; the NLTK sample holds sections 00
and 01 only (wsj_0001-wsj_0199), which we split as:

    train  wsj_0001-wsj_0159      dev  wsj_0160-wsj_0179      test  wsj_0180-wsj_0199

Written to ``OUT`` for each split (one sentence per line, aligned):

    {split}.words    the words, space-separated (the model's source)
    {split}.linear   the linearized tree (the model's target; ``aiayn.parsing.linearize``)
    {split}.gold     the bracketed tree (the scorer's gold file)

and ``OUT/data``, a data directory (``aiayn.data.prepare``) from the words -> linearized pairs,
with dev as its ``valid`` split. Vocabulary: one shared BPE SentencePiece model of 4,000 pieces
with full character coverage (the train words have about 11K types, 2.2K of them occurring 5
or more times; 4K pieces keep frequent words whole and split rare ones; coverage 1.0 keeps rare
characters such as ``?`` out of ``<unk>``). Every token of the train linearizations (``XX`` and
each ``(LABEL`` / ``)LABEL``, 53 on the NLTK sample) is a SentencePiece user symbol, added to any
given in the options, so each is one piece: left to BPE, which does not merge across Unicode
script boundaries, a bracket token is two pieces (``▁(`` + ``NP``), and a target averages 99
pieces instead of 62 on the sample. A label seen only in dev or test (``WHADJP`` on the sample)
is spelled out in characters and still decodes exactly. The paper used a 16K vocabulary on 40K
WSJ sentences. No train pair is dropped for length or length ratio: trees are never misaligned,
and a linearization is about three times its sentence's length by construction.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Sequence

from aiayn.config import ConfigError, replace
from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
from aiayn.errors import UserError
from aiayn.parsing.linearize import linearize
from aiayn.parsing.ptb import TreebankTree, read_treebank

log = logging.getLogger(__name__)

# (split, first file number, last file number), inclusive
SPLITS: tuple[tuple[str, int, int], ...] = (("train", 1, 159), ("dev", 160, 179), ("test", 180, 199))
DATA_SPLIT_NAMES = {"train": "train", "dev": "valid", "test": "test"}
EXTENSIONS = ("words", "linear", "gold")
PARSE_DATA_DEFAULTS = replace(PrepareConfig(), vocab_size=4000, character_coverage=1.0,
                              max_len=0, max_len_ratio=0.0)
_FILE_ID = re.compile(r"^wsj_(\d{4})$")


def split_of(file_id: str) -> str | None:
    """The split a WSJ file belongs to (``SPLITS``), or None if outside all of them."""
    m = _FILE_ID.match(file_id)
    if not m:
        raise UserError(f"tree from {file_id!r}: splits need wsj_NNNN file names; pass the treebank zip "
                        "or a directory of .mrg files, not a concatenated file")
    number = int(m.group(1))
    for name, first, last in SPLITS:
        if first <= number <= last:
            return name
    return None


def assign_splits(trees: Sequence[TreebankTree]) -> dict[str, list[TreebankTree]]:
    out: dict[str, list[TreebankTree]] = {name: [] for name, _, _ in SPLITS}
    for t in trees:
        split = split_of(t.file_id)
        if split is not None:
            out[split].append(t)
    for name, trees_in in out.items():
        if not trees_in:
            raise UserError(f"split {name!r} is empty: the treebank has none of its files")
    return out


def write_split(trees: Sequence[TreebankTree], out: Path, split: str) -> dict[str, Path]:
    """Write ``{split}.words``, ``.linear``, ``.gold``; return their paths by extension."""
    paths = {ext: out / f"{split}.{ext}" for ext in EXTENSIONS}
    with open(paths["words"], "w", encoding="utf-8") as fw, \
            open(paths["linear"], "w", encoding="utf-8") as fl, \
            open(paths["gold"], "w", encoding="utf-8") as fg:
        for t in trees:
            fw.write(" ".join(t.tree.words()) + "\n")
            fl.write(" ".join(linearize(t.tree)) + "\n")
            fg.write(t.tree.to_bracketed() + "\n")
    return paths


def tree_symbols(trees: Sequence[TreebankTree]) -> tuple[str, ...]:
    """The distinct target tokens of ``trees`` (``XX``, ``(LABEL``, ``)LABEL``), sorted."""
    return tuple(sorted({tok for t in trees for tok in linearize(t.tree)}))


def with_tree_symbols(cfg: PrepareConfig, train: Sequence[TreebankTree]) -> PrepareConfig:
    """``cfg`` with every target token of the train trees added to its user symbols."""
    symbols = tuple(sorted(set(cfg.user_symbols) | set(tree_symbols(train))))
    try:
        return replace(cfg, user_symbols=symbols)
    except ConfigError as exc:
        raise UserError(f"{exc} (the train trees have {len(symbols)} distinct target tokens)") from exc


@dataclasses.dataclass(frozen=True)
class PreparedParsing:
    out: Path
    counts: dict[str, int]               # trees per split
    files: dict[str, dict[str, Path]]     # split -> extension -> path
    data_dir: Path | None


def prepare_parsing(treebank: Path, out: Path, data_cfg: PrepareConfig | None = PARSE_DATA_DEFAULTS,
                    force: bool = False) -> PreparedParsing:
    """Read ``treebank``, write the split files to ``out``, then (unless ``data_cfg`` is None)
    the data directory ``out/data``."""
    by_split = assign_splits(read_treebank(treebank))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files, counts = {}, {}
    for split, trees in by_split.items():
        files[split] = write_split(trees, out, split)
        counts[split] = len(trees)
        log.info("%s: %d trees from %s..%s", split, len(trees), trees[0].file_id, trees[-1].file_id)
    summary = {"treebank": str(Path(treebank).resolve()), "splits": [
        {"name": name, "files": f"wsj_{first:04d}-wsj_{last:04d}", "trees": counts[name]}
        for name, first, last in SPLITS]}
    (out / "splits.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    data_dir = None
    if data_cfg is not None:
        data_dir = out / "data"
        pairs = {DATA_SPLIT_NAMES[s]: SplitFiles(f["words"], f["linear"]) for s, f in files.items()}
        data_cfg = with_tree_symbols(data_cfg, by_split["train"])
        log.info("%d target tokens kept whole as SentencePiece user symbols", len(data_cfg.user_symbols))
        prepare(pairs, data_dir, data_cfg, force=force)
    return PreparedParsing(out, counts, files, data_dir)
