"""Reading a prepared data directory: ``DataDir`` (manifest + tokenizers) and ``ParallelData``.

The manifest (``manifest.json``, format "aiayn-data", version 1) is written last by
``aiayn prepare``; a directory without a complete, consistent manifest is refused. Keys::

    format, version, complete        "aiayn-data", 1, true
    special_ids                      {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    vocab                            {"shared": bool, "model_type": "bpe"|"unigram",
                                      "src": {"model": "spm.model", "sha256": ..., "vocab_size": V},
                                      "tgt": {... the same entry when shared, else spm.tgt.model}}
    splits                           {"train"|"valid"|"test": {
                                        "pairs": n, "cleaned": bool (true for train only),
                                        "inputs": {"src": path, "tgt": path, "lines": n_in},
                                        "cleaning": {"input": n_in, "empty": a, "too_long": b,
                                                     "bad_ratio": c, "kept": n},   # train only
                                        "src"|"tgt": {"tokens_file", "offsets_file", "dtype",
                                                      "tokens": total, "unk": <unk> count,
                                                      "bytes": {file: size},
                                                      "length": {min, max, mean, p50, p90, p99}},
                                        "corpora": [...]}}   # a train split of several corpora, in place
                                                             # of "inputs" (aiayn.data.corpora)
    options                          the PrepareConfig used (aiayn.data.prepare); with --tokenizer-from,
                                     the tokenizer fields are what the checkpoint's models hold,
                                     spm_sample_pairs and seed null, and tokenizer_from names it
    created                          ISO time (UTC)
    seconds                          wall seconds the preparation took (the demo's prepare_seconds)

Lengths count subword tokens without bos/eos. ``ParallelData`` opens the arrays by memory map,
so opening a 4.5M-pair corpus costs only the offsets.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.data.store import FORMAT, MANIFEST, SIDES, VERSION
from aiayn.data.vocab import SPECIAL_IDS, UNK_ID, Tokenizer
from aiayn.errors import UserError
from aiayn.files import atomic_write


class ParallelData:
    """One split: aligned source/target id sequences (no bos/eos), read by memory map.

    ``src_lens``/``tgt_lens`` are int32 token counts per pair, computed from the mapped offsets at each
    call and held by nobody here, so an open split holds no per-pair memory beyond the maps;
    ``data[i]`` is ``(src, tgt)`` as int64 numpy arrays. Pickles as paths (DataLoader workers reopen the maps).
    """

    def __init__(self, paths: dict[str, tuple[Path, Path]], name: str = ""):
        self.name = name
        self._paths = paths
        self._open()

    def _open(self) -> None:
        self._tokens = {}
        self._offsets = {}
        for side, (tok_path, off_path) in self._paths.items():
            self._tokens[side] = np.load(tok_path, mmap_mode="r")
            self._offsets[side] = np.load(off_path, mmap_mode="r")

    @property
    def src_lens(self) -> np.ndarray:
        return np.diff(self._offsets["src"]).astype(np.int32)  # (N,)

    @property
    def tgt_lens(self) -> np.ndarray:
        return np.diff(self._offsets["tgt"]).astype(np.int32)  # (N,)

    def __getstate__(self) -> dict:
        return {"paths": self._paths, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.name = state["name"]
        self._paths = state["paths"]
        self._open()

    def __len__(self) -> int:
        return len(self._offsets["src"]) - 1

    def _get(self, side: str, i: int) -> np.ndarray:
        off = self._offsets[side]
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.name}: index {i} out of range for {len(self)} pairs")
        i = i % len(self)
        return np.array(self._tokens[side][off[i]:off[i + 1]], dtype=np.int64)

    def rows(self, side: str, idx) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``idx`` of one side at once: their tokens end to end (int64) and their lengths (B,),
        what ``[self._get(side, i) for i in idx]`` holds, gathered by array indexing instead of
        row by row (a training batch's collation: ``batching.collate_rows``)."""
        off, n = self._offsets[side], len(self)
        i = np.asarray(idx, dtype=np.int64).reshape(-1)
        outside = (i < -n) | (i >= n)
        if outside.any():
            raise IndexError(f"{self.name}: index {int(i[outside][0])} out of range for {n} pairs")
        i = i % max(n, 1)
        starts = np.asarray(off[i], dtype=np.int64)  # (B,)
        lens = np.asarray(off[i + 1], dtype=np.int64) - starts  # (B,)
        ends = np.cumsum(lens)
        # flat position k of row b reads the stored token starts[b] + (k - the row's first flat position)
        pos = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(starts - (ends - lens), lens)
        return np.asarray(self._tokens[side][pos], dtype=np.int64), lens

    def src(self, i: int) -> np.ndarray:
        return self._get("src", i)

    def tgt(self, i: int) -> np.ndarray:
        return self._get("tgt", i)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src(i), self.tgt(i)


