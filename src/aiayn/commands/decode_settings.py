"""The decoding settings of ``aiayn translate`` and ``aiayn evaluate``: the flags given, and for
the fields a checkpoint may carry (``CHECKPOINT_FIELDS``: an imported model's generation settings,
docs/import.md) that no flag gives, the checkpoint's own."""
from __future__ import annotations

import argparse
import logging

from aiayn.config import replace
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig
from aiayn.decode.loading import stored_settings

log = logging.getLogger(__name__)


def decode_config(args: argparse.Namespace, checkpoints: list[str], base: DecodeConfig = TRANSLATE_DECODE
                  ) -> DecodeConfig:
    """The flags given (the fields of ``DecodeConfig`` the command has); for the fields a checkpoint
    may carry (``CHECKPOINT_FIELDS``) that no flag gives, the checkpoint's own settings, logged, else
    ``base``'s (translate's defaults, ``TRANSLATE_DECODE``, unless the command has its own)."""
    values = {name: getattr(args, name) for name in DecodeConfig.__dataclass_fields__ if hasattr(args, name)}
    given = {k for k in CHECKPOINT_FIELDS if values.get(k) is not None}
    stored = {k: v for k, v in stored_settings(checkpoints).items() if k not in given}
    if stored:
        log.info("%s: decoding with its model's settings %s (a flag overrides each)", checkpoints[0],
                 ", ".join(f"{k} {v}" for k, v in stored.items()))
    for k in CHECKPOINT_FIELDS:
        if values.get(k) is None:
            values[k] = stored.get(k, getattr(base, k))
    return replace(base, **values)
