"""Keep freed memory in the process instead of returning it to the kernel (glibc malloc).

A training step allocates and frees the same large buffers every time (the (N,V) logits and
their gradient are over 100 MB at 4,096 tokens and V = 8,000). glibc serves blocks above its
mmap threshold with a fresh ``mmap`` and gives them back with ``munmap`` on free, so each
step pays the kernel to zero and map those pages again, page faults that took a large share of
``aiayn demo``'s step (docs/training.md, "Process settings"). ``reuse_freed_memory`` turns that off with two
``mallopt`` calls: no mmap for large blocks, and no trimming of the heap top. The cost is
that the heap only grows: blocks of new sizes are cut from its top, and the holes freed blocks
leave are kept (torch allocates with ``posix_memalign``, and glibc before 2.38 cuts an aligned
block only from a free one larger by the alignment: an exact hole is reused once freed neighbours
merge with it, so a size's first few re-allocations still grow the heap). Batches of many shapes (a large corpus has a row count for nearly every sentence
length) leave holes of many sizes, so the heap grew with the corpus (docs/history.md, "Training
memory that grew with the corpus"). ``release_free_memory`` (``malloc_trim``) hands the pages of the holes back to the
kernel; training calls it every ``TRIM_EVERY_STEPS`` steps and after each validation, which keeps
the resident memory flat for a few percent of the steps' time (BENCHMARKS.md §9, "Training on
them: memory"), less than glibc's defaults cost. ``aiayn translate`` calls it every ``CHUNK_LINES``
input lines (after each chunk of the default --buffer) and a decoding worker every
``TRIM_EVERY_BATCHES`` batches: a tiny-preset translator's 10,000-line chunks (beam 4) left 1.2-1.5 GB
resident, growing from chunk to chunk, of which about 0.43 GB were such holes.

The ``aiayn`` command calls it at start-up unless ``AIAYN_MALLOC=system`` is set; Python
users may call it themselves. It does nothing where glibc is not the C library.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_MAX = -4
ENV = "AIAYN_MALLOC"
TRIM_EVERY_STEPS = 10  # training's steps between two release_free_memory calls


@functools.cache
def _glibc(name: str):
    """glibc's function ``name``, or None where the C library is another (musl and others have no
    mallopt or malloc_trim). Looked up once: finding the library runs ldconfig."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def reuse_freed_memory() -> bool:
    """Ask glibc never to mmap large blocks nor trim the heap; True when it took effect."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1
    log.debug("malloc: reuse freed memory %s", "on" if ok else "not available")
    return ok


def configure_from_env() -> bool:
    """What the CLI does: ``reuse_freed_memory()`` unless ``AIAYN_MALLOC=system``."""
    choice = os.environ.get(ENV, "reuse")
    if choice not in ("reuse", "system"):
        from aiayn.errors import UserError
        raise UserError(f"{ENV} must be 'reuse' or 'system', got {choice!r}")
    return choice == "reuse" and reuse_freed_memory()


def release_free_memory() -> bool:
    """Return the free pages inside glibc's heap to the kernel (``malloc_trim(0)``); the blocks stay
    the process's, so only their pages fault in again when reused. True where glibc did it."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
