"""§6.1's checkpoint average, of one run's checkpoints (or of models fine-tuned from one checkpoint):
``average_checkpoints``; a run's identity, which says it (``run_lineage``, ``Contents.lineage``;
docs/checkpoints.md, "Averaging checkpoints of one run").
"""
from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from aiayn.checkpoint.contents import CHECKSUM
from aiayn.checkpoint.format import TRAINING_STATE, content_sha256, load_checkpoint, tokenizer_hashes
from aiayn.errors import UserError
from aiayn.model.config import ModelConfig

log = logging.getLogger(__name__)


# Fields that change neither a model's parameters nor what it computes at inference (dropout): a
# fine-tuning run may set them apart from its checkpoint (``aiayn.train.finetune``), and checkpoints
# that differ only in them are one model to ``average_checkpoints``.
REGULARIZATION_FIELDS = ("p_drop", "p_drop_attn", "p_drop_ffn")


def model_differences(saved: dict, here: dict) -> list[tuple[str, object, object]]:
    """The fields, REGULARIZATION_FIELDS aside, in which two configurations (``to_dict`` of a
    ModelConfig; a field missing from either read as its default) differ: (field, saved's, here's)."""
    default = {f.name: f.default for f in fields(ModelConfig)}
    saved, here = {**default, **saved}, {**default, **here}
    return [(k, saved.get(k), here.get(k)) for k in {**saved, **here}
            if k not in REGULARIZATION_FIELDS and saved.get(k) != here.get(k)]


def average_checkpoints(paths: list[str | Path], across_runs: bool = False) -> dict:
    """Mean of the model parameters of ``paths`` in float32 (§6.1); everything else from the last.
    A progress bar counts the checkpoints read (``aiayn.progress``).

    The checkpoints must be of one run, or of runs begun from one checkpoint (fine-tuned from it): the
    mean of weights that started apart is no model. Their ``lineage`` says it (``one_run``): a file of
    another run is refused (``across_runs``: warned of); a file without one, warned of.

    The result loads like any other checkpoint (for inference; it carries no optimizer).
    """
    if not paths:
        raise UserError("no checkpoints to average")
    from aiayn.progress import progress_bar
    total: dict[str, torch.Tensor] | None = None
    last = None
    lineages = []
    with progress_bar(len(paths), unit=" checkpoints", desc="average") as bar:
        for p in paths:
            ckpt = load_checkpoint(p)
            state = ckpt["model"]
            if total is None:
                total = {k: v.detach().to(torch.float32).clone() if v.is_floating_point() else v.clone()
                         for k, v in state.items()}
                ref_cfg, ref_toks = ckpt.get("model_config"), tokenizer_hashes(ckpt.get("tokenizers"))
            else:
                differ = _model_differences(ref_cfg, ckpt.get("model_config"))
                if differ or set(state) != set(total):
                    raise UserError(f"{p}: a different model from {paths[0]}"
                                    + (f" ({differ})" if differ else "") + "; cannot average")
                if tokenizer_hashes(ckpt.get("tokenizers")) != ref_toks:
                    raise UserError(f"{p}: trained with other tokenizers than {paths[0]}; cannot average")
                for k, v in state.items():
                    if v.is_floating_point():
                        total[k] += v.to(torch.float32)
            lineages.append((p, ckpt.get("lineage")))
            one_run(lineages, across_runs)  # refused as soon as read
            last = ckpt
            bar.update(1)
    n = len(paths)
    model = {k: (v / n if v.is_floating_point() else v) for k, v in total.items()}
    out = {k: v for k, v in last.items() if k not in (*TRAINING_STATE, CHECKSUM, "lineage")}
    out["model"] = model
    lineage = one_run(lineages, across_runs=True, warn=True)
    if lineage is not None:  # the run's: a model fine-tuned from the average is of it too
        out["lineage"] = lineage
    out["averaged_from"] = [str(p) for p in paths]
    return out


def _model_differences(ref: Any, cfg: Any) -> str:
    """How the model configuration ``cfg`` differs from the first checkpoint's ``ref``, dropout aside
    (``REGULARIZATION_FIELDS``: a model fine-tuned with another dropout is the same model), as
    "d_ff 256 there, 128 here"; "" where they are one model."""
    if not (isinstance(ref, dict) and isinstance(cfg, dict)):
        return "" if ref == cfg else "another model configuration"
    return "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in model_differences(ref, cfg))


def run_lineage(weights: dict, seed: int | None) -> dict:
    """A run's identity (``Contents.lineage``): its seed and the checksum of the weights it starts from
    (``content_sha256``), the same for every checkpoint it writes and every run begun from one of them."""
    return {"seed": seed, "init_sha256": content_sha256(weights)}


def one_run(lineages: list[tuple[Path, dict | None]], across_runs: bool = False, warn: bool = False) -> dict | None:
    """The lineage the checkpoints ``lineages`` ((file, its ``lineage``), in order) share, or None.
    A file whose weights started elsewhere than the first's is a UserError (``across_runs``: a warning
    where ``warn``); files without one (written before the key, imports) are warned of where ``warn``."""
    known = [(p, g) for p, g in lineages if g is not None]
    for p, g in known[1:]:
        first, was = known[0]
        if _start(g) != _start(was):
            said = (f"{p}: of another run than {first} ({_named(g)}; {_named(was)}): the mean of weights that "
                    f"started apart is no model; average one run's checkpoints, or models fine-tuned from one")
            if not across_runs:
                raise UserError(said + " (--across-runs to average them anyway)")
            if warn:
                log.warning("%s", said)
            return None
    unknown = [str(p) for p, g in lineages if g is None]
    if unknown and len(lineages) > 1:
        if warn:
            log.warning("%s: no lineage (written before checkpoints recorded their run, or imported): whether the "
                        "checkpoints averaged are of one run is not checked; the mean of different runs' weights is "
                        "no model", ", ".join(unknown))
        return None
    return known[0][1] if known else None


def _start(lineage: Any) -> Any:
    """What says where a run's weights started: ``init_sha256`` (the seed aside: a run begun from a
    checkpoint is of that checkpoint's run, whatever its own seed)."""
    return lineage.get("init_sha256") if isinstance(lineage, dict) else lineage


def _named(lineage: Any) -> str:
    if not isinstance(lineage, dict):
        return f"lineage {lineage!r}"
    return f"seed {lineage.get('seed')}, initial weights {str(lineage.get('init_sha256'))[:12]}"
