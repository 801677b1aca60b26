"""``aiayn parse prepare``: treebank -> split text files and a training data directory (§6.3).

Splits are by WSJ file number (``wsj_SSNN.mrg``: section SS, file NN), so no document is shared
between them (``SplitConfig``; ranges are options). Two schemes are named (``SPLIT_SCHEMES``):

    sample  train wsj_0001-0159        dev wsj_0160-0179   test wsj_0180-0199   (the NLTK sample,
            which holds sections 00 and 01 only)
    wsj     train wsj_0200-2199 (02-21) dev wsj_2200-2299 (22) test wsj_2300-2399 (23)  (the
            standard split of the full LDC treebank, the paper's WSJ-only setting)

Files outside every range are left out.

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

from aiayn.config import ConfigError, param, replace
from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
from aiayn.errors import UserError
from aiayn.data.store import MANIFEST, is_data_dir
from aiayn.files import LEFTOVER, OutputDir, refuse_inputs_inside, write_json_atomic
from aiayn.parsing.linearize import LINEARIZATIONS, SLOTS, WORD, linearize
from aiayn.parsing.ptb import TreebankTree, read_treebank

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "dev", "test")
DATA_SPLIT_NAMES = {"train": "train", "dev": "valid", "test": "test"}
EXTENSIONS = ("words", "linear", "gold")
PARSE_DATA_DEFAULTS = replace(PrepareConfig(), vocab_size=4000, character_coverage=1.0,
                              max_len=0, max_len_ratio=0.0)
_FILE_ID = re.compile(r"^wsj_(\d{4})$")


def parse_ranges(spec: str) -> tuple[tuple[int, int], ...]:
    """``"0200-2199,2400"`` -> ((200, 2199), (2400, 2400)): inclusive WSJ file-number ranges."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?", part)
        if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise ConfigError(f"bad file range {part.strip()!r} in {spec!r}: want NNNN or NNNN-NNNN (first <= last), "
                              "comma-separated")
        out.append((int(m.group(1)), int(m.group(2) or m.group(1))))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Which WSJ files (by number NNNN of wsj_NNNN.mrg) make each split; the sample's by default."""

    train_files: str = param("0001-0159", "train split: WSJ file numbers, ranges NNNN-NNNN, comma-separated "
                                          "(sections 02-21 of the full treebank: 0200-2199)")
    dev_files: str = param("0160-0179", "dev split, as train_files (section 22: 2200-2299)")
    test_files: str = param("0180-0199", "test split, as train_files (section 23: 2300-2399)")

    def __post_init__(self) -> None:
        ranges = []
        for name in SPLIT_NAMES:
            try:
                ranges += [(r, name) for r in parse_ranges(self.files(name))]
            except ConfigError as exc:
                raise ConfigError(f"--{name}-files: {exc}") from None
        for i, ((a, b), x) in enumerate(ranges):
            for (c, d), y in ranges[i + 1:]:
                if a <= d and c <= b:
                    raise ConfigError(f"{x} and {y} share WSJ files ({a:04d}-{b:04d} and {c:04d}-{d:04d})")

    def files(self, split: str) -> str:
        return getattr(self, f"{split}_files")

    def split_of(self, number: int) -> str | None:
        for name in SPLIT_NAMES:
            if any(a <= number <= b for a, b in parse_ranges(self.files(name))):
                return name
        return None


SPLIT_SCHEMES = {"sample": SplitConfig(), "wsj": SplitConfig("0200-2199", "2200-2299", "2300-2399")}


def split_of(file_id: str, splits: SplitConfig = SplitConfig()) -> str | None:
    """The split a WSJ file belongs to, or None if outside all of them."""
    m = _FILE_ID.match(file_id)
    if not m:
        raise UserError(f"tree from {file_id!r}: splits need wsj_NNNN file names; pass the treebank zip "
                        "or a directory of .mrg files, not a concatenated file")
    return splits.split_of(int(m.group(1)))


def assign_splits(trees: Sequence[TreebankTree], splits: SplitConfig = SplitConfig()
                  ) -> dict[str, list[TreebankTree]]:
    out: dict[str, list[TreebankTree]] = {name: [] for name in SPLIT_NAMES}
    for t in trees:
        split = split_of(t.file_id, splits)
        if split is not None:
            out[split].append(t)
    for name, trees_in in out.items():
        if not trees_in:
            raise UserError(f"split {name!r} is empty: the treebank has none of its files "
                            f"(wsj_{splits.files(name)}; see --splits and --{name}-files)")
    return out


