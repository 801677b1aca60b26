"""A run directory's guards: one training at a time writes it (``RunLock``), a refused start (or one
ended by SIGTERM before its first step) leaves it as it was (``Claim``), and what a killed one left
half-written is removed when the next starts (``remove_stale_temps``).

Every file of a run directory is written through ``aiayn.files.atomic_write``: a temporary
``.NAME.aiayn-tmp-XXXXXXXX`` beside the destination, renamed over it when complete. A SIGKILL between
the two leaves the temporary behind; the holder of the lock deletes those of the files a
training writes.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import signal
import threading
from pathlib import Path

from aiayn.errors import UserError
from aiayn.files import TMP_MARK

log = logging.getLogger(__name__)
LOCK_NAME = "train.lock"


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/train.lock``, which holds the holder's pid, for as long
    as the context lasts (the kernel drops it when the process ends, however it ends). A second
    training of the same directory is a UserError naming the holder's pid. ``created``: whether this
    holder made the file (``remove`` deletes it again, for a refused start; ``put_back`` writes back the
    pid an earlier holder left)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self.created = False
        self.previous = b""  # the file's content before this holder's pid

    def __enter__(self) -> "RunLock":
        while True:
            fd, self.created = _open_lock(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise UserError(f"{self.path.parent}: another training (pid {holder}) is writing this run "
                                f"directory; wait for it to end or use another --out") from None
            if _names(fd, self.path):
                break
            os.close(fd)  # a refused start removed the file between its open and its lock: the file now there
        self.previous = os.pread(fd, 64, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def remove(self) -> None:
        """Delete the lock file, still locked (a training that opened it meanwhile finds it gone once it
        holds the lock, and takes the file then there: ``__enter__``)."""
        if self._fd is not None and _names(self._fd, self.path):
            self.path.unlink()

    def put_back(self) -> None:
        """Write back what the lock file held before this holder (an earlier training's pid)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, self.previous, 0)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file opened for reading and writing, made if missing: (its descriptor, whether made)."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR), False
        except FileNotFoundError:  # removed between the two opens
            continue


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (own.st_dev, own.st_ino)


# what a training's start writes into its run directory before its first step, besides the lock
START_OUTPUTS = ("config.json", "train_log.jsonl", "tensorboard")


class Terminated(BaseException):
    """SIGTERM while a ``Claim`` is not yet begun: raised, so that the claim is undone on the way out."""


class Claim:
    """The main rank's claim on a run directory for a training: the folders made for it (``--out a/b``
    where only ``a`` was), its ``RunLock``, and which of ``START_OUTPUTS`` were there before. Leaving
    the context by an exception before ``begin`` (a refused start: another model or tokenizer
    than the run's or the ``--init-from`` checkpoint's, a setting refused late) removes what the start
    made, so the directory is as it was (an earlier run's ``train.lock`` stays, with its pid). A SIGTERM
    before ``begin`` does the same: torchrun sends it to the main rank as soon as another rank has
    refused the start and ended first. The claim is undone, and the process then ends by the signal, as
    it would have at once without a claim (SIGTERM is not caught once the run has begun: docs/training.md)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.lock = RunLock(run_dir)
        self.made: list[Path] = []  # the folders made, outermost first
        self.before: set[str] = set()
        self.begun = False
        self._sigterm = None  # SIGTERM's handler before the claim (None: not taken over)
        self._terminated = self._undoing = False

    def __enter__(self) -> "Claim":
        self._take_sigterm()
        missing, p = [], self.run_dir
        while not os.path.lexists(p):
            missing.append(p)
            p = p.parent
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                except FileExistsError:  # made meanwhile by another process: not this start's
                    if not folder.is_dir():
                        raise
                    continue
                self.made.append(folder)
            self.lock.__enter__()
        except BaseException:
            self._undoing = True
            self._remove_folders()
            self._give_back_sigterm()
            raise
        self.before = {name for name in START_OUTPUTS if os.path.lexists(self.run_dir / name)}
        return self

    def begin(self) -> None:
        """The start passed every check: what the run writes from here on stays, and SIGTERM ends it at once."""
        self.begun = True
        self._give_back_sigterm()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and not self.begun:
                self._undoing = True  # (a SIGTERM now waits for the undo)
                self._undo()
        finally:
            self.lock.__exit__(exc_type, exc, tb)
            self._give_back_sigterm()

    def _take_sigterm(self) -> None:
        """SIGTERM raises ``Terminated`` until ``begin`` (in the main thread, where Python takes signals, and
        where the handler is Python's to change)."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not None:
            self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self._terminated = True
        if not self._undoing:
            raise Terminated()

    def _give_back_sigterm(self) -> None:
        """SIGTERM's handler as it was; a SIGTERM that came while the claim held it, delivered now."""
        if self._sigterm is None:
            return
        signal.signal(signal.SIGTERM, self._sigterm)
        self._sigterm = None
        if self._terminated:
            self.lock.__exit__(None, None, None)
            signal.raise_signal(signal.SIGTERM)

    def _undo(self) -> None:
        """Remove what the start made: its outputs, its lock file, its folders."""
        for name in START_OUTPUTS:
            path = self.run_dir / name
            if name in self.before or not os.path.lexists(path):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if self.lock.created:
            self.lock.remove()
        else:
            self.lock.put_back()
        self._remove_folders()

    def _remove_folders(self) -> None:
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except OSError:  # something else was written into it meanwhile: it stays
                break
        self.made = []


# the temporaries of what a training writes (``atomic_write``'s ".NAME.aiayn-tmp-XXXXXXXX"); another
# command writing into the directory at the same time (``aiayn average RUN --out RUN/avg.pt``) keeps its own
_TRAINING_TEMP = re.compile(r"^\.(last\.pt|best\.pt|ema\.pt|ckpt_step\d+\.pt|config\.json|summary\.json|"
                            r"train_log\.jsonl|epoch\d+\.npz)"
                            + re.escape(TMP_MARK) + r"\w+$")


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete the temporaries of atomic writes that a killed training left in ``run_dir`` (call it
    holding the ``RunLock``), and in its BPE-dropout segmentations' folder; returns them."""
    run_dir = Path(run_dir)
    stale = [p for d in (run_dir, run_dir / "bpe_dropout") for p in d.glob(f".*{TMP_MARK}*")
             if p.is_file() and _TRAINING_TEMP.match(p.name)]
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        log.info("%s: removed %d unfinished file(s) of an earlier run: %s", run_dir, len(stale),
                 ", ".join(p.name for p in stale))
    return stale
