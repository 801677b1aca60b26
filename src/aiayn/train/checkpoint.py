"""Checkpoints that describe themselves (STYLE.md habit 7), written atomically, and averaging.

A checkpoint is a torch file holding a dict:
  format: "aiayn-checkpoint-1"
  run_config: RunConfig as a dict (model + train sections); model_config: the model section
  model: state dict of the unwrapped module (float32 for averages)
  step, epoch, optimizer, scaler, sampler (data position), rng (torch/cuda/numpy/python)
  tokenizers: {"src": bytes, "tgt": bytes, "src_sha256": str, "tgt_sha256": str, "shared": bool}
  best_valid_loss, valid (last validation metrics)
Files in a run directory: ckpt_step00001234.pt (kept: the last K), last.pt, best.pt.

An ensemble file (``ensemble_checkpoint``) holds several models for translation only:
  format: "aiayn-ensemble-1"; members: a list of checkpoints as above, without training state
(all with the same tokenizers). Training, resuming, averaging and export take single checkpoints.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from aiayn.data.store import atomic_write
from aiayn.errors import UserError

log = logging.getLogger(__name__)
FORMAT = "aiayn-checkpoint-1"
ENSEMBLE_FORMAT = "aiayn-ensemble-1"
TRAINING_STATE = ("optimizer", "rank_optimizers", "scaler", "rng", "sampler")
STEP_RE = re.compile(r"ckpt_step(\d+)\.pt$")


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through ``atomic_write``: a kill at any moment leaves either the old file or
    the new one, never a torn file."""
    atomic_write(path, lambda f: torch.save(obj, f))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    ensemble_ok: bool = False) -> dict:
    """The checkpoint dict of ``path``; an ensemble file only with ``ensemble_ok`` (translation)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise UserError(f"{path}: not a readable checkpoint ({exc.__class__.__name__}: {exc})") from exc
    if isinstance(ckpt, dict) and ckpt.get("format") == ENSEMBLE_FORMAT:
        if not ensemble_ok:
            raise UserError(f"{path}: an ensemble of {len(ckpt.get('members', []))} models, which only translation "
                            f"reads (translate, evaluate, serve); training, resuming, averaging and export take "
                            f"single checkpoints")
        if not ckpt.get("members"):
            raise UserError(f"{path}: an ensemble file without members")
        return ckpt
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path}: not an aiayn checkpoint (format {ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt)})")
    return ckpt


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """Step checkpoints of a run directory, oldest first."""
    found = []
    for p in Path(run_dir).glob("ckpt_step*.pt"):
        m = STEP_RE.search(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune(run_dir: str | Path, keep_last: int) -> None:
    ckpts = step_checkpoints(run_dir)
    for p in ckpts[: max(0, len(ckpts) - keep_last)]:
        p.unlink(missing_ok=True)


def average_checkpoints(paths: list[str | Path]) -> dict:
    """Mean of the model parameters of ``paths`` in float32 (§6.1); everything else from the last.

    The result loads like any other checkpoint (for inference; it carries no optimizer).
    """
    if not paths:
        raise UserError("no checkpoints to average")
    total: dict[str, torch.Tensor] | None = None
    last = None
    for p in paths:
        ckpt = load_checkpoint(p)
        state = ckpt["model"]
        if total is None:
            total = {k: v.detach().to(torch.float32).clone() if v.is_floating_point() else v.clone()
                     for k, v in state.items()}
            ref_cfg, ref_toks = ckpt.get("model_config"), tokenizer_hashes(ckpt.get("tokenizers"))
        else:
            if ckpt.get("model_config") != ref_cfg or set(state) != set(total):
                raise UserError(f"{p}: a different model from {paths[0]}; cannot average")
            if tokenizer_hashes(ckpt.get("tokenizers")) != ref_toks:
                raise UserError(f"{p}: trained with other tokenizers than {paths[0]}; cannot average")
            for k, v in state.items():
                if v.is_floating_point():
                    total[k] += v.to(torch.float32)
        last = ckpt
    n = len(paths)
    model = {k: (v / n if v.is_floating_point() else v) for k, v in total.items()}
    out = {k: v for k, v in last.items() if k not in TRAINING_STATE}
    out["model"] = model
    out["averaged_from"] = [str(p) for p in paths]
    return out


def tokenizer_hashes(tokenizers: dict | None) -> tuple:
    """The source and target tokenizer models' SHA-256 of a checkpoint's ``tokenizers`` entry
    (None where it has none): what says two checkpoints (or a checkpoint and a data directory,
    ``aiayn.train.loop.tokenizer_payload``) share their vocabularies."""
    toks = tokenizers or {}
    return toks.get("src_sha256"), toks.get("tgt_sha256")


def checkpoint_members(paths: list[str | Path], map_location: str | torch.device = "cpu") -> list[tuple[str, dict]]:
    """(label, checkpoint dict) of every model in ``paths`` (checkpoints or ensemble files), in
    order; the members of an ensemble file are labelled "PATH (member N)". Their tokenizers must
    be the same (``tokenizer_hashes``): the models of an ensemble predict over one vocabulary.
    """
    out: list[tuple[str, dict]] = []
    for p in paths:
        ckpt = load_checkpoint(p, map_location=map_location, ensemble_ok=True)
        is_ensemble = ckpt["format"] == ENSEMBLE_FORMAT
        for n, m in enumerate(ckpt["members"] if is_ensemble else [ckpt]):
            label = f"{p} (member {n})" if is_ensemble else str(p)
            if out:
                first_label, first = out[0]
                if tokenizer_hashes(m.get("tokenizers")) != tokenizer_hashes(first.get("tokenizers")):
                    raise UserError(f"{label}: its tokenizers differ from those of {first_label}; "
                                    f"the models of an ensemble must share one vocabulary")
            out.append((label, m))
    return out


def ensemble_checkpoint(paths: list[str | Path]) -> dict:
    """One file holding the models of ``paths`` (checkpoints or ensemble files), to translate with
    their ensemble (``aiayn.decode.adapter.EnsembleDecoder``). Their tokenizers must be the same
    (the members predict over one vocabulary); training state is left out.
    """
    if not paths:
        raise UserError("no checkpoints to put in an ensemble")
    members = checkpoint_members(paths)
    return {"format": ENSEMBLE_FORMAT, "members": [{k: v for k, v in m.items() if k not in TRAINING_STATE}
                                                   for _, m in members],
            "ensembled_from": [label for label, _ in members]}
