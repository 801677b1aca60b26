"""Flush denormal floats to zero (FTZ/DAZ) in every CPU thread PyTorch computes on.

A denormal (subnormal) float32 is a value below 1.18e-38 in magnitude. x86 CPUs handle them
in microcode, tens of times slower than normal numbers. Softmax makes them routinely: exp(z)
is denormal for z < -87.3, so a row of logits spread over more than 87 produces them for its
unlikely entries, and log_softmax of such rows (the beam-search shape of the translation
benchmark) runs several times slower with denormals than with them flushed (docs/training.md,
"Process settings").

What flushing changes. Results that would be denormal become 0, and denormal inputs are read
as 0. Where the value is a term of a sum of at least one normal number (softmax, log_softmax,
attention), it is below that number's float32 rounding, so the result is unchanged; the tests
check this bit for bit for log_softmax and beam search. It is a process setting, like the
allocator's (``aiayn.host.allocator``):
- the ``aiayn`` command calls ``configure_from_env()`` at start-up; ``AIAYN_DENORMALS=keep``
  turns it off (IEEE gradual underflow everywhere);
- ``torch.set_flush_denormal`` sets the CPU's MXCSR register of the calling thread only.
  Threads created afterwards inherit it (pthread_create copies the floating-point
  environment), so it must run before PyTorch creates its OpenMP pool: before the first
  ``torch.set_num_threads`` or parallel operation. ``flush_denormals`` therefore runs first
  thing in the CLI; Python users call it first thing too.
GPUs are unaffected (CUDA kernels flush or not by their own compilation flags).
"""
from __future__ import annotations

from aiayn.host.environment import env_choice

ENV = "AIAYN_DENORMALS"
CHOICES = ("flush", "keep")


def flush_denormals() -> bool:
    """Set FTZ/DAZ on the calling thread (and the threads it creates later); True if supported."""
    import torch

    return bool(torch.set_flush_denormal(True))


def choice() -> str:
    """``AIAYN_DENORMALS``, of ``CHOICES`` (default ``flush``); a ``UserError`` naming it otherwise."""
    return env_choice(ENV, CHOICES)


def configure_from_env() -> bool:
    """What the CLI does: ``flush_denormals()`` unless ``AIAYN_DENORMALS=keep``."""
    return choice() == "flush" and flush_denormals()
