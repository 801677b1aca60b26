"""Fine-tuning: a new run that starts from a trained model's weights (``aiayn train --init-from``).

The data directory must be encoded with the model's own tokenizer(s) (``aiayn prepare
--tokenizer-from MODEL.pt``): the same SentencePiece model(s), by sha256, so every id means what
it meant in training. The model configuration must be the checkpoint's, up to the fields that do
not change its parameters or its function at inference (``aiayn.checkpoint.REGULARIZATION_FIELDS``:
dropout), so a fine-tuning run may change dropout. What is loaded:

- the weights, always;
- with ``resume_optimizer``, Adam's moments and step counts too (the new run's Adam settings --
  betas, epsilon, weight decay -- are kept); the learning-rate schedule (Eq. 3) starts at step 1
  of the new run either way, as does the step count, the data order and the RNG.

A run directory that already holds ``last.pt`` resumes that run instead (the checkpoint named by
``--init-from`` is then not read).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from aiayn.config import to_dict
from aiayn.errors import UserError
from aiayn.model.config import ModelConfig
from aiayn import checkpoint as ck

log = logging.getLogger(__name__)


def check_tokenizers(ckpt: dict, path: Path, tokenizers: dict) -> None:
    """The data directory's tokenizers (``tokenizer_payload``) must be the checkpoint's; the error
    names the side(s) that differ and how to prepare the data."""
    saved, here = ck.tokenizer_hashes(ckpt.get("tokenizers")), ck.tokenizer_hashes(tokenizers)
    bad = [f"{side} tokenizer (sha256 {str(a)[:12]} in the checkpoint, {str(b)[:12]} in the data directory)"
           for side, a, b in zip(("source", "target"), saved, here) if a != b]
    if bad:
        raise UserError(f"{path}: the {' and the '.join(bad)} differ; encode the new text with the model's own "
                        f"tokenizer: aiayn prepare --tokenizer-from {path} ...")


def check_model(ckpt: dict, path: Path, model_config: ModelConfig, model: torch.nn.Module) -> None:
    """The run's model configuration and parameter shapes must be the checkpoint's (up to
    ``aiayn.checkpoint.REGULARIZATION_FIELDS``); the error lists every field or parameter that differs."""
    # (fields the checkpoint predates: their defaults)
    fields = [f"{k} {a!r} in the checkpoint, {b!r} here"
              for k, a, b in ck.model_differences(ckpt.get("model_config") or {}, to_dict(model_config))]
    if fields:
        raise UserError(f"{path}: a different model: " + "; ".join(fields)
                        + " (without --preset/--recipe, the run takes the checkpoint's configuration)")
    state = ckpt["model"]
    own = model.state_dict()
    shapes = [f"{k} {tuple(state[k].shape) if k in state else 'missing'} in the checkpoint, {tuple(v.shape)} here"
              for k, v in own.items() if k not in state or state[k].shape != v.shape]
    shapes += [f"{k} only in the checkpoint" for k in state if k not in own]
    if shapes:
        raise UserError(f"{path}: parameter shapes differ: " + "; ".join(shapes[:5])
                        + (f" (and {len(shapes) - 5} more)" if len(shapes) > 5 else ""))


def init_from(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer, model_config: ModelConfig,
              tokenizers: dict, resume_optimizer: bool = False) -> dict:
    """Load the weights of checkpoint ``path`` into ``model`` (and, with ``resume_optimizer``, its
    Adam state into ``opt``) after checking tokenizers and shapes (module docstring). Returns the
    new run's lineage (``Contents.lineage``): the checkpoint's, so that models fine-tuned from one run
    average with each other and with it; for a checkpoint without one, that of its weights (seed None)."""
    path = Path(path)
    ckpt = ck.load_checkpoint(path)
    check_tokenizers(ckpt, path, tokenizers)
    check_model(ckpt, path, model_config, model)
    model.load_state_dict(ckpt["model"])
    if resume_optimizer:
        if not ckpt.get("optimizer"):
            raise UserError(f"{path}: the checkpoint holds no optimizer state (an average, an export, or the "
                            f"moving average a train.ema_decay run keeps as ema.pt and best.pt?); drop "
                            f"--resume-optimizer, or give the run's last.pt")
        settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        try:
            opt.load_state_dict(ckpt["optimizer"])
        except ValueError as exc:
            raise UserError(f"{path}: its optimizer state does not fit this model: {exc}") from exc
        for group, own in zip(opt.param_groups, settings):
            group.update(own)  # this run's betas, epsilon and weight decay
    log.info("initialized from %s (step %s)%s", path, ckpt.get("step"),
             ", with its optimizer state" if resume_optimizer else "")
    return ckpt.get("lineage") or ck.run_lineage(ckpt["model"], None)
