"""The ``aiayn`` command's process settings, in one place (used by the CLI and by decoding workers).

Order matters, so they are applied together: huge pages before the first tensor (PyTorch reads the
setting once, ``aiayn/hugepages.py``), oneDNN's primitive cache capacity before the first matmul
(``aiayn/onednn_cache.py``), flushed denormals before anything creates PyTorch's thread
pool (``aiayn/denormals.py``), then glibc's reuse of freed memory (``aiayn/allocator.py``). Each is
on by default and turned off by its environment variable (AIAYN_HUGEPAGES=off, AIAYN_ONEDNN_CACHE=0,
AIAYN_DENORMALS=keep, AIAYN_MALLOC=system); a bad value is a ``UserError`` naming the variable.
"""
from __future__ import annotations


def configure_process() -> None:
    """Apply the four settings from the environment, in the order above. Call it first."""
    from aiayn.allocator import configure_from_env as configure_allocator
    from aiayn.denormals import configure_from_env as configure_denormals
    from aiayn.hugepages import configure_from_env as configure_huge_pages
    from aiayn.onednn_cache import configure_from_env as configure_onednn_cache

    configure_huge_pages()
    configure_onednn_cache()
    configure_denormals()
    configure_allocator()
