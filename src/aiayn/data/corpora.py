"""A train split made of several corpora: ``aiayn prepare --corpus`` and each epoch's draw of them.

``aiayn prepare --corpus NAME=SRC,TGT[,WEIGHT[,TAG[,LANG]]]`` (repeatable) writes the corpora one
after another into one train split; the manifest's ``splits.train.corpora`` lists them in that
order (``aiayn.data.prepare``)::

    [{"name": str, "weight": w, "tag": str, "lang": str,   # "" where none was given
      "start": i, "end": j,        # the corpus is pairs [i, j) of the cleaned train split
      "inputs": {"src": path, "tgt": path, "lines": n_in}, "cleaning": {... as the split's}}]

Each source sentence of a corpus starts with its ``tag`` (tagged back-translation, Caswell et al.
2019: the model learns to tell synthetic sources from real ones) and then its target-language
token ``<2LANG>`` (``lang``, else ``PrepareConfig.target_lang_token``; many-to-many translation,
Johnson et al. 2017, where the token picks the output language). Both are SentencePiece user
symbols, so each is one id; at translation time the token is written at the start of the
source text (``<2de> A dog runs.``) and the tokenizer reads it as that id.

Training (``CorpusMix``): epoch e draws a corpus of n pairs and weight w as floor(w) full copies
plus round((w - floor(w)) * n) of its pairs drawn without replacement from (seed, e, the
corpus's place), so every rank and every resumed run draws the same pairs, and the epoch's size
is the same every epoch. A split without ``corpora``, or whose weights are all 1, is served as
it is (``corpus_mix`` gives None).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from aiayn.data.store import MANIFEST
from aiayn.data.vocab import WORD_BOUNDARY
from aiayn.errors import UserError

log = logging.getLogger(__name__)

CORPUS_SPEC = "NAME=SRC,TGT[,WEIGHT[,TAG[,LANG]]]"
_NAME = re.compile(r"[\w.-]+")
_LANG = re.compile(r"[A-Za-z0-9_-]+")
_STREAM = 0x636F7270  # keeps the draw's generators apart from the batch sampler's (seed, epoch) ones


def lang_token(lang: str) -> str:
    """The target-language token of ``lang`` (Johnson et al. 2017): ``de`` -> ``<2de>``."""
    return f"<2{lang}>"


def check_lang(lang: str, what: str) -> None:
    if lang and not _LANG.fullmatch(lang):
        raise UserError(f"{what}: a language code is letters, digits, '-' or '_' (as in de, pt-BR), got {lang!r}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One corpus of the train split: aligned files, its weight per epoch, the tag and the target
    language whose tokens start each of its source sentences ("" for none)."""

    name: str
    src: Path
    tgt: Path
    weight: float = 1.0
    tag: str = ""
    lang: str = ""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise UserError(f"corpus name {self.name!r}: letters, digits, '.', '-' or '_'")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise UserError(f"corpus {self.name}: the weight must be a number >= 0, got {self.weight}")
        if self.tag and (WORD_BOUNDARY in self.tag or any(c.isspace() for c in self.tag)):
            raise UserError(f"corpus {self.name}: the tag must be one word (no spaces or {WORD_BOUNDARY!r}), "
                            f"got {self.tag!r}")
        check_lang(self.lang, f"corpus {self.name}")

    def source_tokens(self, default_lang: str = "") -> list[str]:
        """The tokens put before each of its source sentences: the tag, then ``<2LANG>``."""
        lang = self.lang or default_lang
        return [t for t in (self.tag, lang_token(lang) if lang else "") if t]


def parse_corpus(spec: str) -> Corpus:
    """A ``Corpus`` from ``--corpus NAME=SRC,TGT[,WEIGHT[,TAG[,LANG]]]`` (an empty field: its default)."""
    name, eq, rest = spec.partition("=")
    fields = rest.split(",")
    try:
        if not eq or len(fields) < 2 or not all(fields[:2]):
            raise UserError(f"expected {CORPUS_SPEC}")
        if len(fields) > 5:
            raise UserError(f"{len(fields)} comma-separated fields, at most 5: SRC,TGT,WEIGHT,TAG,LANG")
        src, tgt, weight, tag, lang = fields + [""] * (5 - len(fields))
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise UserError(f"the weight {weight!r} is not a number") from None
        return Corpus(name.strip(), Path(src), Path(tgt), w, tag.strip(), lang.strip())
    except UserError as exc:
        raise UserError(f"--corpus {spec!r}: {exc}") from None