def write_split(trees: Sequence[TreebankTree], out: Path, split: str, linearization: str = SLOTS) -> dict[str, Path]:
    """Write ``{split}.words``, ``.linear``, ``.gold``; return their paths by extension."""
    paths = {ext: out / f"{split}.{ext}" for ext in EXTENSIONS}
    with open(paths["words"], "w", encoding="utf-8") as fw, \
            open(paths["linear"], "w", encoding="utf-8") as fl, \
            open(paths["gold"], "w", encoding="utf-8") as fg:
        for t in trees:
            fw.write(" ".join(t.tree.words()) + "\n")
            fl.write(" ".join(linearize(t.tree, linearization)) + "\n")
            fg.write(t.tree.to_bracketed() + "\n")
    return paths


def tree_symbols(trees: Sequence[TreebankTree], linearization: str = SLOTS) -> tuple[str, ...]:
    """The distinct tree tokens of ``trees`` (``(LABEL``, ``)LABEL``; ``XX`` for ``slots``), sorted."""
    return tuple(sorted({tok for t in trees for tok in linearize(t.tree, SLOTS)
                         if tok != WORD or linearization == SLOTS}))


def with_tree_symbols(cfg: PrepareConfig, train: Sequence[TreebankTree], linearization: str = SLOTS) -> PrepareConfig:
    """``cfg`` with every tree token of the train trees added to its user symbols."""
    symbols = tuple(sorted(set(cfg.user_symbols) | set(tree_symbols(train, linearization))))
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


def is_prepared_treebank(path: Path) -> bool:
    """Whether ``path`` holds an output of ``prepare_parsing`` and nothing else (its splits.json, the
    split files, the data directory ``data``, aiayn's temporaries): what ``--overwrite`` may replace.
    A run trained into it, or any file of the user's, makes it not one, so nothing of theirs is deleted."""
    if not (path / "splits.json").is_file():
        return False
    split_file = re.compile(rf"[^/]+\.(?:{'|'.join(EXTENSIONS)})")
    return all(p.name == "splits.json" and p.is_file() or p.name == "data" and p.is_dir() and is_data_dir(p)
               or split_file.fullmatch(p.name) and p.is_file() or LEFTOVER.match(p.name) for p in path.iterdir())


def prepare_parsing(treebank: Path, out: Path, data_cfg: PrepareConfig | None = PARSE_DATA_DEFAULTS,
                    force: bool = False, splits: SplitConfig = SplitConfig(),
                    linearization: str = SLOTS) -> PreparedParsing:
    """Read ``treebank``, write the split files to ``out`` (targets in ``linearization``, see
    ``aiayn.parsing.linearize``), then (unless ``data_cfg`` is None) the data directory ``out/data``.
    All of it is built beside ``out`` and put in place whole (``OutputDir``): an existing ``out``
    must be empty or, with ``force``, an earlier output of this function (it holds splits.json)."""
    if linearization not in LINEARIZATIONS:
        raise UserError(f"linearization must be one of {', '.join(LINEARIZATIONS)}, got {linearization!r}")
    refuse_inputs_inside(out, [treebank])
    dest = OutputDir(out, overwrite=force, ours=is_prepared_treebank, what="a prepared treebank")
    dest.check()
    by_split = assign_splits(read_treebank(treebank), splits)
    out = Path(out)
    files, counts = {}, {}
    with dest as tmp:
        for split, trees in by_split.items():
            files[split] = write_split(trees, tmp, split, linearization)
            counts[split] = len(trees)
            log.info("%s: %d trees from %s..%s", split, len(trees), trees[0].file_id, trees[-1].file_id)
        summary = {"treebank": str(Path(treebank).resolve()), "linearization": linearization, "splits": [
            {"name": name, "files": splits.files(name), "trees": counts[name]} for name in SPLIT_NAMES]}
        (tmp / "splits.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if data_cfg is not None:
            pairs = {DATA_SPLIT_NAMES[s]: SplitFiles(f["words"], f["linear"]) for s, f in files.items()}
            data_cfg = with_tree_symbols(data_cfg, by_split["train"], linearization)
            log.info("%d target tokens kept whole as SentencePiece user symbols", len(data_cfg.user_symbols))
            manifest = prepare(pairs, tmp / "data", data_cfg)
            # its inputs as they will be found: the split files once this folder is in place at ``out``
            here, there = str(tmp.resolve()), str(out.resolve())
            for entry in manifest["splits"].values():
                entry["inputs"] = {k: there + v[len(here):] if isinstance(v, str) and v.startswith(here) else v
                                   for k, v in entry["inputs"].items()}
            write_json_atomic(tmp / "data" / MANIFEST, manifest)
    files = {split: {ext: out / p.name for ext, p in f.items()} for split, f in files.items()}
    return PreparedParsing(out, counts, files, None if data_cfg is None else out / "data")
