"""Checkpoints: what they hold (``contents``: one dataclass, the table of docs/checkpoints.md), the
file format (``format``: sealed, atomically written, loaded without running code, upgraded), §6.1's
average of one run's checkpoints (``average``) and a run directory's checkpoints (``run``: the run's
counters, saved and restored exactly).

The file format's functions are this package's own names (``from aiayn.checkpoint import
load_checkpoint``); ``run`` is imported by the training loop alone.
"""
from aiayn.checkpoint.contents import FORMAT, Contents
from aiayn.checkpoint.format import (CHECKSUM, ENSEMBLE_FORMAT, SAFE_TORCH, STEP_RE, TRAINING_STATE, atomic_copy,
                                     atomic_save, check_model_config, check_torch, checkpoint_members, content_sha256,
                                     ensemble_checkpoint, load_checkpoint, prune, rng_state_from_legacy, sealed,
                                     step_checkpoints, tokenizer_hashes, upgrade_checkpoint, verify)
from aiayn.checkpoint.average import REGULARIZATION_FIELDS, average_checkpoints, model_differences, run_lineage

__all__ = ["CHECKSUM", "Contents", "ENSEMBLE_FORMAT", "FORMAT", "REGULARIZATION_FIELDS", "SAFE_TORCH", "STEP_RE",
           "TRAINING_STATE", "atomic_copy", "atomic_save", "average_checkpoints", "check_model_config",
           "check_torch", "checkpoint_members", "content_sha256", "ensemble_checkpoint", "load_checkpoint",
           "model_differences", "prune", "rng_state_from_legacy", "run_lineage", "sealed", "step_checkpoints",
           "tokenizer_hashes", "upgrade_checkpoint", "verify"]
