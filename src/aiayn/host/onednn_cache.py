"""Room in oneDNN's primitive cache for every matmul shape of a training run.

On the CPU, PyTorch's bfloat16 matmuls (autocast) run on oneDNN, which generates machine code for
each product shape (a "primitive": brgemm kernels for AVX-512 or AMX) and keeps the last 1,024 in a
cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A token-batched training step multiplies M = B x T rows
by each weight, and M changes from batch to batch: ``aiayn demo``'s batches have about 80 distinct
values of M over its epochs, each with a dozen or more products forward and backward (the linear
maps, their input and weight gradients, the output layer). That is more than 1,024 kernels, so an
LRU cache cycling through them keeps missing, and every miss generates a kernel again. With room
for all of them (16,384 entries) ``aiayn demo`` trains faster (BENCHMARKS.md §2, "The demo's training
step"), with the same validation loss to the digit (where code lives, not what is computed), and
without more resident memory.

Each entry holds megabytes, so what bounds the cache's memory is the set of shapes, not its
capacity: training and bfloat16 decoding pad the rows of their linear maps to a few row counts
(``aiayn.execution.linear``), without which a large corpus, with a row count for nearly every sentence
length, filled the room with thousands of kernels and the process grew with the corpus.

It is a process setting, like ``aiayn.host.hugepages``: oneDNN reads the variable when it creates its
first primitive, so it must be set before the first bfloat16 matmul, and processes started later
(``aiayn demo``'s training processes) inherit it.
- the ``aiayn`` command calls ``configure_from_env()`` at start-up; ``AIAYN_ONEDNN_CACHE=N`` sets
  the capacity to N entries (0 leaves oneDNN's default), and a ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
  the user set is left as it is;
- Python users call ``use_large_primitive_cache()`` before their first matmul.
"""
from __future__ import annotations

import os

ENV = "AIAYN_ONEDNN_CACHE"
ONEDNN_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # read by oneDNN at its first primitive
DEFAULT_CAPACITY = 16384
MAX_CAPACITY = 2 ** 31 - 1  # oneDNN reads the capacity into an int


def use_large_primitive_cache(capacity: int = DEFAULT_CAPACITY) -> int:
    """Set oneDNN's primitive cache capacity (unless the user set it); returns the capacity in effect
    (0: oneDNN's own default). Call before the first matmul of the process."""
    if capacity > 0:
        os.environ.setdefault(ONEDNN_ENV, str(capacity))
    value = os.environ.get(ONEDNN_ENV, "")
    return int(value) if value.isascii() and value.isdigit() else 0


def capacity() -> int:
    """``AIAYN_ONEDNN_CACHE``: ASCII digits, at most ``MAX_CAPACITY`` (default 16,384; 0 = oneDNN's
    default); a ``UserError`` naming it otherwise."""
    raw = os.environ.get(ENV, str(DEFAULT_CAPACITY))
    if not (raw.isascii() and raw.isdigit() and int(raw) <= MAX_CAPACITY):
        from aiayn.errors import UserError
        raise UserError(f"{ENV} must be a number of cache entries from 0 (oneDNN's default) to "
                        f"{MAX_CAPACITY}, got {raw!r}")
    return int(raw)


def configure_from_env() -> int:
    """What the CLI does: ``use_large_primitive_cache(N)`` with N from ``AIAYN_ONEDNN_CACHE``
    (default 16,384; 0 = oneDNN's default)."""
    return use_large_primitive_cache(capacity())
