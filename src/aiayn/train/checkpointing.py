"""The run's state in its run directory (docs/checkpoints.md): ``TrainState`` (what a run counts),
``save`` (the step's checkpoint, ``last.pt``, ``best.pt``, ``ema.pt``, written atomically), and
``restore`` (model, optimizer, scaler, batch stream, RNG and counters from ``last.pt``, or from the
newest intact step checkpoint), so that a resumed run continues exactly; and ``RunCheckpoints``,
the training loop's: a run directory restored or a new run started (from another checkpoint's
weights), then its checkpoints written when due.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aiayn import checkpoint as ck
from aiayn.config import to_dict
from aiayn.data.dataset import DataDir
from aiayn.data.stream import BatchStream
from aiayn.errors import UserError
from aiayn.files import write_json_atomic
from aiayn.train import runtime as rt
from aiayn.train.config import RunConfig, run_config_from_dict
from aiayn.train.validation import best_merit, merit

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a run counts between its steps, kept in every checkpoint."""
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
    history: list = field(default_factory=list)  # (step, loss per token) of every step


def tokenizer_payload(data: DataDir) -> dict:
    """The tokenizer model(s), stored inside every checkpoint so it is self-contained."""
    src, tgt = data.src_tokenizer, data.tgt_tokenizer
    return {"src": src.model_bytes, "tgt": tgt.model_bytes, "src_sha256": src.sha256,
            "tgt_sha256": tgt.sha256, "shared": data.shared_vocab}


def save(run_dir: Path, model, opt, scaler, sampler_state: dict, state: TrainState, cfg: RunConfig,
         tokenizers: dict, keep_last: int, valid: dict | None, best: bool, rank_optimizers: list | None = None,
         rank_rng: list | None = None, ema: dict | None = None) -> None:
    """Checkpoint the run (main rank): the step's checkpoint, ``ema.pt`` with ``ema``, ``best.pt`` if
    ``best`` (the weights validated: ``ema.pt``'s with ``ema``), ``last.pt``.
    ``rank_optimizers``: local SGD's every rank's own Adam state, in rank order, so that each rank
    resumes with its own moments (None: the ranks share one); its first is the main rank's, written once.
    ``rank_rng``: every rank's generator states in rank order (data-parallel runs; each rank's
    dropout masks are its own), so that each rank resumes with its own. ``ema``: the moving average
    of the weights (``train.ema_decay``) as a state dict, kept in the checkpoint and written to ``ema.pt``."""
    ckpt = {
        "format": ck.FORMAT, "run_config": to_dict(cfg), "model_config": to_dict(cfg.model),
        "model": model.state_dict(), "optimizer": rank_optimizers[0] if rank_optimizers else opt.state_dict(),
        "rank_optimizers": rank_optimizers,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": sampler_state, "rng": rank_rng[0] if rank_rng else rt.rng_state(),
        "rank_rng": rank_rng, "tokenizers": tokenizers,
        "step": state.step, "epoch": state.epoch, "tokens": state.tokens, "flops": state.flops,
        "train_seconds": state.train_seconds, "best_valid_loss": state.best_valid_loss,
        "best_valid_bleu": state.best_valid_bleu, "bad_validations": state.bad_validations, "valid": valid,
        "valid_seconds": state.valid_seconds, "valid_bleu_seconds": state.valid_bleu_seconds,
        "ema": ema,
    }
    step_path = run_dir / f"ckpt_step{state.step:08d}.pt"
    ck.atomic_save(ckpt, step_path)  # serialized and checksummed once; the others are copies
    if ema is not None:  # the averaged weights as a checkpoint of their own, for translate and evaluate
        inference = {k: v for k, v in ckpt.items() if k not in (*ck.TRAINING_STATE, "ema")}
        ck.atomic_save({**inference, "model": ema, "ema_decay": cfg.train.ema_decay}, run_dir / "ema.pt")
    if best:  # the weights validated: the moving average where there is one
        ck.atomic_copy(run_dir / "ema.pt" if ema is not None else step_path, run_dir / "best.pt")
    ck.atomic_copy(step_path, run_dir / "last.pt")  # last, so a resume always finds a complete state
    ck.prune(run_dir, keep_last)


def resume_checkpoint(run_dir: Path) -> dict:
    """``last.pt``, or if it is damaged (or unreadable) the newest intact step checkpoint, with a
    warning; the error of ``last.pt`` if none is intact."""
    try:
        return ck.load_checkpoint(run_dir / "last.pt")
    except UserError as exc:
        for path in reversed(ck.step_checkpoints(run_dir)):
            try:
                ckpt = ck.load_checkpoint(path)
            except UserError as other:
                log.warning("%s", other)
                continue
            log.warning("%s; resuming from %s (step %d) instead", exc, path, ckpt["step"])
            return ckpt
        raise


