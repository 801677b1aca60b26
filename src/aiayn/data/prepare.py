"""``aiayn prepare``: raw parallel text -> a data directory (tokenizer, binarized splits, manifest).

Steps (§5.1: sentences encoded with byte-pair encoding into a shared source-target vocabulary):

1. check: every input exists, is UTF-8, source and target have the same number of lines,
   no split is empty; all before anything is written;
2. sample: up to ``spm_sample_pairs`` non-empty train pairs (reservoir sampling, ``seed``),
   so SentencePiece never needs the whole corpus in memory; a train split of several corpora
   (``aiayn.data.corpora``) is sampled as one stream, each corpus in proportion to its size;
3. train SentencePiece (BPE by default; unigram as an option), one shared model by default,
   keeping each of ``user_symbols`` one piece (in each model when they are separate), and each
   corpus tag and target-language token (added to ``user_symbols`` in the manifest's options);
4. encode every split streaming (each source sentence after its corpus's tag and target-language
   token, ``Corpus.source_tokens``), ``chunk_lines`` pairs at a time with SentencePiece's thread
   pool (``num_workers``), appending ids to ``.npy`` files (layout: ``aiayn.data.store``);
5. clean train only (valid/test are scored line by line, so they are kept whole, in order);
   a pair is dropped for the first rule it breaks, in this order, and counted under it:
   ``empty`` (a side with no tokens), ``too_long`` (a side over ``max_len`` tokens),
   ``bad_ratio`` (longer side / shorter side over ``max_len_ratio``);
6. write the manifest (format in ``aiayn.data.dataset``) last and rename the temp dir into place.

Fine-tuning (``aiayn prepare --tokenizer-from MODEL.pt``): steps 2-3 are replaced by the
checkpoint's own SentencePiece model(s) (its ``tokenizers`` entry, ``aiayn.train.loop.
tokenizer_payload``), written unchanged, so the new text is encoded into the vocabulary the model
was trained on and ``aiayn train --init-from MODEL.pt`` accepts the directory (same sha256).

Memory: the SentencePiece sample (the default 1M pairs of WMT-length sentences is roughly
0.5 GB of Python strings) and SentencePiece's trainer; encoding holds one chunk at a time.
Its time and memory on corpora up to WMT14's size: BENCHMARKS.md §9.

Cleaning defaults, in subword tokens without bos/eos: ``max_len`` 250 (the bound fairseq's
WMT14 En-De recipe applies to BPE tokens with Moses' clean-corpus-n); ``max_len_ratio`` 3.0
(that recipe uses 1.5, which on subwords drops many short, correct pairs: 802 of Multi30k's
29,000 with a shared BPE of 8000, against 2 at 3.0, both garbage; Moses' default is 9 on
words). The paper gives none.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
import unicodedata
from datetime import datetime, timezone
from itertools import chain, islice
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from sentencepiece import sentencepiece_model_pb2

from aiayn.config import ConfigError, param, replace, to_dict
from aiayn.data.corpora import Corpus, check_corpora, check_lang
from aiayn.data.store import FORMAT, MANIFEST, SIDES, VERSION, AtomicDir, NpyAppender, array_files, token_dtype
from aiayn.data.textio import check_readable, read_pairs
from aiayn.data.vocab import SPECIAL_IDS, UNK_ID, WORD_BOUNDARY, SentencePieceSpec, Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from aiayn.files import refuse_inputs_inside, write_json_atomic
from aiayn.progress import progress_bar

log = logging.getLogger(__name__)
PROGRESS_LINES = 10_000  # the check's bar moves every this many lines


def normalized(text: str, lowercase: bool) -> str:
    """``text`` as the tokenizer sees it (``aiayn.data.vocab``): NFKC, lowercased with ``lowercase``."""
    text = unicodedata.normalize("NFKC", text)
    return text.lower() if lowercase else text


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Options of ``aiayn prepare`` (recorded in the manifest)."""

    vocab_size: int = param(37000, "SentencePiece vocabulary size, special ids included (§5.1: about 37,000 shared for WMT14 En-De)")
    model_type: str = param("bpe", "SentencePiece model: bpe (byte-pair encoding, §5.1) or unigram")
    shared_vocab: bool = param(True, "one model for both languages (§5.1); false trains separate source and target models")
    character_coverage: float = param(0.9999, "share of characters SentencePiece must cover; rarer ones become <unk>")
    spm_sample_pairs: int = param(1_000_000, "train pairs sampled (reservoir, by seed) to train SentencePiece; all if fewer")
    drop_empty: bool = param(True, "drop train pairs with an empty side")
    max_len: int = param(250, "drop train pairs with a side longer than this many subword tokens; 0 = no limit")
    max_len_ratio: float = param(3.0, "drop train pairs whose longer/shorter side ratio (in subword tokens) exceeds this (a number >= 1); 0 = no limit")
    seed: int = param(1, "seed of the SentencePiece training sample")
    num_workers: int = param(0, "threads for SentencePiece training and encoding; 0 = os.cpu_count()")
    chunk_lines: int = param(100_000, "pairs read and encoded per chunk (bounds memory)")
    user_symbols: tuple[str, ...] = param((), "pieces SentencePiece must keep whole (user_defined_symbols), e.g. the bracket labels of linearized trees; each a space-separated word of the text")
    lowercase: bool = param(False, "build lowercasing into the SentencePiece model(s): the corpus and every later input are lowercased (outputs are lowercase); the form Multi30k's published baselines train on")
    target_lang_token: str = param("", "a language code LANG: <2LANG>, one piece, starts every source sentence (of corpora without their own LANG, valid, test), for many-to-many translation (Johnson et al. 2017; docs/data.md)")

    def __post_init__(self) -> None:
        if self.model_type not in ("bpe", "unigram"):
            raise ConfigError(f"model_type must be bpe or unigram, got {self.model_type!r}")
        if self.vocab_size <= len(SPECIAL_IDS) + len(self.user_symbols):
            raise ConfigError(f"vocab_size must exceed {len(SPECIAL_IDS)} special ids + {len(self.user_symbols)} "
                              f"user symbols, got {self.vocab_size}")
        bad = [s for s in self.user_symbols if not s or WORD_BOUNDARY in s or any(c.isspace() for c in s)]
        if bad:
            raise ConfigError(f"user_symbols must be words without spaces or {WORD_BOUNDARY!r}, got {bad!r}")
        unmatched = [s for s in self.user_symbols if normalized(s, self.lowercase) != s]
        if unmatched:
            raise ConfigError(f"user_symbols {unmatched!r}: the tokenizer normalizes its input (NFKC"
                              f"{', lowercased' if self.lowercase else ''}) before it looks for them, so they "
                              f"would never be one piece; write them as "
                              f"{[normalized(s, self.lowercase) for s in unmatched]!r}")
        if len(set(self.user_symbols)) != len(self.user_symbols):
            twice = sorted({s for s in self.user_symbols if self.user_symbols.count(s) > 1})
            raise ConfigError(f"user_symbols given more than once: {twice!r}")
        try:
            check_lang(self.target_lang_token, "target_lang_token")
        except UserError as exc:
            raise ConfigError(str(exc)) from None
        for name, low in (("max_len", 0), ("num_workers", 0), ("chunk_lines", 1), ("spm_sample_pairs", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not (self.max_len_ratio == 0 or 1 <= self.max_len_ratio < math.inf):  # longer/shorter is >= 1
            raise ConfigError(f"max_len_ratio must be 0 (no limit) or a number >= 1, got {self.max_len_ratio}")
        if not 0.98 <= self.character_coverage <= 1.0:  # SentencePiece's own bounds
            raise ConfigError(f"character_coverage must be in [0.98, 1] (SentencePiece's bounds), "
                              f"got {self.character_coverage}")

    @property
    def threads(self) -> int:
        return self.num_workers or os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    """The aligned source and target files of one split."""

    src: Path
    tgt: Path


def clean_reason(n_src: int, n_tgt: int, cfg: PrepareConfig) -> str | None:
    """The first cleaning rule a train pair of these token counts breaks, or None to keep it."""
    if cfg.drop_empty and (n_src == 0 or n_tgt == 0):
        return "empty"
    if cfg.max_len and max(n_src, n_tgt) > cfg.max_len:
        return "too_long"
    if cfg.max_len_ratio and min(n_src, n_tgt) > 0 and max(n_src, n_tgt) / min(n_src, n_tgt) > cfg.max_len_ratio:
        return "bad_ratio"
    return None


def length_stats(lens: np.ndarray) -> dict[str, float]:
    """min/max/mean and percentiles of token counts (for the manifest)."""
    if len(lens) == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0}
    p50, p90, p99 = np.percentile(lens, [50, 90, 99], method="higher")
    return {"min": int(lens.min()), "max": int(lens.max()), "mean": round(float(lens.mean()), 3),
            "p50": int(p50), "p90": int(p90), "p99": int(p99)}


class _Reservoir:
    """A uniform sample of up to ``size`` items of a stream fed in parts (reservoir sampling,
    seeded): fed several corpora in turn, it holds each in proportion to its size."""

    def __init__(self, size: int, seed: int):
        self.size, self.rng = size, random.Random(seed)
        self.items: list[tuple[str, str]] = []
        self.seen = 0

    def add(self, item: tuple[str, str]) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        elif (j := self.rng.randrange(self.seen)) < self.size:
            self.items[j] = item


def _scan(files: SplitFiles | Corpus, sample: _Reservoir | None, name: str = "") -> int:
    """Validate a split (or a corpus) end to end, feeding its non-empty pairs to ``sample``;
    return its line count."""
    n = 0
    with progress_bar(unit=" lines", desc=f"{name}: check") as bar:
        for n, s, t in read_pairs(files.src, files.tgt, name):
            if n % PROGRESS_LINES == 0:
                bar.update(PROGRESS_LINES)
            if sample is not None and s and t:
                sample.add((s, t))
    return n


def _train_tokenizers(sample: list[tuple[str, str]], tmp: Path, cfg: PrepareConfig) -> dict[str, str]:
    """Train the SentencePiece model(s) into ``tmp``; return the model file name per side."""
    spec = SentencePieceSpec(vocab_size=cfg.vocab_size, model_type=cfg.model_type,
                             character_coverage=cfg.character_coverage, user_symbols=cfg.user_symbols,
                             lowercase=cfg.lowercase)
    if cfg.shared_vocab:
        path = train_sentencepiece(chain.from_iterable(sample), tmp / "spm.model", spec, num_threads=cfg.threads)
        return {"src": path.name, "tgt": path.name}
    names = {}
    for k, side in enumerate(SIDES):
        names[side] = train_sentencepiece((p[k] for p in sample), tmp / f"spm.{side}.model", spec,
                                           num_threads=cfg.threads).name
    return names


TOKENIZER_FIELDS = ("vocab_size", "model_type", "shared_vocab", "character_coverage", "spm_sample_pairs",
                    "seed", "user_symbols", "lowercase")  # PrepareConfig fields that only shape a new tokenizer


def tokenizers_from_checkpoint(ckpt: dict, path: Path, given: Mapping[str, Any]) -> dict:
    """The ``tokenizers`` entry of a checkpoint dict, its model bytes checked against their sha256,
    with ``checkpoint``: ``path`` (the manifest names it). ``given``: the options of SentencePiece
    training (``TOKENIZER_FIELDS``) given on the command line, each with its value, at a default
    or not; one that differs from what the stored models have (``_stored_tokenizer_options``: a
    sample's size and seed they never have) would train new models, and is an error naming each."""
    toks = ckpt.get("tokenizers")
    if not isinstance(toks, dict) or not all(isinstance(toks.get(s), (bytes, bytearray)) for s in SIDES):
        raise UserError(f"{path}: the checkpoint holds no SentencePiece models (tokenizers.src/.tgt)")
    for side in SIDES:
        digest = Tokenizer(bytes(toks[side])).sha256
        if toks.get(f"{side}_sha256") not in (None, digest):
            raise UserError(f"{path}: the stored {side} tokenizer does not match its sha256; the checkpoint is corrupt")
    stored = _stored_tokenizer_options({side: Tokenizer(bytes(toks[side])) for side in SIDES}, str(path))
    changed = [f for f in TOKENIZER_FIELDS if f in given and not _same_option(given[f], stored[f])]
    if changed:
        def flag(f: str, value: Any) -> str:
            return f"--{f.replace('_', '-')} {_shown(value)}"
        raise UserError(f"--tokenizer-from {path} uses the checkpoint's SentencePiece model(s), which have "
                        f"{', '.join(flag(f, stored[f]) for f in changed)}; "
                        f"{', '.join(flag(f, given[f]) for f in changed)} would train a new one "
                        f"(leave the option out, or give the stored value)")
    return {**toks, "checkpoint": str(path)}


def _same_option(given: Any, stored: Any) -> bool:
    """Whether an option's value on the command line is what the stored models have (a coverage to
    the six places they record; symbols in any container)."""
    if stored is None:
        return False
    if isinstance(stored, float):
        return round(float(given), 6) == stored
    if isinstance(stored, list):
        return list(given) == stored
    return given == stored


def _shown(value: Any) -> str:
    """An option's value as the command line spells it (``none`` where the stored models have none:
    a sample's size and seed, or one size for two models of different sizes)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(value) or "''"
    return str(value)


def _write_tokenizers(toks: dict, tmp: Path) -> dict[str, str]:
    """A checkpoint's SentencePiece model(s) into ``tmp``, byte for byte; the file name per side."""
    if toks.get("shared", toks["src"] == toks["tgt"]):
        (tmp / "spm.model").write_bytes(bytes(toks["src"]))
        return {"src": "spm.model", "tgt": "spm.model"}
    for side in SIDES:
        (tmp / f"spm.{side}.model").write_bytes(bytes(toks[side]))
    return {side: f"spm.{side}.model" for side in SIDES}


def _stored_tokenizer_options(toks: dict[str, Tokenizer], source: str) -> dict[str, Any]:
    """The manifest's tokenizer options for model(s) taken from a checkpoint (``--tokenizer-from``):
    what the models themselves record (size, type, sharing, character coverage, user symbols,
    lowercasing: the source model's; a size the two models do not share is null, the manifest's
    ``vocab`` has each), so the manifest says what the data was encoded with, not the defaults of
    options that never applied. No sample was drawn, so its size and seed are null;
    ``tokenizer_from`` names the checkpoint."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(toks["src"].model_bytes)
    user = sentencepiece_model_pb2.ModelProto.SentencePiece.Type.USER_DEFINED
    sizes = {toks[side].vocab_size for side in SIDES}
    return {"vocab_size": sizes.pop() if len(sizes) == 1 else None, "model_type": toks["src"].model_type,
            "shared_vocab": toks["src"].sha256 == toks["tgt"].sha256,
            "character_coverage": round(proto.trainer_spec.character_coverage, 6),
            "user_symbols": [p.piece.removeprefix(WORD_BOUNDARY) for p in proto.pieces if p.type == user],
            "lowercase": toks["src"].lowercases,
            "spm_sample_pairs": None, "seed": None, "tokenizer_from": source}


def _chunks(files: SplitFiles | Corpus, size: int) -> Iterator[list[tuple[int, str, str]]]:
    pairs = read_pairs(files.src, files.tgt)
    while chunk := list(islice(pairs, size)):
        yield chunk


class _SideWriter:
    """Appends one side's ids and offsets, and tallies its lengths and <unk> count."""

    def __init__(self, tmp: Path, split: str, side: str, vocab_size: int):
        self.names = array_files(split, side)
        self.tmp = tmp
        self.dtype = token_dtype(vocab_size)
        self.tokens = NpyAppender(tmp / self.names[0], self.dtype)
        self.offsets = NpyAppender(tmp / self.names[1], np.int64)
        self.offsets.append(np.zeros(1, dtype=np.int64))
        self.lens: list[np.ndarray] = []
        self.unk = 0

    def append(self, seqs: list[list[int]]) -> None:
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        ids = np.fromiter(chain.from_iterable(seqs), dtype=self.dtype, count=int(lens.sum()))
        self.offsets.append(self.tokens.length + np.cumsum(lens))
        self.tokens.append(ids)
        self.lens.append(lens)
        self.unk += int(np.count_nonzero(ids == UNK_ID))

    def close(self) -> dict[str, Any]:
        self.tokens.close()
        self.offsets.close()
        lens = np.concatenate(self.lens) if self.lens else np.zeros(0, dtype=np.int64)
        return {"tokens_file": self.names[0], "offsets_file": self.names[1], "dtype": self.dtype.name,
                "tokens": int(lens.sum()), "unk": self.unk, "length": length_stats(lens),
                "bytes": {n: (self.tmp / n).stat().st_size for n in self.names}}


def _encode_chunk(chunk: list[tuple[int, str, str]], toks: dict[str, Tokenizer], writers: dict[str, _SideWriter],
                  counts: dict[str, int], cfg: PrepareConfig, clean: bool, prefix: str = "") -> None:
    """Encode one chunk of pairs (``prefix`` before each non-empty source sentence), drop those
    cleaning rules out (``clean``), append the rest."""
    src = toks["src"].encode_batch([prefix + p[1] if p[1] else "" for p in chunk], num_threads=cfg.threads)
    tgt = toks["tgt"].encode_batch([p[2] for p in chunk], num_threads=cfg.threads)
    counts["input"] += len(chunk)
    if clean:
        reasons = [clean_reason(len(s), len(t), cfg) for s, t in zip(src, tgt)]
        for r in reasons:
            counts[r or "kept"] += 1
        src = [s for s, r in zip(src, reasons) if r is None]
        tgt = [t for t, r in zip(tgt, reasons) if r is None]
    else:
        counts["kept"] += len(chunk)
    writers["src"].append(src)
    writers["tgt"].append(tgt)


@dataclasses.dataclass(frozen=True)
class _SplitPlan:
    """One split as ``prepare`` encodes it: its name, its corpora in order, its line count (for the
    progress bar), whether the cleaning rules apply (the train split only) and whether its manifest
    entry lists its corpora (a train split of several) rather than one corpus's files."""
    name: str
    parts: Sequence[Corpus]
    lines: int | None = None
    clean: bool = False
    listed: bool = False


def _encode_split(plan: _SplitPlan, toks: dict[str, Tokenizer], tmp: Path, cfg: PrepareConfig) -> dict[str, Any]:
    """Encode one split, its corpora ``plan.parts`` one after another, into ``tmp`` (cleaning it if
    ``plan.clean``); return its manifest entry, which lists the corpora if ``plan.listed`` (else its
    one corpus's files are its ``inputs``)."""
    split, parts, clean, listed = plan.name, plan.parts, plan.clean, plan.listed
    writers = {side: _SideWriter(tmp, split, side, toks[side].vocab_size) for side in SIDES}
    counts = {"input": 0, "empty": 0, "too_long": 0, "bad_ratio": 0, "kept": 0}
    corpora = []
    with progress_bar(plan.lines, unit=" lines", desc=f"{split}: encode") as bar:
        for part in parts:
            before = dict(counts)
            prefix = "".join(t + " " for t in part.source_tokens(cfg.target_lang_token))
            for chunk in _chunks(part, cfg.chunk_lines):
                _encode_chunk(chunk, toks, writers, counts, cfg, clean, prefix)
                bar.update(len(chunk))
            corpora.append(_corpus_entry(part, before, counts, clean and listed, cfg))
    entry: dict[str, Any] = {"pairs": counts["kept"], "cleaned": clean}
    if listed:
        entry["corpora"] = corpora
    else:
        entry["inputs"] = corpora[0]["inputs"]
    if clean:
        entry["cleaning"] = counts
        log.info("%s: %d pairs in, dropped %d empty, %d too long (> %d tokens), %d bad ratio (> %g); %d kept",
                 split, counts["input"], counts["empty"], counts["too_long"], cfg.max_len,
                 counts["bad_ratio"], cfg.max_len_ratio, counts["kept"])
        if counts["kept"] == 0:
            raise UserError(f"{parts[0].src}: empty corpus after cleaning (all {counts['input']} pairs dropped)")
    entry.update({side: writers[side].close() for side in SIDES})
    return entry


def _corpus_entry(part: Corpus, before: dict[str, int], after: dict[str, int], clean: bool,
                  cfg: PrepareConfig) -> dict[str, Any]:
    """A corpus's entry in the manifest (``aiayn.data.corpora``): counts ``after`` it less those ``before``."""
    done = {k: after[k] - before[k] for k in after}
    if clean and done["kept"] == 0:
        raise UserError(f"{part.src}: corpus {part.name} is empty after cleaning (all {done['input']} pairs dropped)")
    entry: dict[str, Any] = {"name": part.name, "weight": part.weight, "tag": part.tag,
                             "lang": part.lang or cfg.target_lang_token, "start": before["kept"], "end": after["kept"],
                             "inputs": {"src": str(part.src.resolve()), "tgt": str(part.tgt.resolve()),
                                        "lines": done["input"]}}
    if clean:
        entry["cleaning"] = done
    return entry


def _source_symbols(parts: dict[str, list[Corpus]], cfg: PrepareConfig) -> list[str]:
    """The corpus tags and target-language tokens that start source sentences, in order of first use."""
    return list(dict.fromkeys(token for token, _, _ in _symbol_origins(parts, cfg)))


def _symbol_origins(parts: dict[str, list[Corpus]], cfg: PrepareConfig) -> Iterator[tuple[str, str, str]]:
    """(token, the option that gave it, the value as the tokenizer sees it) of each corpus tag and
    target-language token that starts source sentences (``Corpus.source_tokens``)."""
    for c in (c for ps in parts.values() for c in ps):
        for token in c.source_tokens(cfg.target_lang_token):
            if token == c.tag:
                given, option = c.tag, f"--corpus {c.name} TAG"
            else:
                given = c.lang or cfg.target_lang_token
                option = f"--corpus {c.name} LANG" if c.lang else "--target-lang-token"
            yield token, f"{option} {given}", normalized(given, cfg.lowercase)


def _with_symbols(cfg: PrepareConfig, parts: dict[str, list[Corpus]]) -> PrepareConfig:
    """``cfg`` whose ``user_symbols`` also hold the corpus tags and target-language tokens of ``parts``
    (after its own). One that the tokenizer's normalization changes could never be one piece: a
    UserError naming the option that gave it and what to write instead."""
    origins = list(_symbol_origins(parts, cfg))
    changed = dict.fromkeys(f"{option} (write {fixed})" for token, option, fixed in origins
                            if normalized(token, cfg.lowercase) != token)
    if changed:
        raise UserError(f"{', '.join(changed)}: the tokenizer normalizes its input (NFKC"
                        f"{', lowercased' if cfg.lowercase else ''}) before it looks for corpus tags and "
                        f"target-language tokens, so as given they would never be one piece")
    extra = tuple(dict.fromkeys(t for t, _, _ in origins if t not in cfg.user_symbols))
    try:
        return replace(cfg, user_symbols=cfg.user_symbols + extra) if extra else cfg
    except ConfigError as exc:
        raise UserError(f"{exc} (the corpus tags and target-language tokens {', '.join(extra)} are user symbols)") from None


def _check_one_piece(symbols: list[str], tok: Tokenizer, from_checkpoint: bool) -> None:
    """Each tag and target-language token must be one id of the source tokenizer."""
    split = [s for s in symbols if len(tok.encode(s)) != 1]
    if split:
        why = ("the checkpoint's tokenizer (--tokenizer-from) was not trained with them as user symbols"
               if from_checkpoint else "SentencePiece did not keep them whole")
        raise UserError(f"{', '.join(split)}: not one piece of the source tokenizer; {why}")


def prepare(splits: dict[str, SplitFiles], out: Path, cfg: PrepareConfig, force: bool = False,
            tokenizers: dict | None = None, corpora: Sequence[Corpus] = ()) -> dict[str, Any]:
    """Build the data directory ``out`` from ``splits`` ("train" required); returns the manifest.
    ``tokenizers``: a checkpoint's ``tokenizers`` entry (``tokenizers_from_checkpoint``), used
    instead of training SentencePiece (fine-tuning). ``corpora``: the train split as several
    corpora (``aiayn.data.corpora``), in place of ``splits["train"]``; the manifest lists them."""
    if corpora and "train" in splits:
        raise ValueError("prepare: the train split comes from splits['train'] or from corpora, not both")
    if "train" not in splits and not corpora:
        raise UserError("prepare needs a train split")
    check_corpora(corpora)
    parts = {split: [Corpus(split, files.src, files.tgt)] for split, files in splits.items()}
    if corpora:
        parts = {"train": list(corpora), **parts}
    for split, ps in parts.items():
        for c in ps:
            what = f"--corpus {c.name}" if corpora and split == "train" and c.name != "train" else split
            check_readable(c.src, f"{what} source")
            check_readable(c.tgt, f"{what} target")
    symbols = _source_symbols(parts, cfg)
    if tokenizers is None:
        cfg = _with_symbols(cfg, parts)
    out = Path(out)
    refuse_inputs_inside(out, [f for ps in parts.values() for c in ps for f in (c.src, c.tgt)])
    atomic = AtomicDir(out, force=force)
    atomic.check_destination()
    t0 = time.perf_counter()
    lines = dict.fromkeys(parts, 0)
    reservoir = _Reservoir(cfg.spm_sample_pairs, cfg.seed) if tokenizers is None else None
    for split, ps in parts.items():
        for c in ps:
            name = f"{split}/{c.name}" if corpora and split == "train" else split
            n = _scan(c, reservoir if split == "train" else None, name)
            log.info("%s: %d aligned lines (%s, %s)", name, n, c.src, c.tgt)
            lines[split] += n
    sample = reservoir.items if reservoir is not None else []
    if not sample and tokenizers is None:
        where = parts["train"][0].src if len(parts["train"]) == 1 else "train corpora"
        raise UserError(f"{where}: empty corpus (no train pair has both sides non-empty)")
    n_sample = len(sample)
    with atomic as tmp:
        t1 = time.perf_counter()
        if tokenizers is None:
            log.info("training SentencePiece on %d sampled pairs (a step without a progress bar)", n_sample)
        names = _train_tokenizers(sample, tmp, cfg) if tokenizers is None else _write_tokenizers(tokenizers, tmp)
        del sample, reservoir
        toks = {side: Tokenizer.load(tmp / names[side]) for side in SIDES}
        _check_one_piece(symbols, toks["src"], from_checkpoint=tokenizers is not None)
        shared = names["src"] == names["tgt"]
        if tokenizers is None:
            log.info("trained SentencePiece %s (%s, vocab %d) on %d sampled pairs in %.1fs",
                     "shared" if shared else "separate", cfg.model_type, toks["src"].vocab_size,
                     n_sample, time.perf_counter() - t1)
        manifest = {
            "format": FORMAT, "version": VERSION, "complete": True, "special_ids": SPECIAL_IDS,
            "vocab": {"shared": shared, "model_type": toks["src"].model_type,
                      **{side: {"model": names[side], "sha256": toks[side].sha256,
                                "vocab_size": toks[side].vocab_size} for side in SIDES}},
            "splits": {split: _encode_split(_SplitPlan(split, ps, lines=lines[split], clean=(split == "train"),
                                                       listed=bool(corpora) and split == "train"), toks, tmp, cfg)
                       for split, ps in parts.items()},
            "options": to_dict(cfg) if tokenizers is None else {
                **to_dict(cfg), **_stored_tokenizer_options(toks, str(Path(tokenizers["checkpoint"]).resolve()))},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        write_json_atomic(tmp / MANIFEST, manifest)
    log.info("wrote %s in %.1fs", out, time.perf_counter() - t0)
    return manifest
