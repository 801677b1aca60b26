"""The ``aiayn`` command's process settings, in one place (used by the CLI and by decoding workers).

Order matters, so they are applied together: huge pages before the first tensor (PyTorch reads the
setting once, ``aiayn/host/hugepages.py``), oneDNN's primitive cache capacity before the first matmul
(``aiayn/host/onednn_cache.py``), flushed denormals before anything creates PyTorch's thread
pool (``aiayn/host/denormals.py``), then glibc's reuse of freed memory (``aiayn/host/allocator.py``). Each is
on by default and turned off by its environment variable (AIAYN_HUGEPAGES=off, AIAYN_ONEDNN_CACHE=0,
AIAYN_DENORMALS=keep, AIAYN_MALLOC=system; AIAYN_HEAP_TRIM chooses when the heap is trimmed); a bad value
is a ``UserError`` naming the variable.
"""
from __future__ import annotations


def configure_process() -> None:
    """Apply the four settings from the environment, in the order above. Call it first."""
    from aiayn.host.allocator import configure_from_env as configure_allocator
    from aiayn.host.denormals import configure_from_env as configure_denormals
    from aiayn.host.hugepages import configure_from_env as configure_huge_pages
    from aiayn.host.onednn_cache import configure_from_env as configure_onednn_cache

    configure_huge_pages()
    configure_onednn_cache()
    configure_denormals()
    configure_allocator()


def check_settings() -> None:
    """The settings' variables checked without applying them (a ``UserError`` naming the first bad
    one): what a process that starts decoding workers, which apply them, does first, so that a bad
    value is refused in that process rather than in each worker as it starts."""
    from aiayn.host import allocator, denormals, hugepages, onednn_cache

    hugepages.choice()
    onednn_cache.capacity()
    denormals.choice()
    allocator.malloc_choice()
    allocator.trim_choice()


def die_with_parent(parent_pid: int) -> None:
    """In a child process (a decoding worker, or a training command before exec; Linux): the
    kernel sends it SIGTERM when its parent ends, however it ends, so no orphan keeps running.
    ``parent_pid`` is the parent's id, taken before the child started: if the child's parent is
    already another process, the parent ended before the request took effect, and the child exits.
    (Comparing with the parent's id, not with 1, keeps a child of an init process, such as a
    container's entry point, alive.)"""
    import os
    import signal
    import sys
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)