class DataDir:
    """A prepared data directory: validated manifest, tokenizers, and its splits."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        vocab = self.manifest["vocab"]
        self.shared_vocab = bool(vocab["shared"])
        self.src_tokenizer = self._tokenizer(vocab["src"])
        self.tgt_tokenizer = self.src_tokenizer if self.shared_vocab else self._tokenizer(vocab["tgt"])

    def _tokenizer(self, entry: dict[str, Any]) -> Tokenizer:
        tok = Tokenizer.load(self.path / entry["model"])
        if tok.sha256 != entry["sha256"]:
            raise UserError(f"{self.path / entry['model']}: sha256 {tok.sha256} differs from the "
                            f"manifest's {entry['sha256']}; the directory was modified")
        return tok

    @property
    def vocab_size(self) -> int:
        return self.src_tokenizer.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt_tokenizer.vocab_size

    @property
    def splits(self) -> list[str]:
        return sorted(self.manifest["splits"])

    def references(self, name: str) -> list[str] | None:
        """The target lines of an uncleaned split as ``prepare`` read them (its manifest's input
        file): the raw references BLEU is scored against. None when the file has moved or changed
        its line count since (then only the detokenized ids are left)."""
        entry = self.manifest["splits"][name]
        path = Path(entry.get("inputs", {}).get("tgt", ""))
        if entry.get("cleaned", True) or not path.is_file():
            return None
        from aiayn.data.textio import read_lines
        try:
            lines = list(read_lines(path))
        except (OSError, UserError):
            return None
        return lines if len(lines) == entry["pairs"] else None

    def split(self, name: str) -> ParallelData:
        if name not in self.manifest["splits"]:
            raise UserError(f"{self.path}: no split {name!r}; it has {', '.join(self.splits)}")
        entry = self.manifest["splits"][name]
        paths = {side: (self.path / entry[side]["tokens_file"], self.path / entry[side]["offsets_file"])
                 for side in SIDES}
        data = ParallelData(paths, name=f"{self.path}:{name}")
        if len(data) != entry["pairs"]:
            raise UserError(f"{self.path}: split {name!r} has {len(data)} pairs, manifest says {entry['pairs']}")
        return data


def _read_manifest(path: Path) -> dict[str, Any]:
    """Load and check the manifest: format, version, completeness and every file's size."""
    file = path / MANIFEST
    if not path.is_dir():
        raise UserError(f"{path}: not a directory (expected a data directory from `aiayn prepare`)")
    if not file.is_file():
        raise UserError(f"{path}: no {MANIFEST}; not a complete data directory (was `aiayn prepare` interrupted?)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{file}: unreadable manifest ({exc})") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                        f"expected {FORMAT!r} version {VERSION}")
    if manifest.get("complete") is not True:
        raise UserError(f"{file}: manifest is not marked complete")
    if manifest.get("special_ids") != SPECIAL_IDS:
        raise UserError(f"{file}: special ids {manifest.get('special_ids')}, expected {SPECIAL_IDS}")
    for split, entry in manifest["splits"].items():
        for side in SIDES:
            for name, size in entry[side]["bytes"].items():
                f = path / name
                if not f.is_file() or f.stat().st_size != size:
                    raise UserError(f"{f}: missing or truncated (split {split!r}, expected {size} bytes)")
    return manifest