def check_corpora(corpora: Sequence[Corpus]) -> None:
    names = [c.name for c in corpora]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--corpus: the name(s) {', '.join(twice)} given more than once (the --train-src "
                        f"corpus is called train)")
    if corpora and not any(c.weight > 0 for c in corpora):
        raise UserError("--corpus: every weight is 0; training would see no pair")


def draws(n: int, weight: float) -> tuple[int, int]:
    """A corpus of ``n`` pairs in an epoch: (full copies, pairs drawn besides)."""
    whole = int(weight)
    return whole, math.floor((weight - whole) * n + 0.5)


def epoch_index(ranges: Sequence[tuple[int, int, float]], seed: int, epoch: int) -> np.ndarray:
    """Pair positions (with repeats) of epoch ``epoch`` of corpora given as (start, end, weight)."""
    parts = []
    for k, (start, end, weight) in enumerate(ranges):
        n = end - start
        whole, m = draws(n, weight)
        parts += [np.arange(start, end)] * whole
        if m:
            rng = np.random.default_rng([seed, epoch, _STREAM, k])
            parts.append(start + np.sort(rng.choice(n, size=m, replace=False)))
    index = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return index.astype(np.int32) if len(index) < 2 ** 31 else index


class CorpusMix:
    """The train split as one epoch draws it from its corpora (module docstring): ``data[i]``,
    ``src_lens`` and ``tgt_lens`` follow ``index``, the epoch's pair positions in ``data`` (a
    ParallelData, or BpeDropoutData whose lengths change with its segmentation)."""

    def __init__(self, data, corpora: Sequence[dict[str, Any]], seed: int):
        self.data, self.seed = data, int(seed)
        self.name = getattr(data, "name", "")
        self.corpora = list(corpora)
        self.ranges = [(int(c["start"]), int(c["end"]), float(c["weight"])) for c in self.corpora]
        self.epoch: int | None = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> bool:
        """Draw epoch ``epoch``; whether that changed the pairs served."""
        if epoch == self.epoch:
            return False
        self.index = epoch_index(self.ranges, self.seed, epoch)
        self.epoch = int(epoch)
        return True

    def counts(self) -> dict[str, int]:
        """Pairs of each corpus in an epoch (the same every epoch)."""
        out = {}
        for c, (start, end, weight) in zip(self.corpora, self.ranges):
            whole, m = draws(end - start, weight)
            out[c["name"]] = whole * (end - start) + m
        return out

    def __len__(self) -> int:
        return len(self.index)

    @property
    def src_lens(self) -> np.ndarray:
        return self.data.src_lens[self.index]  # (N_epoch,)

    @property
    def tgt_lens(self) -> np.ndarray:
        return self.data.tgt_lens[self.index]  # (N_epoch,)

    def src(self, i: int) -> np.ndarray:
        return self.data.src(int(self.index[i]))

    def tgt(self, i: int) -> np.ndarray:
        return self.data.tgt(int(self.index[i]))

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src(i), self.tgt(i)


def corpus_mix(data_dir, train, seed: int) -> CorpusMix | None:
    """``train`` (the data directory's train split, or a view of it) as each epoch draws its
    corpora; None when the manifest lists none or every weight is 1 (the split as it is)."""
    corpora = data_dir.manifest["splits"]["train"].get("corpora")
    if not corpora or all(float(c["weight"]) == 1.0 for c in corpora):
        return None
    where = f"{data_dir.path / MANIFEST}: splits.train.corpora"
    end = 0
    for c in corpora:
        if c["start"] != end or c["end"] < c["start"] or not float(c["weight"]) >= 0:
            raise UserError(f"{where}: corpus {c.get('name')!r} has pairs [{c['start']}, {c['end']}) and weight "
                            f"{c['weight']}; the corpora must cover the split in order, with weights >= 0")
        end = c["end"]
    if end != len(train):
        raise UserError(f"{where} cover {end} pairs, the split has {len(train)}")
    mix = CorpusMix(train, corpora, seed)
    if len(mix) == 0:
        raise UserError(f"{where}: an epoch draws no pair (weights {[c['weight'] for c in corpora]})")
    log.info("train corpora per epoch: %s", ", ".join(f"{name} {n:,} (weight {c['weight']:g})"
                                                      for c, (name, n) in zip(corpora, mix.counts().items())))
    return mix
