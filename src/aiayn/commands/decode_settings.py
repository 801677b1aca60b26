"""The decoding settings of ``aiayn translate`` and ``aiayn evaluate``: the flags given, and for
the fields a checkpoint may carry (``CHECKPOINT_FIELDS``: an imported model's generation settings,
docs/import.md) that no flag gives, the checkpoint's own."""
from __future__ import annotations

import argparse
import logging

from aiayn.config import replace_from_options
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig
from aiayn.decode.loading import stored_settings
from aiayn.errors import UserError

log = logging.getLogger(__name__)

SAMPLING_ONLY = ("temperature", "top_k", "top_p")  # DecodeConfig fields only sampling reads (decode/search.py)


def decode_config(args: argparse.Namespace, checkpoints: list[str], base: DecodeConfig = TRANSLATE_DECODE
                  ) -> DecodeConfig:
    """The flags given (the fields of ``DecodeConfig`` the command has); for the fields a checkpoint
    may carry (``CHECKPOINT_FIELDS``) that no flag gives, the checkpoint's own settings, logged, else
    ``base``'s (translate's defaults, ``TRANSLATE_DECODE``, unless the command has its own). A sampling
    setting (``SAMPLING_ONLY``) given at another value than ``base``'s without sampling is a UserError."""
    values = {name: getattr(args, name) for name in DecodeConfig.__dataclass_fields__ if hasattr(args, name)}
    given = {k for k in CHECKPOINT_FIELDS if values.get(k) is not None}
    stored = {k: v for k, v in stored_settings(checkpoints).items() if k not in given}
    if stored:
        log.info("%s: decoding with its model's settings %s (a flag overrides each)", checkpoints[0],
                 ", ".join(f"{k} {v}" for k, v in stored.items()))
    for k in CHECKPOINT_FIELDS:
        if values.get(k) is None:
            values[k] = stored.get(k, getattr(base, k))
    if not values["sampling"]:  # beam and greedy search read none of them (fairseq refuses its top-k, top-p so)
        for k in SAMPLING_ONLY:
            if k in given and values[k] != getattr(base, k):
                raise UserError(f"--{k.replace('_', '-')} {values[k]} shapes sampling only: add --sampling "
                                f"(beam search and greedy search ignore it)")
    return replace_from_options(base, values)