class BpeDropoutData:
    """A train split re-segmented with BPE-dropout (Provilkov et al., 2020) once per epoch.

    The paper segments the corpus once (§5.1). Here ``sample()`` decodes every stored pair back
    to text and encodes it again with ``Tokenizer.encode_dropout(texts, p)`` (each BPE merge
    skipped with probability p), giving a ``Segmentation`` of the whole split; ``use(seg)``
    makes ``data[i]``, ``src_lens`` and ``tgt_lens`` follow it, so batches are cut on the
    lengths the model will see (cutting on the stored lengths instead padded Multi30k's
    batches by 50% at p = 0.1: dropped merges lengthen sentences unevenly, 1.38x the tokens on
    average). Until ``use`` is called the stored segmentation is served.

    A side that holds ``<unk>`` keeps its stored ids (decoding renders <unk> as text that would
    not encode back to it). SentencePiece draws the dropout from its own generator, which cannot
    be seeded reproducibly across processes (sentencepiece 0.2.3), so a run saves each epoch's
    segmentation (``Segmentation.save``) and a resumed run loads it: every rank and every resume
    then sees the same batches. Sampling costs one encoding of the split per epoch.
    """

    def __init__(self, data: ParallelData, src_tokenizer: Tokenizer, tgt_tokenizer: Tokenizer, p: float,
                 num_threads: int = 1, sides: tuple[str, ...] = ("src", "tgt")):
        if not set(sides) <= {"src", "tgt"}:
            raise ValueError(f"sides must be among src, tgt; got {sides!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"BPE-dropout probability must be in [0, 1], got {p}")
        for tok in (src_tokenizer, tgt_tokenizer):
            if tok.model_type != "bpe":
                raise UserError(f"{tok.name}: BPE-dropout needs a BPE model, this one is {tok.model_type}")
        self.data, self.p, self.num_threads, self.sides = data, float(p), int(num_threads), tuple(sides)
        self.name = data.name
        self.tokenizers = {"src": src_tokenizer, "tgt": tgt_tokenizer}
        self._texts: dict[str, list[str | None]] = {}
        self.segmentation: Segmentation | None = None
        self.src_lens, self.tgt_lens = data.src_lens, data.tgt_lens

    def __len__(self) -> int:
        return len(self.data)

    def _stored_texts(self, side: str) -> list[str | None]:
        """One side's text per pair, decoded once; None where the stored ids hold <unk>."""
        if side not in self._texts:
            tok, get = self.tokenizers[side], getattr(self.data, side)
            rows = (get(i) for i in range(len(self.data)))
            self._texts[side] = [None if (ids == UNK_ID).any() else tok.decode(ids) for ids in rows]
        return self._texts[side]

    def sample(self) -> "Segmentation":
        """A new BPE-dropout segmentation of every pair (SentencePiece's thread pool); a side not
        in ``sides`` keeps its stored segmentation."""
        arrays = {}
        for side in ("src", "tgt"):
            get = getattr(self.data, side)
            if side in self.sides:
                texts = self._stored_texts(side)
                sampled = iter(self.tokenizers[side].encode_dropout([t for t in texts if t is not None], self.p,
                                                                    self.num_threads))
                rows: list = [get(i) if t is None else next(sampled) for i, t in enumerate(texts)]
            else:
                rows = [get(i) for i in range(len(self.data))]
            lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            tokens = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
            arrays[side] = (tokens, offsets)
        return Segmentation(arrays)

    def use(self, seg: "Segmentation") -> None:
        if len(seg) != len(self.data):
            raise UserError(f"{self.name}: a segmentation of {len(seg)} pairs for a split of {len(self.data)}")
        self.segmentation = seg
        self.src_lens, self.tgt_lens = seg.lens("src"), seg.lens("tgt")

    def src(self, i: int) -> np.ndarray:
        return self.data.src(i) if self.segmentation is None else self.segmentation.get("src", i)

    def tgt(self, i: int) -> np.ndarray:
        return self.data.tgt(i) if self.segmentation is None else self.segmentation.get("tgt", i)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src(i), self.tgt(i)


class Segmentation:
    """One segmentation of a split: per side, the ids concatenated and n+1 offsets (the layout of
    ``aiayn.data.store``), held in memory; saved as one ``.npz`` written atomically."""

    def __init__(self, arrays: dict[str, tuple[np.ndarray, np.ndarray]]):
        self.arrays = arrays

    @staticmethod
    def path(run_dir: Path, epoch: int) -> Path:
        """Where a training run keeps an epoch's segmentation."""
        return Path(run_dir) / "bpe_dropout" / f"epoch{epoch:05d}.npz"

    @staticmethod
    def prune(run_dir: Path, epoch: int) -> None:
        """Delete a run's saved segmentations of epochs before ``epoch`` (no checkpoint from
        ``epoch`` on needs them)."""
        for f in (Path(run_dir) / "bpe_dropout").glob("epoch*.npz"):
            if int(f.stem[len("epoch"):]) < epoch:
                f.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.arrays["src"][1]) - 1

    def lens(self, side: str) -> np.ndarray:
        return np.diff(self.arrays[side][1]).astype(np.int64)

    def get(self, side: str, i: int) -> np.ndarray:
        tokens, offsets = self.arrays[side]
        return np.array(tokens[offsets[i]:offsets[i + 1]], dtype=np.int64)

    def sha256(self) -> str:
        """SHA-256 of both sides' ids and offsets (as int64): what a checkpoint records of the
        segmentation its epoch was cut on, so a resume can tell a file sampled again from it."""
        h = hashlib.sha256()
        for side in ("src", "tgt"):
            for a in self.arrays[side]:
                h.update(np.ascontiguousarray(a, dtype=np.int64))
        return h.hexdigest()

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"{side}_{name}": a for side, (tok, off) in self.arrays.items()
                  for name, a in (("tokens", tok.astype(np.int32)), ("offsets", off))}
        atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: Path) -> "Segmentation":
        try:
            with np.load(path) as z:
                return cls({side: (z[f"{side}_tokens"].astype(np.int64), z[f"{side}_offsets"]) for side in ("src", "tgt")})
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise UserError(f"{path}: unreadable BPE-dropout segmentation ({exc}); delete it to sample the epoch again") from exc
