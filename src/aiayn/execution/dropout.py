"""Dropout (§5.4: "we apply dropout to the output of each sub-layer ... and to the sums of the
embeddings and the positional encodings"), with a faster mask on CPU: ``FastDropout``, which
``aiayn.execution.apply`` puts in place of the model's ``nn.Dropout`` modules (``train.fast_dropout``).

``F.dropout`` on CPU draws its mask with ``bernoulli_``, which a profile of ``aiayn demo``'s
training step found among its costliest operations (17 calls a step). ``dropout(..., fast=True)`` draws the same law from the same generator
another way: one ``random_()`` integer per element, uniform on [0, 2^31), kept when it is
at least round(p * 2^31). The keep probability is 1 - p to within 2^-31, elements are
independent, kept values are scaled by 1 / (1 - p) as in ``F.dropout``, and the mask comes
from torch's default generator, so ``torch.manual_seed`` and a checkpoint's saved RNG state
reproduce it exactly. It is cheaper because it only fills integers and compares them with one
threshold (what it saves: docs/training.md, "Speed choices"). On CUDA the
fused ``F.dropout`` kernel is already fast and is always used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_BITS = 2 ** 31  # random_() on int32 is uniform on [0, 2^31)


def dropout(x: Tensor, p: float, training: bool, fast: bool = True) -> Tensor:
    """Zero each element of ``x`` with probability ``p`` and scale the rest by 1 / (1 - p).

    Identity when not training or ``p == 0``. ``fast`` selects the integer-threshold mask on
    CPU (module docstring); elsewhere, or with ``fast=False``, this is ``F.dropout``.
    """
    if not training or p == 0.0:
        return x
    if not fast or x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    bits = torch.empty(x.shape, dtype=torch.int32, device=x.device).random_()  # uniform [0, 2^31)
    mask = bits.ge_(round(p * _BITS)).to(x.dtype).mul_(1.0 / (1.0 - p))  # 0 or 1/(1-p)
    return x * mask


class FastDropout(nn.Dropout):
    """``nn.Dropout`` (the same p) through ``dropout(..., fast=True)``."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, fast=True)
