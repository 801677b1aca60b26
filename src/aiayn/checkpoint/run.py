"""A run directory's checkpoints (docs/checkpoints.md): ``TrainState`` (what a run counts); the resume,
in three parts: ``last_checkpoint`` (``last.pt``, or the newest intact step checkpoint, checked against
the run), the batch stream started at its data position, and ``Learner.restore`` (model, optimizer,
scaler and generators; the moving average is made from the saved one), so that a resumed run
continues exactly; ``save`` (the step's checkpoint, ``last.pt``, ``best.pt``, ``ema.pt``, written
atomically) and ``RunCheckpoints``, the training loop's, which writes them when due. Every key
written is a field of ``contents.Contents``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from aiayn.checkpoint.contents import Contents
from aiayn.checkpoint.format import (TRAINING_STATE, atomic_copy, atomic_save, load_checkpoint, prune,
                                     step_checkpoints, tokenizer_hashes)
from aiayn.data.dataset import DataDir
from aiayn.config import from_dict, to_dict
from aiayn.errors import UserError
from aiayn.files import write_json_atomic
from aiayn.host.environment import written_by
from aiayn.model.config import ModelConfig
from aiayn.train import runtime as rt

if TYPE_CHECKING:
    from aiayn.train.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a run counts between its steps, kept in every checkpoint (``Contents``' fields of the
    same names)."""
    step: int = 0
    epoch: int = 0
    tokens: int = 0  # target tokens trained on (all devices)
    flops: float = 0.0
    best_valid_loss: float = math.inf
    best_valid_bleu: float = -math.inf
    bad_validations: int = 0  # in a row without a gain in train.best_metric
    train_seconds: float = 0.0
    valid_seconds: float = 0.0  # of train_seconds, spent validating (loss and valid_bleu)
    valid_bleu_seconds: float = 0.0  # of valid_seconds, spent translating for valid_bleu
    history: list = field(default_factory=list)  # (step, loss per token) of every step; not saved

    def counters(self) -> dict:
        """The counters a checkpoint keeps (all but ``history``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "history"}

    @classmethod
    def of(cls, saved: Contents) -> "TrainState":
        return cls(**{k: getattr(saved, k) for k in cls().counters()})


@dataclass
class Learner:
    """What a step changes and a checkpoint restores besides the data position: the model, its
    optimizer, fp16's gradient scaler and the moving average of the weights (``train.ema_decay``,
    an ``aiayn.train.ema.WeightAverage``; each None where the run has none); and the run's lineage,
    which no step changes (``Contents.lineage``; None for a run begun before checkpoints kept one)."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None = None
    ema: Any = None
    lineage: dict | None = None
    # the model's parameters, listed once: every step reads their gradients, and walking the module
    # tree each time is host time that a small model's GPU step waits for
    params: list = field(init=False, repr=False)

    def __post_init__(self):
        self.params = list(self.model.parameters())

    def averaged(self):
        """The weights a validation reads: the moving average's inside the block, where there is one."""
        return self.ema.weights() if self.ema is not None else contextlib.nullcontext()

    def restore(self, saved: Contents, dist: rt.Dist) -> None:
        """The weights, the optimizer (the main rank's: ranks that share their gradients stay equal
        only with equal Adam moments; a run that keeps one per rank takes its own after,
        ``own_optimizer``), the scaler, this process's generators (its own, where every rank's
        were kept) and the lineage from ``saved``."""
        self.model.load_state_dict(saved.model)
        self.lineage = saved.lineage
        self.opt.load_state_dict(saved.optimizer)
        if self.scaler is not None and saved.scaler:
            self.scaler.load_state_dict(saved.scaler)
        rt.set_rng_state(_own(saved.rank_rng, dist) or saved.rng)


class Resumed(NamedTuple):
    """The checkpoint a run resumes from: its file (``last.pt``, or a step checkpoint where that is
    damaged or lost) and what it holds."""
    path: Path
    saved: Contents


def last_checkpoint(run_dir: Path, tokenizers: dict, model: ModelConfig) -> Resumed | None:
    """The checkpoint a run directory resumes from (``resume_checkpoint``), or None where it holds none
    (a new run). Refused where its model configuration is not ``model`` or its tokenizers are not
    ``tokenizers`` (``tokenizer_payload``)."""
    if not ((run_dir / "last.pt").exists() or step_checkpoints(run_dir)):  # (last.pt lost: a step checkpoint)
        return None
    path, ckpt = resume_checkpoint(run_dir)
    saved = Contents.from_dict(ckpt, path)
    was = from_dict(ModelConfig, saved.run_config["model"])
    if was != model:
        changed = ", ".join(f"model.{f.name} {getattr(was, f.name)!r}, now {getattr(model, f.name)!r}"
                            for f in dataclasses.fields(ModelConfig) if getattr(was, f.name) != getattr(model, f.name))
        raise UserError(f"{run_dir}: the run was trained with another model ({changed}); resume with its settings "
                        f"(--recipe {run_dir / 'config.json'}) or train a new run with another --out")
    if tokenizer_hashes(saved.tokenizers) != tokenizer_hashes(tokenizers):
        raise UserError(f"{run_dir}: the run was trained with a different tokenizer than this data directory's")
    return Resumed(path, saved)  # (the main rank says it: ``resumed``)


