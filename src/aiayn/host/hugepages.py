"""Back PyTorch's large CPU tensors with transparent huge pages (2 MB instead of 4 kB pages).

A training step of ``aiayn demo`` touches a few hundred MB of activations, logits and gradients
spread over tens of thousands of 4 kB pages; every page needs its own TLB entry, and the TLB
holds a few thousand. PyTorch's CPU allocator can page-align blocks of 2 MB and more and
``madvise(MADV_HUGEPAGE)`` them, so the kernel maps them with huge pages, when the
environment variable ``THP_MEM_ALLOC_ENABLE=1`` is set. It reads the variable once, at the
first CPU allocation of the process, so it must be set before any tensor exists.

Fewer TLB misses make the demo's training step faster (BENCHMARKS.md §2, "Transparent huge pages",
where ``bench/hugepages_ab.py``'s measurements and the alternatives tried are). The numbers computed
are unchanged (same validation loss, to the digit): this is where memory lives, not what is
computed. The alternatives, glibc's own huge-page tunable (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``)
and jemalloc, were slower.

It is a process setting, like the allocator's (``aiayn.host.allocator``) and the denormals'
(``aiayn.host.denormals``):
- the ``aiayn`` command calls ``configure_from_env()`` first thing; ``AIAYN_HUGEPAGES=off``
  turns it off, and a ``THP_MEM_ALLOC_ENABLE`` the user set is left as it is;
- Python users call ``use_huge_pages()`` before creating their first tensor. Called later (for
  example ``aiayn.cli.main`` from a process that already has tensors, as the tests do), it only
  affects the processes this one starts, which inherit the variable;
- it does nothing where the kernel has transparent huge pages disabled (``never``) or has none
  (not Linux); CUDA memory is unaffected.
"""
from __future__ import annotations

import os
from pathlib import Path

from aiayn.host.environment import env_choice

ENV = "AIAYN_HUGEPAGES"
CHOICES = ("on", "off")
TORCH_ENV = "THP_MEM_ALLOC_ENABLE"  # read by c10's CPU allocator (c10/core/impl/alloc_cpu.cpp)
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def kernel_mode(sysfs: Path = THP_SYSFS) -> str | None:
    """The kernel's THP mode, ``always``, ``madvise`` or ``never`` (the bracketed word); None if unknown."""
    try:
        text = sysfs.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def kernel_allows_huge_pages(sysfs: Path = THP_SYSFS) -> bool:
    """True when the kernel's THP mode is ``always`` or ``madvise``."""
    return kernel_mode(sysfs) in ("always", "madvise")


def use_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for PyTorch's CPU allocator (unless the user set it);
    True when the kernel will honour it. Call before the process creates its first tensor."""
    if not kernel_allows_huge_pages():
        return False
    os.environ.setdefault(TORCH_ENV, "1")
    return os.environ[TORCH_ENV] == "1"


def choice() -> str:
    """``AIAYN_HUGEPAGES``, of ``CHOICES`` (default ``on``); a ``UserError`` naming it otherwise."""
    return env_choice(ENV, CHOICES)


def configure_from_env() -> bool:
    """What the CLI does: ``use_huge_pages()`` unless ``AIAYN_HUGEPAGES=off``."""
    return choice() == "on" and use_huge_pages()
