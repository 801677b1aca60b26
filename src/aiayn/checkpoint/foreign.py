"""What a file or folder given as a checkpoint is when it is not aiayn's: another toolkit's
checkpoint (fairseq, OpenNMT-py, a bare state dict), Marian's ``model.npz``, a Hugging Face model
folder. ``load_checkpoint`` names it in its error, with what aiayn reads instead
(docs/migrating.md): aiayn's own checkpoints, and Marian models through ``aiayn import``.

Each test reads what loading has already read (a dict's keys, a zip's member names, a folder's
files): nothing here loads more of a file than ``weights_only`` does.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

READS = ("aiayn reads the checkpoints it writes; a Marian model (OPUS-MT, MarianMTModel) imports with "
         "`aiayn import DIR --out model.pt`; docs/migrating.md")

# The options object of fairseq's checkpoints (``args``, before its Hydra configs) and of OpenNMT-py's
# (``opt``): what ``weights_only`` refuses in a file of either.
OPTIONS_CLASSES = ("argparse.Namespace", "omegaconf.")

# Keys each toolkit's checkpoint dict has (fairseq: ``checkpoint_utils``; OpenNMT-py: ``models/model_saver``).
SIGNATURES = (("a fairseq", {"model", "optimizer_history"}), ("a fairseq", {"model", "extra_state", "cfg"}),
              ("an OpenNMT-py", {"model", "generator", "opt"}), ("an OpenNMT-py", {"model", "vocab", "opt"}))


def checkpoint_kind(ckpt: Any) -> str | None:
    """The toolkit whose checkpoint dict ``ckpt`` is, or "a bare state dict" (a dict of tensors only,
    as ``pytorch_model.bin``); None where it is neither."""
    if not isinstance(ckpt, dict):
        return None
    keys = set(ckpt)
    for name, needs in SIGNATURES:
        if needs <= keys:
            return f"{name} checkpoint"
    import torch
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return (f"a bare state dict of {len(ckpt)} tensors: weights without a configuration (a pytorch_model.bin, "
                f"or torch.save(model.state_dict())?)")
    return None


def options_class_hint(name: str) -> str | None:
    """For a refused global ``name`` that is another toolkit's options object, what the file likely is."""
    if name.startswith(OPTIONS_CLASSES):
        return f"not an aiayn checkpoint: it keeps options as {name}, as fairseq's and OpenNMT-py's do; {READS}"
    return None


def npz_hint(path: Path) -> str | None:
    """For a zip archive torch could not read: a numpy ``.npz`` (Marian's ``model.npz``) is named."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile):
        return None
    if names and all(n.endswith(".npy") and "/" not in n for n in names):
        return f"a numpy .npz archive of {len(names)} arrays (Marian's model.npz?), not a checkpoint; {READS}"
    return None


def safetensors_hint(head: bytes) -> str | None:
    """For a file that begins with ``head`` (its first 10 bytes) as a safetensors file does (an 8-byte
    header length, then the header's JSON object): what it is."""
    if len(head) == 10 and head[8:10] == b'{"':
        return f"a safetensors file (a Hugging Face model's weights?), not a checkpoint; {READS}"
    return None


def directory_hint(path: Path) -> str:
    """What to give instead of the folder ``path``."""
    if (path / "config.json").is_file() and any((path / w).is_file() for w in ("model.safetensors",
                                                                                "pytorch_model.bin")):
        return (f"a Hugging Face model folder, not a checkpoint file: `aiayn import {path} --out model.pt` "
                f"makes one of a MarianMTModel folder")
    return ("a directory, not a checkpoint file (a run directory's model is its best.pt or last.pt; "
            "`aiayn average RUN --out model.pt` averages its last checkpoints)")
