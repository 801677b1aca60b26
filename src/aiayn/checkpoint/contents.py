"""What a training checkpoint holds: ``Contents``, one field per key of the file's dict, in the order
they are written. Saving (``run.save``), resuming (``run.Learner.restore``), upgrading an older file
(``format.upgrade_checkpoint``) and the table of docs/checkpoints.md all derive from these fields
(tests/train/test_checkpoints.py checks the table against them).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from aiayn.errors import UserError

FORMAT = "aiayn-checkpoint-1"
CHECKSUM = "sha256"  # the key of the content checksum (``format.content_sha256``) in every file's dict
_REQUIRED = dataclasses.MISSING


def _key(help: str, default: Any = _REQUIRED) -> Any:
    """A key of the checkpoint with its help text (the docs table's "what"); a default where files
    written before the key existed lack it."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class Contents:
    """A training checkpoint (the step's, ``last.pt``); an inference-only file (an average, an
    ensemble's member, ``ema.pt``, an import) holds the same keys without the training state."""

    format: str = _key('`"aiayn-checkpoint-1"` (an ensemble file: `"aiayn-ensemble-1"` with `members`, a list of '
                       'such dicts without training state)', FORMAT)
    run_config: dict = _key("the `RunConfig` (model and train sections) as a dict")
    model_config: dict = _key("its model section, as a dict: what a reader builds the model from")
    model: dict = _key("the state dict of the unwrapped module (no `module.` prefixes; float32 for averages)")
    optimizer: dict = _key("Adam's state (the main rank's)")
    rank_optimizers: list | None = _key("local SGD: every rank's own Adam state, in rank order; else None", None)
    scaler: dict | None = _key("fp16's gradient scaler; else None", None)
    sampler: dict = _key("the data position: the epoch and `batches_done`, how many batches of the epoch's order "
                         "all ranks together have trained, so a resumed run draws the batches it would have drawn, "
                         "on any number of processes; `segmentation`, the SHA-256 of the BPE-dropout segmentation "
                         "the epoch is cut on (null: the stored one)")
    rng: dict = _key("the generator states (`runtime.rng_state`): torch's CPU generator, numpy's and Python's "
                     "`random` (their Mersenne Twister words as int64 tensors), the current CUDA device's generator")
    rank_rng: list | None = _key("in a data-parallel run, every rank's `rng`, in rank order (each rank draws its own "
                                 "dropout masks); None in one process", None)
    tokenizers: dict = _key("the SentencePiece model bytes and their SHA-256 (source and target)")
    step: int = _key("optimizer steps taken")
    epoch: int = _key("the epoch of the last step's batches")
    tokens: int = _key("target tokens trained on, all processes")
    flops: float = _key("counted training FLOPs, all processes (what a FLOPs budget counts)")
    train_seconds: float = _key("training wall time, validation included")
    best_valid_loss: float = _key("the best validation loss so far")
    best_valid_bleu: float = _key("the best validation BLEU so far (`train.valid_bleu`)", -math.inf)
    bad_validations: int = _key("validations in a row without a gain in the metric `best.pt` follows (what patience "
                                "counts)")
    valid: dict | None = _key("the last validation's metrics, or None")
    valid_seconds: float = _key("of `train_seconds`, spent validating", 0.0)
    valid_bleu_seconds: float = _key("of `valid_seconds`, spent translating for `valid_bleu`", 0.0)
    ema: dict | None = _key("the moving average of the weights, or None; `ema.pt` holds it as its `model`", None)
    lineage: dict | None = _key("the run's identity, what `aiayn average` compares: `seed`, the run's "
                                "`train.seed`, and `init_sha256`, the checksum (`content_sha256`) of the weights it "
                                "started from; a run started with `--init-from` carries its checkpoint's (where that "
                                "has none: seed None and the checksum of its weights); None in a run begun before "
                                "the key", None)
    written_by: dict | None = _key("the code that wrote the file (`host.environment.written_by`): `aiayn`, its "
                                   "version; `source`, the git commit of the checkout it ran from and whether that "
                                   "was `modified` (null for an installed copy); `torch`, its version. An average "
                                   "keeps its last member's; an import names the importing code; None in a file "
                                   "written before the key", None)

    def to_dict(self) -> dict:
        """The file's dict, keys in field order (the tensors themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, ckpt: dict, path: Any = "checkpoint") -> "Contents":
        """A training checkpoint's keys (``with_defaults``: an older file's missing ones filled in),
        each of its field's type; ``sha256`` is left out. A file that is no training checkpoint (an
        average, ``ema.pt``, an import: no optimizer) or holds a key of another type or one this
        version does not know is a UserError naming ``path`` and the key."""
        hints = typing.get_type_hints(cls)
        ckpt = with_defaults(ckpt)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in ckpt and f.default is _REQUIRED]
        if missing:
            raise UserError(f"{path}: not a training checkpoint: it lacks {', '.join(missing)} (an average, "
                            f"ema.pt or an import holds weights only; start a run from it with --init-from)")
        unknown = [k for k in ckpt if k not in hints and k != CHECKSUM]
        if unknown:
            raise UserError(f"{path}: holds key(s) {', '.join(map(str, unknown))}, which this version of aiayn "
                            f"does not know (written by a newer one?); resuming would drop them")
        wrong = [f"{k} is {type(ckpt[k]).__name__}, not {_type_name(hints[k])}" for k in hints
                 if not _is_a(ckpt[k], hints[k])]
        if wrong:
            raise UserError(f"{path}: not a training checkpoint as aiayn writes one: " + "; ".join(wrong[:3]))
        return cls(**{k: v for k, v in ckpt.items() if k in hints})


def _is_a(value: Any, kind: Any) -> bool:
    """Whether a checkpoint's ``value`` is of its field's annotated ``kind`` (an int is a float; a
    bool is neither an int nor a float)."""
    if isinstance(kind, types.UnionType):
        return any(_is_a(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind if kind is int else isinstance(value, kind)


def _type_name(kind: Any) -> str:
    return " or ".join(_type_name(k) for k in typing.get_args(kind)) if isinstance(kind, types.UnionType) \
        else "None" if kind is type(None) else kind.__name__


def with_defaults(ckpt: dict) -> dict:
    """``ckpt`` with the keys that files written before them lack, at their defaults, in the fields'
    order (a training checkpoint only: one that holds an optimizer state)."""
    if "optimizer" not in ckpt:
        return ckpt
    ordered = {f.name: ckpt.get(f.name, f.default) for f in dataclasses.fields(Contents)
               if f.name in ckpt or f.default is not _REQUIRED}
    return {**ordered, **{k: v for k, v in ckpt.items() if k not in ordered}}


def docs_table() -> str:
    """The table of docs/checkpoints.md: one row per key."""
    rows = [f"| `{f.name}` | {f.metadata['help']} |" for f in dataclasses.fields(Contents)]
    return "\n".join(["| key | what |", "|---|---|", *rows])