def tokenizer_payload(data: DataDir) -> dict:
    """The tokenizer model(s), stored inside every checkpoint so it is self-contained."""
    src, tgt = data.src_tokenizer, data.tgt_tokenizer
    return {"src": src.model_bytes, "tgt": tgt.model_bytes, "src_sha256": src.sha256,
            "tgt_sha256": tgt.sha256, "shared": data.shared_vocab}


def save(run_dir: Path, saved: Contents, keep_last: int, best: bool, ema_decay: float | None,
         step_file: bool = True) -> None:
    """Checkpoint the run (main rank): the step's checkpoint, ``ema.pt`` where ``saved`` holds a moving
    average (of ``ema_decay``; None without one), ``best.pt`` if ``best`` (the weights validated:
    ``ema.pt``'s with one), ``last.pt``; then the oldest step checkpoints beyond ``keep_last`` are removed.
    Without ``step_file`` (a best validation between checkpoints) ``last.pt`` is written in its place and
    nothing is pruned: the step checkpoints, which §6.1's average reads, keep their cadence."""
    ckpt = saved.to_dict()
    first = run_dir / (f"ckpt_step{saved.step:08d}.pt" if step_file else "last.pt")
    atomic_save(ckpt, first)  # serialized and checksummed once; the others are copies
    if saved.ema is not None:  # the averaged weights as a checkpoint of their own, for translate and evaluate
        inference = {k: v for k, v in ckpt.items() if k not in (*TRAINING_STATE, "ema")}
        atomic_save({**inference, "model": saved.ema, "ema_decay": ema_decay}, run_dir / "ema.pt")
    if best:  # the weights validated: the moving average where there is one
        atomic_copy(run_dir / "ema.pt" if saved.ema is not None else first, run_dir / "best.pt")
    if step_file:
        atomic_copy(first, run_dir / "last.pt")  # last, so a resume always finds a complete state
        prune(run_dir, keep_last)


def resume_checkpoint(run_dir: Path) -> tuple[Path, dict]:
    """``last.pt``, or if it is damaged (or unreadable) the newest intact step checkpoint, with a
    warning: (the file, its checkpoint); the error of ``last.pt`` if none is intact."""
    try:
        return run_dir / "last.pt", load_checkpoint(run_dir / "last.pt")
    except UserError as exc:
        for path in reversed(step_checkpoints(run_dir)):
            try:
                ckpt = load_checkpoint(path)
            except UserError as other:
                log.warning("%s", other)
                continue
            log.warning("%s; resuming from %s (step %d) instead", exc, path, ckpt["step"])
            return path, ckpt
        raise


def merit(valid: dict, best_metric: str) -> float:
    """A validation's value in ``train.best_metric``, higher better: BLEU, or the loss negated."""
    return valid["valid_bleu"] if best_metric == "bleu" else -valid["valid_loss"]


def best_merit(state: TrainState, best_metric: str) -> float:
    """The run's best ``merit`` so far."""
    return state.best_valid_bleu if best_metric == "bleu" else -state.best_valid_loss


