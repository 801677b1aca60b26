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
destination and renames it into place only after the manifest (itself written to a temporary
name, then renamed) is complete.
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from aiayn.errors import UserError
from aiayn.files import atomic_write, current_umask, write_json_atomic  # noqa: F401 (used here and by callers)

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

    def abort(self) -> None:
        self._f.close()


def _is_replaceable(path: Path) -> bool:
    """An existing output may be replaced only if it is an empty dir or a data directory."""
    return path.is_dir() and (not any(path.iterdir()) or (path / MANIFEST).is_file())


class AtomicDir:
    """Context manager: a temp dir beside ``out``, renamed to ``out`` on success, removed on error.

    ``force`` replaces an existing ``out`` that is empty or a data directory (never anything else).
    """

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.tmp: Path | None = None

    def check_destination(self) -> None:
        if self.out.exists() and not (self.force and _is_replaceable(self.out)):
            hint = " (pass --force to replace it)" if _is_replaceable(self.out) else \
                " and is not a data directory; choose another --out"
            raise UserError(f"{self.out}: already exists{hint}")

    def __enter__(self) -> Path:
        self.check_destination()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        os.chmod(self.tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 is for the temp name only
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if not (self.tmp / MANIFEST).is_file():
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise RuntimeError("AtomicDir: the writer finished without a manifest")
        old = None
        if self.out.exists():
            self.check_destination()
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, old / "d")
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False
