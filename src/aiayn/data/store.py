"""On-disk layout of a prepared data directory, and the writers that build it safely.

A data directory (written by ``aiayn prepare``, read by ``aiayn.data.dataset.DataDir``)::

    manifest.json              written last; its presence means the directory is complete
    spm.model                  the shared SentencePiece model (or spm.src.model and spm.tgt.model)
    <split>.src.tokens.npy     all source sentences' ids, concatenated (uint16 if V <= 65535, else int32)
    <split>.src.offsets.npy    int64, n+1 entries: sentence i is tokens[offsets[i]:offsets[i+1]]
    <split>.tgt.tokens.npy     the same for the target side
    <split>.tgt.offsets.npy

Ids carry no bos/eos (see ``aiayn.data.vocab``). Arrays are plain ``.npy`` files opened with
``np.load(path, mmap_mode="r")``, so a corpus larger than memory is read by memory map.

Writing is all-or-nothing: ``AtomicDir`` builds everything in a temporary directory beside the
destination and puts it in place in one step (an existing one swapped out, never a moment
without one) only after the manifest (itself written to a temporary name, then renamed) is
complete.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from aiayn.files import LEFTOVER, OutputDir

MANIFEST = "manifest.json"
FORMAT = "aiayn-data"
VERSION = 1
SIDES = ("src", "tgt")
SPLITS = ("train", "valid", "test")

_NPY_HEADER_BYTES = 128  # fixed size reserved for the header, rewritten with the final shape


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every id of a vocabulary of ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def array_files(split: str, side: str) -> tuple[str, str]:
    """File names (tokens, offsets) of one side of one split."""
    return f"{split}.{side}.tokens.npy", f"{split}.{side}.offsets.npy"


class NpyAppender:
    """A 1-D ``.npy`` file written incrementally: the shape goes into the header on ``close``."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.length = 0
        self._f = open(self.path, "wb")
        self._f.write(b"\0" * _NPY_HEADER_BYTES)

    def append(self, values: np.ndarray) -> None:
        arr = np.ascontiguousarray(values, dtype=self.dtype)
        self._f.write(arr.tobytes())
        self.length += arr.size

    def close(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.length,)}
        text = repr(header).encode("latin1")
        pad = _NPY_HEADER_BYTES - 10 - len(text) - 1
        self._f.seek(0)
        self._f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", _NPY_HEADER_BYTES - 10)
                      + text + b" " * pad + b"\n")
        self._f.close()


DATA_FILE = re.compile(r"manifest\.json|spm(?:\.src|\.tgt)?\.model|[^/]+\.(?:src|tgt)\.(?:tokens|offsets)\.npy")


def is_data_dir(path: Path) -> bool:
    """Whether ``path`` is a data directory (its manifest written) holding only what ``aiayn prepare``
    writes (``DATA_FILE``, and aiayn's temporaries): what ``--overwrite`` may replace. A file of the
    user's put there (the corpus itself, notes) makes it not one, so nothing of theirs is deleted."""
    if not (path / MANIFEST).is_file():
        return False
    return all(DATA_FILE.fullmatch(p.name) and p.is_file() or LEFTOVER.match(p.name) for p in path.iterdir())


class AtomicDir(OutputDir):
    """Context manager: a temp dir beside ``out``, put in place of ``out`` in one step on success
    (``aiayn.files.OutputDir``), removed on error. ``out`` may exist only empty or, with
    ``force`` (the CLI's ``--overwrite``), as a data directory; nothing else is ever replaced.
    """

    def __init__(self, out: Path, force: bool = False):
        super().__init__(out, overwrite=force, ours=is_data_dir, what="a data directory")

    def check_destination(self) -> None:
        self.check()

    def finish(self, tmp: Path) -> None:
        if not (tmp / MANIFEST).is_file():
            raise RuntimeError("AtomicDir: the writer finished without a manifest")
