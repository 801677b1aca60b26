"""Files written atomically: a kill at any moment leaves the old file or the new one, never a torn
one (data directories, checkpoints, run summaries all go through here)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable


def current_umask() -> int:
    """The process's umask: from /proc/self/status on Linux (no window in which another thread
    would create files under a changed one), else by setting it and setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary file in the same directory, fsync, then rename over ``path``.

    A kill at any moment leaves either the old file or the new one, never a torn file. The file
    gets the permissions ``open`` would give it (0666 less the umask), not the temporary's 0600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable
        dfd = os.open(path.parent, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    except OSError:
        pass


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """JSON through ``atomic_write``: a reader never sees half a file."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