def restore(run_dir: Path, model, opt, scaler, stream: BatchStream, cfg: RunConfig, tokenizers: dict,
            rank: int = 0, world_size: int = 1) -> tuple[TrainState, dict | None]:
    """The run directory's state restored into the model, optimizer and batch stream; and its moving
    average of the weights (``train.ema_decay``), if it kept one."""
    ckpt = resume_checkpoint(run_dir)
    saved = run_config_from_dict(ckpt["run_config"])
    if saved.model != cfg.model:
        raise UserError(f"{run_dir}: the run directory holds a different model configuration; "
                        f"use a new --out or the same settings")
    if ck.tokenizer_hashes(ckpt["tokenizers"]) != ck.tokenizer_hashes(tokenizers):
        raise UserError(f"{run_dir}: the run was trained with a different tokenizer than this data directory's")
    model.load_state_dict(ckpt["model"])
    ranks = ckpt.get("rank_optimizers")
    opt.load_state_dict(ranks[rank] if ranks and len(ranks) == world_size else ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    stream.load_state_dict(ckpt["sampler"])
    rngs = ckpt.get("rank_rng")
    rt.set_rng_state(rngs[rank] if rngs and len(rngs) == world_size else ckpt["rng"])
    if rank == 0 and ckpt["sampler"]["num_replicas"] != world_size:
        warn_other_ranks(run_dir, ckpt["sampler"], stream.state_dict(), saved.train.accum_steps,
                         cfg.train.accum_steps, world_size, local_sgd=bool(ranks))
    return TrainState(step=ckpt["step"], epoch=ckpt["epoch"], tokens=ckpt["tokens"], flops=ckpt["flops"],
                      best_valid_loss=ckpt["best_valid_loss"],
                      best_valid_bleu=ckpt.get("best_valid_bleu", -math.inf),
                      bad_validations=ckpt["bad_validations"], train_seconds=ckpt["train_seconds"],
                      valid_seconds=ckpt.get("valid_seconds", 0.0),
                      valid_bleu_seconds=ckpt.get("valid_bleu_seconds", 0.0)), ckpt.get("ema")


class RunCheckpoints:
    """One run's checkpoints in its run directory: the run resumed or started once
    (``resume_or_start``, which also writes the run's ``config.json``), then written when due
    (``save``). Every rank calls both; the main rank reads and writes the files."""

    def __init__(self, run_dir: Path, cfg: RunConfig, tokenizers: dict, dist: rt.Dist, model, opt, scaler,
                 stream: BatchStream):
        self.run_dir, self.cfg, self.tokenizers, self.dist = run_dir, cfg, tokenizers, dist
        self.model, self.opt, self.scaler, self.stream = model, opt, scaler, stream

    def resume_or_start(self, init_from: str | Path | None, resume_optimizer: bool) -> tuple[TrainState, dict | None]:
        """The run directory's state, resumed exactly (``restore``), or a new run's (from ``init_from``'s
        weights, and with ``resume_optimizer`` its Adam state: ``finetune.init_from``); and the moving
        average of the weights the run directory kept, if any. Then the run's ``config.json`` (only
        now: a refused resume leaves the run directory's as it was)."""
        run_dir, dist = self.run_dir, self.dist
        state, saved_ema = TrainState(), None
        if (run_dir / "last.pt").exists() or ck.step_checkpoints(run_dir):  # (last.pt lost: a step checkpoint)
            state, saved_ema = restore(run_dir, self.model, self.opt, self.scaler, self.stream, self.cfg,
                                       self.tokenizers, dist.rank, dist.world_size)
            log.info("resuming from %s at step %d (epoch %d)", run_dir / "last.pt", state.step, state.epoch)
            if dist.is_main:
                print(f"resuming from {run_dir / 'last.pt'} at step {state.step}", flush=True)
        elif init_from is not None:
            from aiayn.train.finetune import init_from as load_init
            load_init(init_from, self.model, self.opt, self.cfg, self.tokenizers, resume_optimizer)
        if dist.is_main:
            write_json_atomic(run_dir / "config.json", to_dict(self.cfg))
        return state, saved_ema

    def save(self, state: TrainState, valid: dict | None, ema=None, local_sgd: bool = False) -> None:
        """The run's state at ``state.step``, after the validation ``valid`` (None: none at this step):
        ``best.pt`` too where it ties or beats the best in ``train.best_metric`` (``track`` has counted
        it already); non-finite weights refused (``check_finite_weights``). Local SGD (``local_sgd``)
        gathers each rank's own Adam state, and a data-parallel run every rank's RNG state; old
        BPE-dropout segmentations are pruned after. ``ema``: the run's ``WeightAverage``, or None."""
        dist, metric = self.dist, self.cfg.train.best_metric
        is_best = valid is not None and merit(valid, metric) >= best_merit(state, metric)
        check_finite_weights(self.model, state.step, self.run_dir)
        rank_opts = rt.gather_to_main(self.opt.state_dict(), dist) if local_sgd else None
        rank_rng = rt.gather_to_main(rt.rng_state(), dist) if dist.enabled else None
        if dist.is_main:
            save(self.run_dir, self.model, self.opt, self.scaler, self.stream.state_dict(), state, self.cfg,
                 self.tokenizers, self.cfg.train.keep_last, valid, is_best, rank_opts, rank_rng,
                 ema.state_dict() if ema is not None else None)
            self.stream.saved()


def warn_other_ranks(run_dir: Path, saved_state: dict, position: dict, saved_accum: int, accum: int,
                     world_size: int, local_sgd: bool) -> None:
    """The one warning of a resume on another number of processes: what cannot carry over
    (``position``: the data position resumed from, on these ranks)."""
    saved = int(saved_state["num_replicas"])
    log.warning("%s: trained by %d process(es), resumed by %d: the rest of epoch %d (from batch %d of %d of its "
                "order) is dealt out to %d rank(s); every rank starts from the main rank's generator states%s "
                "(dropout masks differ from the saved run's); a step holds %d batches, was %d (train.accum_steps)",
                run_dir, saved, world_size, position["epoch"], position["batches_done"],
                position["n_batches_total"], world_size, " and Adam moments (local SGD kept one per rank)"
                if local_sgd else "", world_size * accum, saved * saved_accum)


def check_finite_weights(model, step: int, run_dir: Path) -> None:
    """Refuse to checkpoint non-finite weights: the files already written stay the last good ones."""
    finite = torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()
    if not bool(finite):
        raise UserError(f"step {step}: the model holds non-finite weights; not checkpointing them. "
                        f"The last good checkpoint is {run_dir / 'last.pt'}")
