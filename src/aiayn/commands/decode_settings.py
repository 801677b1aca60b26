"""The decoding settings of ``aiayn translate`` and ``aiayn evaluate``: the flags given, and for
the fields a checkpoint may carry (``CHECKPOINT_FIELDS``: an imported model's generation settings,
docs/import.md) that no flag gives, the checkpoint's own."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiayn.config import ConfigError, replace
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig
from aiayn.errors import UserError

log = logging.getLogger(__name__)


def stored_settings(paths: list[str]) -> dict:
    """The ``decode`` entry of one checkpoint (``CHECKPOINT_FIELDS``: an imported model's generation
    settings), {} for several or none. Only that entry is read (the tensors are mapped, not read);
    the Translator's load then verifies the whole file."""
    import torch

    from aiayn.checkpoint import check_torch
    if len(paths) != 1 or not Path(paths[0]).is_file():
        return {}
    check_torch()
    try:
        ckpt = torch.load(paths[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a checkpoint, or an older file format: the Translator's load says which
        return {}
    settings = ckpt.get("decode") if isinstance(ckpt, dict) else None
    if settings is None:
        return {}
    kinds = {f: DecodeConfig.__dataclass_fields__[f].type for f in CHECKPOINT_FIELDS}
    ok = {"int": lambda v: type(v) is int, "float": lambda v: type(v) in (int, float),
          "bool": lambda v: type(v) is bool, "str": lambda v: type(v) is str}
    bad = ([f"{k} = {v!r}" for k, v in settings.items() if k not in kinds or not ok[kinds[k]](v)]
           if isinstance(settings, dict) else [repr(settings)])
    if bad:
        raise UserError(f"{paths[0]}: its decode entry holds {', '.join(bad[:3])}, not settings of "
                        f"{', '.join(kinds)}")
    try:
        replace(TRANSLATE_DECODE, **settings)
    except ConfigError as exc:
        raise UserError(f"{paths[0]}: its decode entry: {exc}") from None
    return settings


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
