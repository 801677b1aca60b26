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
merge with it, so a size's first few re-allocations still grow the heap). Batches of many shapes (a
large corpus has a row count for nearly every sentence length) leave holes of many sizes, so the heap
grew with the corpus (docs/history.md, "Training memory that grew with the corpus").
``release_free_memory`` (``malloc_trim``) hands the pages of the holes back to the kernel.

Training calls it after each validation, and every ``TRIM_EVERY_STEPS`` steps looks at the heap
(``HeapGrowth``): it trims where the heap has grown by a quarter since the last trim. A heap that
keeps its size reuses its holes step after step, and trimming it hands back pages that the next
steps fault in again, which cost the demo's step on some CPUs (docs/history.md, "Heap trims only
while the heap grows"); with the linear maps' rows padded (``aiayn.execution.linear``) the heap of a
large corpus stays bounded too, and a trim at every look only holds it lower (BENCHMARKS.md §9,
"Training on them: memory"). ``AIAYN_HEAP_TRIM`` chooses another rule (``trim_choice``). ``aiayn translate`` trims every ``CHUNK_LINES`` input lines (after each chunk of the
default --buffer), and a decoding worker looks at its heap every ``TRIM_EVERY_BATCHES`` batches: a
tiny-preset translator's 10,000-line chunks (beam 4) left 1.2-1.5 GB resident, growing from chunk to
chunk, of which about 0.43 GB were such holes.

The ``aiayn`` command calls ``reuse_freed_memory`` at start-up unless ``AIAYN_MALLOC=system`` is set;
Python users may call it themselves. It does nothing where glibc is not the C library.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

from aiayn.host.environment import env_choice

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_MAX = -4
ENV = "AIAYN_MALLOC"
TRIM_EVERY_STEPS = 10  # training's steps between two looks at the heap (HeapGrowth)
HEAP_GROWTH = 0.25  # the heap's growth since the last trim that makes HeapGrowth trim again
TRIM_ENV = "AIAYN_HEAP_TRIM"
TRIM_CHOICES = ("grown", "always", "never")  # HeapGrowth's rule, a trim at every look, none


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


def malloc_choice() -> str:
    """``AIAYN_MALLOC``: ``reuse`` (the default) or ``system``; a ``UserError`` naming it otherwise."""
    return env_choice(ENV, ("reuse", "system"))


def configure_from_env() -> bool:
    """What the CLI does: ``reuse_freed_memory()`` unless ``AIAYN_MALLOC=system``; ``AIAYN_HEAP_TRIM``
    checked (``trim_choice``)."""
    choice = malloc_choice()
    trim_choice()
    return choice == "reuse" and reuse_freed_memory()


def trim_choice() -> str:
    """``AIAYN_HEAP_TRIM``: when training and decoding workers trim, of ``TRIM_CHOICES`` (default
    ``grown``, ``HeapGrowth``'s rule; ``always`` at every look, the least memory; ``never``)."""
    return env_choice(TRIM_ENV, TRIM_CHOICES)


def trim_unless_never() -> bool:
    """A trim at a fixed point, outside ``HeapGrowth``'s looks (training after each validation,
    ``aiayn translate`` every ``CHUNK_LINES`` input lines): ``release_free_memory()`` unless
    ``AIAYN_HEAP_TRIM=never``, which makes no trim at all. True where a trim was made."""
    return trim_choice() != "never" and release_free_memory()


def release_free_memory() -> bool:
    """Return the free pages inside glibc's heap to the kernel (``malloc_trim(0)``); the blocks stay
    the process's, so only their pages fault in again when reused. True where glibc did it."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>, glibc 2.33 and later): ten size_t fields."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes() -> int | None:
    """The bytes glibc's heaps hold from the kernel, all arenas together (``mallinfo2``: the heaps'
    ``arena`` and the mmapped blocks' ``hblkhd``); None where glibc is absent or older than 2.33."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.arena + info.hblkhd


class HeapGrowth:
    """Trims (``release_free_memory``) as the heap grows. ``look`` counts its caller's steps (or
    batches); at every ``every``-th it trims when the heap holds more than ``1 + by`` times what it
    held at the last trim (``every`` 0: never). A heap that grows is cutting blocks of new sizes from
    its top while the holes of other sizes lie unused; a heap that keeps its size is not trimmed, as
    a trim would hand back the pages of holes the next steps reuse and fault in again. The size is
    compared with the one read before the last trim, not after it: a trim also hands back the heap's
    free top, which the next step takes again. Where the size cannot be read (``heap_bytes`` None),
    every look trims. ``when`` (default ``AIAYN_HEAP_TRIM``, read at the first look, not when made):
    ``always`` and ``never`` replace the rule."""

    def __init__(self, every: int = 1, by: float = HEAP_GROWTH, when: str | None = None) -> None:
        self.every, self.by, self.when = every, by, when
        self.looks, self.trimmed_at = 0, 0

    def look(self) -> bool:
        """One step (or batch) more: at the ``every``-th, trim if the heap has grown by ``by`` since
        the last trim. True where a trim was made."""
        self.looks += 1
        if self.every <= 0 or self.looks % self.every:
            return False
        self.when = self.when or trim_choice()
        if self.when != "grown":
            return self.when == "always" and release_free_memory()
        size = heap_bytes()
        if size is not None:
            if size <= self.trimmed_at * (1 + self.by):
                return False
            log.debug("heap: %.0f MB, %.0f MB at the last trim: trimmed", size / 2 ** 20, self.trimmed_at / 2 ** 20)
            self.trimmed_at = size
        return release_free_memory()