class RunCheckpoints:
    """One run's checkpoints in its run directory: its ``config.json``, written when they are made,
    then checkpoints written when due (``save``). Every rank calls them; the main rank writes the files.
    ``cfg``: the run's configuration, recorded whole in ``config.json`` and every checkpoint; of its
    train section the checkpoints follow ``keep_last`` and ``best_metric``. ``resume``: the checkpoint
    the run resumed from (restored already; None: a new run), whose lines the main rank prints first
    (``resumed``)."""

    def __init__(self, run_dir: Path, cfg: RunConfig, tokenizers: dict, dist: rt.Dist, learner: Learner, stream,
                 resume: Resumed | None = None):
        self.run_dir, self.tokenizers, self.dist = run_dir, tokenizers, dist
        self.keep_last, self.best_metric = cfg.train.keep_last, cfg.train.best_metric
        self.learner, self.stream = learner, stream
        if dist.is_main and resume is not None:
            resumed(run_dir, resume, stream.state_dict(), stream.accum_steps, dist.world_size)
        self.run_config = to_dict(cfg)
        if dist.is_main:  # made once resumed: a refused resume leaves the run directory's config.json as it was
            write_json_atomic(run_dir / "config.json", self.run_config)

    def is_best(self, state: TrainState, valid: dict | None) -> bool:
        """Whether the validation ``valid`` ties or beats the best in ``train.best_metric`` (``Validator``
        has counted it in ``state`` already): ``best.pt`` is written with it."""
        return valid is not None and merit(valid, self.best_metric) >= best_merit(state, self.best_metric)

    def save(self, state: TrainState, valid: dict | None, rank_optimizers: list | None = None,
             step_file: bool = True) -> None:
        """The run's state at ``state.step``, after the validation ``valid`` (None: none at this step):
        ``best.pt`` too where it ties or beats the best in ``train.best_metric`` (``Validator`` has
        counted it already); non-finite weights refused (``check_finite_weights``). ``rank_optimizers``:
        local SGD's every rank's own Adam state, in rank order, so that each rank resumes with its own
        moments (None: the ranks share one); a data-parallel run gathers every rank's generator states
        (each rank's dropout masks are its own). Old BPE-dropout segmentations are pruned after."""
        dist, learner = self.dist, self.learner
        is_best = self.is_best(state, valid)
        check_finite_weights(learner.model, state.step, self.run_dir)
        rank_rng = rt.gather_to_main(rt.rng_state(), dist) if dist.enabled else None
        if dist.is_main:
            saved = Contents(
                run_config=self.run_config, model_config=self.run_config["model"],
                model=learner.model.state_dict(),
                optimizer=rank_optimizers[0] if rank_optimizers else learner.opt.state_dict(),
                rank_optimizers=rank_optimizers,
                scaler=learner.scaler.state_dict() if learner.scaler is not None else None,
                sampler=self.stream.state_dict(), rng=rank_rng[0] if rank_rng else rt.rng_state(),
                rank_rng=rank_rng, tokenizers=self.tokenizers, valid=valid,
                ema=learner.ema.state_dict() if learner.ema is not None else None, lineage=learner.lineage,
                written_by=written_by(), **state.counters())
            save(self.run_dir, saved, self.keep_last, is_best, learner.ema.decay if learner.ema is not None else None,
                 step_file)
            self.stream.saved()


def own_optimizer(opt: torch.optim.Optimizer, saved: Contents, dist: rt.Dist, per_rank: bool) -> None:
    """After ``Learner.restore``, which gave every rank the main rank's optimizer: this rank's own,
    where the run keeps one per rank (``per_rank``: local SGD) and ``saved`` kept one for each of as
    many ranks. A run that shares one resumed from such a checkpoint keeps the main rank's, said once."""
    own = _own(saved.rank_optimizers, dist)
    if own is not None and per_rank:
        opt.load_state_dict(own)
    elif own is not None and dist.is_main:
        log.warning("the checkpoint kept an Adam state per rank (local SGD); this run shares one among its ranks: "
                    "the main rank's")


def _own(per_rank: list | None, dist: rt.Dist):
    """This rank's entry of a per-rank list saved by as many ranks as there are now, else None."""
    return per_rank[dist.rank] if per_rank and len(per_rank) == dist.world_size else None


def resumed(run_dir: Path, resume: Resumed, position: dict, accum: int, world_size: int) -> None:
    """The main rank's lines of a resume: on another number of processes, the one warning of what
    cannot carry over (``position``: the data position resumed from, on these ranks); then the line
    that says the run resumes."""
    saved = resume.saved
    ranks = int(saved.sampler["num_replicas"])
    if ranks != world_size:
        _warn_other_ranks(run_dir, saved, position, accum, world_size)
    print(f"resuming from {resume.path} at step {saved.step} (epoch {saved.epoch})", flush=True)


def _warn_other_ranks(run_dir: Path, saved: Contents, position: dict, accum: int, world_size: int) -> None:
    ranks = int(saved.sampler["num_replicas"])
    saved_accum = saved.run_config["train"].get("accum_steps", 1)  # (1: a run of before the field)
    log.warning("%s: trained by %d process(es), resumed by %d: the rest of epoch %d (from batch %d of %d of its "
                "order) is dealt out to %d rank(s); every rank starts from the main rank's generator states%s "
                "(dropout masks differ from the saved run's); a step holds %d batches, was %d (train.accum_steps)",
                run_dir, ranks, world_size, position["epoch"], position["batches_done"],
                position["n_batches_total"], world_size, " and Adam moments (local SGD kept one per rank)"
                if saved.rank_optimizers else "", world_size * accum, ranks * saved_accum)


def last_good(run_dir: Path) -> str:
    """The sentence naming the run's last good checkpoint, for a run stopped on non-finite numbers (none
    may have been written yet)."""
    last = run_dir / "last.pt"
    return f"The last good checkpoint is {last}" if last.is_file() else f"No checkpoint is in {run_dir} yet"


def check_finite_weights(model, step: int, run_dir: Path) -> None:
    """Refuse to checkpoint non-finite weights: the files already written stay the last good ones."""
    finite = torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()
    if not bool(finite):
        raise UserError(f"step {step}: the model holds non-finite weights; not checkpointing them. "
                        f"{last_good(run_dir)}")
