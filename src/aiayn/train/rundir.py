"""A run directory's guards: one training at a time writes it (``RunLock``), and what a killed
one left half-written is removed when the next starts (``remove_stale_temps``).

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
from pathlib import Path

from aiayn.errors import UserError
from aiayn.files import TMP_MARK

log = logging.getLogger(__name__)
LOCK_NAME = "train.lock"


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/train.lock``, which holds the holder's pid, for as long
    as the context lasts (the kernel drops it when the process ends, however it ends). A second
    training of the same directory is a UserError naming the holder's pid."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent}: another training (pid {holder}) is writing this run "
                            f"directory; wait for it to end or use another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


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
