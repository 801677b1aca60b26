"""The training loop (§5): ``train``, whose loop reads in one screen (``_train``), and its parts:
``_Run`` (what a run holds between steps) and small helpers; a step's own parts, which the
benchmarks call too, are in ``aiayn.train.step``.

Per optimizer step: ``accum_steps`` token-bounded batches per device; the loss is the sum of
label-smoothed cross-entropy over every target token of the step on every device, divided by
that total token count; the learning rate follows Eq. 3 with the step counted in optimizer
steps. Checkpoints every N steps / M minutes (atomic); a run directory that holds ``last.pt``
is resumed exactly (model, optimizer, schedule, RNG, data position).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from aiayn.config import replace, to_dict
from aiayn.data.batching import TokenBatchSampler, collate
from aiayn.data.dataset import DataDir
from aiayn.data.stream import BatchStream, check_positions, to_device
from aiayn.data.store import write_json_atomic
from aiayn.data.vocab import joint_vocabulary
from aiayn.errors import UserError
from aiayn.host.allocator import TRIM_EVERY_STEPS, release_free_memory
from aiayn.model.attention import attention_backends
from aiayn.model.transformer import Transformer, count_parameters
from aiayn import checkpoint as ck
from aiayn.train import runtime as rt
from aiayn.train.config import RunConfig, TrainConfig, run_config_from_dict
from aiayn.train.objective import label_smoothed_loss, learning_rate, make_optimizer
from aiayn.train.rundir import RunLock, remove_stale_temps
from aiayn.train.step import forward_backward, grad_norm, not_finite, read_numbers, step_numbers, update, update_early

log = logging.getLogger(__name__)


@dataclass
class TrainState:
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


def fit_to_data(cfg: RunConfig, data: DataDir) -> RunConfig:
    """Vocabulary sizes come from the data directory (a model cannot disagree with its tokenizer).
    Two tokenizers of one joint vocabulary (an imported Marian model's) may share the embedding."""
    m = cfg.model
    if data.shared_vocab or joint_vocabulary(data.src_tokenizer, data.tgt_tokenizer):
        model = replace(m, vocab_size=data.vocab_size, tgt_vocab_size=None)
    else:
        model = replace(m, vocab_size=data.vocab_size, tgt_vocab_size=data.tgt_vocab_size,
                        tie_src_tgt_embeddings=False)
    return replace(cfg, model=model)


def train_kernels(t: TrainConfig, device: torch.device):
    """The C kernels for the loss and the attention (``train.c_kernels``, CPU only), or None for
    PyTorch's operations."""
    if not t.c_kernels or device.type != "cpu":
        return None
    from aiayn.kernels.loader import load
    return load()


def valid_caps(t: TrainConfig) -> tuple[int, int]:
    """The most source and target ids of a validation pair that ``validate`` reads: a pair fills at
    most one batch of the token bounds (with its EOS or BOS), so a line however long costs no more
    memory than a training batch. Longer pairs are cut (``warn_long_pairs`` says so, once)."""
    return max(t.max_src_tokens - 1, 1), max(t.max_tgt_tokens - 1, 1)


def warn_long_pairs(name: str, data, t: TrainConfig) -> None:
    """One warning naming the pairs of ``data`` that ``validate`` cuts to ``valid_caps``."""
    if data is None or len(data) == 0:
        return
    src_cap, tgt_cap = valid_caps(t)
    long = np.flatnonzero((data.src_lens > src_cap) | (data.tgt_lens > tgt_cap))  # (n_long,)
    if len(long):
        shown = ", ".join(str(i + 1) for i in long[:5]) + (", ..." if len(long) > 5 else "")
        log.warning("%s: %d pair(s) longer than one batch (train.max_src_tokens=%d, train.max_tgt_tokens=%d) "
                    "are cut to %d source and %d target tokens for validation: pair(s) %s", name, len(long),
                    t.max_src_tokens, t.max_tgt_tokens, src_cap, tgt_cap, shown)


@torch.no_grad()
def validate(model, data, cfg: RunConfig, device, precision, tokenizers: tuple | None = None,
             references: list[str] | None = None, dist=None) -> dict:
    """Label-smoothed loss, NLL and per-token perplexity on a split (no dropout); with
    ``train.valid_bleu`` and ``tokenizers``, its sacreBLEU too (``valid_bleu``); and the seconds each took."""
    t0 = time.monotonic()
    model.eval()
    t = cfg.train
    src_cap, tgt_cap = valid_caps(t)
    sampler = TokenBatchSampler(np.minimum(data.src_lens, src_cap) + 1, np.minimum(data.tgt_lens, tgt_cap) + 1,
                                t.max_src_tokens, t.max_tgt_tokens, shuffle=False)
    m = cfg.model
    kernels = train_kernels(t, device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, tokens: read once at the end
    for idx in sampler:
        b = to_device(collate([(data.src(i)[:src_cap], data.tgt(i)[:tgt_cap]) for i in idx], m.pad_id, m.bos_id,
                               m.eos_id), device)
        with attention_backends(device, t.cudnn_attention), rt.autocast(device, precision):
            logits = model(b.src, b.tgt_in, src_padded=b.src_padded)
        sums = label_smoothed_loss(logits, b.tgt_out, t.eps_ls, m.pad_id, kernels)
        totals += torch.stack([sums.loss.double(), sums.nll.double(), sums.n_tokens.double()])
    loss, nll, n = totals.tolist()
    n = max(n, 1)
    out = {"valid_loss": loss / n, "valid_nll": nll / n, "valid_ppl": math.exp(min(nll / n, 50))}
    if t.valid_bleu and tokenizers is not None:
        t1 = time.monotonic()
        out["valid_bleu"] = valid_bleu(model, data, tokenizers, t.valid_bleu_max_lines, src_cap, t.valid_beam,
                                       references, dist)
        out["valid_bleu_seconds"] = time.monotonic() - t1
    model.train()
    out["valid_seconds"] = time.monotonic() - t0
    return out


@torch.no_grad()
def valid_bleu(model, data, tokenizers: tuple, max_lines: int = 0, src_cap: int | None = None, beam: int = 4,
               references: list[str] | None = None, dist=None) -> float:
    """sacreBLEU of the first ``max_lines`` validation pairs (0 = all) translated as ``aiayn
    translate`` would (§6.1: beam search of ``beam``, alpha 0.6, max length |x| + 50), against
    ``references`` (the raw target lines, ``DataDir.references``) or, without them, the
    detokenized reference ids; sources cut to ``src_cap`` ids (``valid_caps``). In a data-parallel
    run (``dist``) each rank translates every G-th line and the translations are gathered, so
    every rank scores the same text in 1/G of the time."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.bleu import sacre_bleu
    src_tok, tgt_tok = tokenizers
    n = min(len(data), max_lines) if max_lines else len(data)
    translator = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=beam))
    rank, world = (dist.rank, dist.world_size) if dist is not None and dist.enabled else (0, 1)
    ids = [list(map(int, data.src(i)[:src_cap])) + [model.cfg.eos_id] if len(data.src(i)) else []
           for i in range(rank, n, world)]
    out = [tgt_tok.decode(h[0].tokens) if h else "" for h in translator.translate_ids(ids)]
    if world > 1:
        parts: list = [None] * world
        torch.distributed.all_gather_object(parts, out)
        out = [""] * n
        for r, part in enumerate(parts):
            out[r::world] = part
    refs = references[:n] if references is not None else [tgt_tok.decode(list(map(int, data.tgt(i))))
                                                        for i in range(n)]
    return sacre_bleu(out, refs).score


def _save(run_dir: Path, model, opt, scaler, sampler_state: dict, state: TrainState, cfg: RunConfig,
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


def _resume_checkpoint(run_dir: Path) -> dict:
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


def _restore(run_dir: Path, model, opt, scaler, stream: BatchStream, cfg: RunConfig, tokenizers: dict,
             rank: int = 0, world_size: int = 1) -> tuple[TrainState, dict | None]:
    """The run directory's state restored into the model, optimizer and batch stream; and its moving
    average of the weights (``train.ema_decay``), if it kept one."""
    ckpt = _resume_checkpoint(run_dir)
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
        _warn_other_ranks(run_dir, ckpt["sampler"], stream.state_dict(), saved.train.accum_steps,
                          cfg.train.accum_steps, world_size, local_sgd=bool(ranks))
    return TrainState(step=ckpt["step"], epoch=ckpt["epoch"], tokens=ckpt["tokens"], flops=ckpt["flops"],
                      best_valid_loss=ckpt["best_valid_loss"],
                      best_valid_bleu=ckpt.get("best_valid_bleu", -math.inf),
                      bad_validations=ckpt["bad_validations"], train_seconds=ckpt["train_seconds"],
                      valid_seconds=ckpt.get("valid_seconds", 0.0),
                      valid_bleu_seconds=ckpt.get("valid_bleu_seconds", 0.0)), ckpt.get("ema")


def _warn_other_ranks(run_dir: Path, saved_state: dict, position: dict, saved_accum: int, accum: int,
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


def _runtime(t: TrainConfig) -> tuple:
    """The process's place in the run (distributed or not), its device and its precision;
    ``t.threads`` applied."""
    device_type = "cuda" if (t.device.startswith("cuda") or (t.device == "auto" and torch.cuda.is_available())) else "cpu"
    dist = rt.init_distributed(device_type, t.dist_timeout_s)
    device = rt.resolve_device(t.device, dist)
    precision = rt.resolve_precision(t.precision, device)
    rt.use_tf32(device, t.tf32)
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    return dist, device, precision


def _build(cfg: RunConfig, device, precision: str) -> tuple:
    """What a checkpoint restores besides the data position, freshly made: the seeded model, Adam
    (§5.3; AdamW with ``weight_decay``) and fp16's gradient scaler (None otherwise)."""
    t, m = cfg.train, cfg.model
    rt.seed_everything(t.seed)
    model = Transformer(m).to(device)
    opt = make_optimizer(model.parameters(),
                         learning_rate(1, m.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac),
                         (t.adam_beta1, t.adam_beta2), t.adam_eps, t.weight_decay,
                         fused=t.fused_adam and device.type in ("cpu", "cuda"))
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return model, opt, scaler


def train(data_dir: str | Path, run_dir: str | Path, cfg: RunConfig, progress: bool = True,
          init_from: str | Path | None = None, resume_optimizer: bool = False) -> TrainState:
    """Train (or resume) a model on ``data_dir`` into ``run_dir``; returns the final state. The main
    rank holds the run directory's lock (``rundir.RunLock``) until it returns. ``init_from``: a new
    run starts from that checkpoint's weights (and with ``resume_optimizer`` its Adam state;
    ``aiayn.train.finetune``)."""
    with contextlib.ExitStack() as held:
        return _train(data_dir, run_dir, cfg, progress, held, init_from, resume_optimizer)


def _start_run_dir(run_dir: Path, held: contextlib.ExitStack) -> None:
    """The main rank's claim on ``run_dir``: created, locked for this process, and cleared of the
    temporaries an earlier killed run left."""
    run_dir.mkdir(parents=True, exist_ok=True)
    held.enter_context(RunLock(run_dir))
    remove_stale_temps(run_dir)


def _train(data_dir: str | Path, run_dir: str | Path, cfg: RunConfig, progress: bool,
           held: contextlib.ExitStack, init_from: str | Path | None = None,
           resume_optimizer: bool = False) -> TrainState:
    """§5's loop: draw a step's batches, take the step, log, validate and checkpoint when due."""
    run = _Run(data_dir, Path(run_dir), cfg, progress, held, init_from, resume_optimizer)
    t, state = run.cfg.train, run.state
    elapsed = last_save = run.mean_clock()
    last_sync_step, stop_reason = state.step, "max_steps"
    run.model.train()
    # Batches are drawn one step ahead (``BatchStream.prefetch``): the next step's are collated and on
    # their way to the device while the device computes this one.
    run.stream.prefetch()
    while state.step < t.max_steps:
        if not run.dist.enabled:
            elapsed = run.clock()
        # (data parallel: `elapsed` is the ranks' mean clock, all-reduced with the last step's sums;
        # local SGD: the mean clock of the last averaging, so the ranks stop together)
        stop = _stop_reason(t, state, elapsed)
        if stop:
            stop_reason = stop
            break
        batches = run.stream.next_step()
        state.epoch = run.stream.epoch
        if not batches:
            continue  # the epoch limit reached (the stop check above ends the run): nothing was drawn
        step = run.step(batches, elapsed)
        run.stream.prefetch()  # the next step's batches, prepared while the device works
        step = run.read(step)
        if step.mean_clock is not None:
            elapsed = step.mean_clock
        if not run.apply(step):
            continue  # a non-finite step, skipped (local SGD counts it, so the ranks average together)
        if state.step % TRIM_EVERY_STEPS == 0:
            run.release_host_memory()
        if state.step % run.period:
            continue  # local SGD between two averagings: no logging, checkpoint or validation
        if run.local_sgd:
            run.pending_tokens, elapsed = _average_copies(run.model, run.pending_tokens, run.clock(), run.dist,
                                                          run.device)
        run.log_step(step, last_sync_step)
        due_steps = _crossed(t.save_every_steps, last_sync_step, state.step)
        due_time = t.save_every_min and elapsed - last_save >= 60 * t.save_every_min
        due_valid = _crossed(t.validate_every_steps, last_sync_step, state.step)
        last_sync_step = state.step
        valid = run.validate() if due_valid or ((due_steps or due_time) and t.validate_at_save) else None
        if due_steps or due_time:
            run.checkpoint(valid)
            last_save = elapsed
    if run.local_sgd and state.step != last_sync_step:  # stopped between two averagings
        state.tokens += _average_copies(run.model, run.pending_tokens, run.clock(), run.dist, run.device)[0]
    run.finish(stop_reason)
    return state


@dataclass
class _Step:
    """One optimizer step in flight (``_Run.step``), then its numbers on the host (``_Run.read``)."""
    numbers: torch.Tensor  # (6,) ``step_numbers`` on the device
    norm: torch.Tensor | None  # the gradient norm on the device (None under fp16)
    summed_tokens: bool  # DDP: ``numbers`` holds the ranks' target tokens
    local_tokens: int
    lr: float
    clock_s: float  # this rank's clock when the step was queued
    updated: bool = False  # the update is queued already (``_Run.update_early``)
    loss: float = 0.0
    nll: float = 0.0
    kl: float = 0.0
    tokens: float = 0.0  # the step's target tokens over the ranks (this rank's with local SGD)
    norm_value: float = 0.0
    mean_clock: float | None = None  # DDP: the ranks' mean clock


class _Run:
    """What one training run holds between its steps: the data, the model and its optimizer (restored
    from the run directory, or fresh), how the ranks train together (one process, DDP, or local SGD's
    copies averaged every ``period`` steps), the clock, the counters of logging and the outputs."""

    def __init__(self, data_dir, run_dir: Path, cfg: RunConfig, progress: bool, held: contextlib.ExitStack,
                 init_from, resume_optimizer: bool):
        t = cfg.train
        self.dist, self.device, self.precision = _runtime(t)
        data = DataDir(data_dir)
        self.cfg = cfg = fit_to_data(cfg, data)
        self.run_dir = run_dir
        self.stream = BatchStream(data, cfg, run_dir, self.dist, self.device)
        self._load_valid(data, t)
        if self.dist.is_main:
            _start_run_dir(run_dir, held)
        self.model, self.opt, self.scaler = _build(cfg, self.device, self.precision)
        self.tokenizers = tokenizer_payload(data)
        self.toks = (data.src_tokenizer, data.tgt_tokenizer)
        self.saved_ema = None
        self.state = self._resume_or_start(init_from, resume_optimizer)
        self.ema = self._ema_start(t)
        if self.dist.is_main:  # only now: a refused resume leaves the run's config.json as it was
            write_json_atomic(run_dir / "config.json", to_dict(cfg))
        self._parallel(t)
        self.kernels = train_kernels(t, self.device)
        # torch.compile traces PyTorch's attention; the C kernels' calls would break its graphs
        self.model.use_attention_kernels(None if self.net is not self.plain_net else self.kernels)
        self.update_early = update_early(self.opt, self.scaler)
        self.model.pad_linear_rows(t.cpu_row_bits if self.device.type == "cpu" else 0)
        self.n_params = count_parameters(self.model)
        log.info("model: %s parameters; device %s, precision %s, %d process(es)", f"{self.n_params:,}",
                 self.device, self.precision, self.dist.world_size)
        self.monitor = _Monitor(run_dir, self.state, self.dist.is_main, progress, t.max_steps)
        self.copies = 2 if t.rdrop_alpha > 0 else 1  # R-Drop feeds every batch twice
        self.t_start = time.monotonic() - self.state.train_seconds
        self.bad_in_row = self.pending_tokens = self.window_tokens = 0
        self.window_t0 = time.monotonic()

    def _load_valid(self, data: DataDir, t: TrainConfig) -> None:
        """The validation split, checked, and its raw references for ``train.valid_bleu``."""
        self.valid_data = data.split("valid") if "valid" in data.splits else None
        self.valid_refs = None
        if self.valid_data is not None and t.valid_bleu:
            self.valid_refs = data.references("valid")
            if self.valid_refs is None:
                log.warning("%s: the validation target file prepare read is gone or changed; valid_bleu scores "
                            "against the detokenized reference ids instead", data.path)
        check_positions(self.cfg.model, {"valid": self.valid_data})
        warn_long_pairs("valid", self.valid_data, t)

    def _resume_or_start(self, init_from, resume_optimizer: bool) -> TrainState:
        """The run directory's state (resumed exactly), or a new run's (from ``init_from``'s weights)."""
        run_dir, dist = self.run_dir, self.dist
        if (run_dir / "last.pt").exists() or ck.step_checkpoints(run_dir):  # (last.pt lost: a step checkpoint)
            state, self.saved_ema = _restore(run_dir, self.model, self.opt, self.scaler, self.stream, self.cfg,
                                             self.tokenizers, dist.rank, dist.world_size)
            log.info("resuming from %s at step %d (epoch %d)", run_dir / "last.pt", state.step, state.epoch)
            if dist.is_main:
                print(f"resuming from {run_dir / 'last.pt'} at step {state.step}", flush=True)
            return state
        if init_from is not None:
            from aiayn.train.finetune import init_from as load_init
            load_init(init_from, self.model, self.opt, self.cfg, self.tokenizers, resume_optimizer)
        return TrainState()

    def _ema_start(self, t: TrainConfig) -> list[torch.Tensor] | None:
        """``train.ema_decay``'s float32 copy of the parameters: the run directory's, or the weights now."""
        if not t.ema_decay:
            return None
        params, saved = dict(self.model.named_parameters()), self.saved_ema or {}
        self.saved_ema = None
        return [saved[k].to(self.device, torch.float32) if k in saved else p.detach().float().clone()
                for k, p in params.items()]

    def ema_update(self) -> None:
        """ema <- d * ema + (1 - d) * weights, after an update (one fused call over all parameters)."""
        params = [p.detach().float() for p in self.model.parameters()]
        torch._foreach_lerp_(self.ema, params, 1.0 - self.cfg.train.ema_decay)

    def ema_state(self) -> dict | None:
        """The moving average as a state dict of the model (its buffers as they are)."""
        if self.ema is None:
            return None
        names = [k for k, _ in self.model.named_parameters()]
        out = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        out.update({k: e.detach().to("cpu", out[k].dtype).clone() for k, e in zip(names, self.ema)})
        return out

    @contextlib.contextmanager
    def ema_weights(self):
        """The model holds the moving average inside the block (validation), its own weights after."""
        if self.ema is None:
            yield
            return
        params = list(self.model.parameters())
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, [e.to(p.dtype) for e, p in zip(self.ema, params)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, kept)

    def _parallel(self, t: TrainConfig) -> None:
        """How the ranks train together. Local SGD: every process trains its own copy (no DDP), and the
        copies are averaged every ``period`` steps; elsewhere every step is a synchronization point."""
        self.local_sgd = self.dist.enabled and t.local_sgd_period > 0
        self.period = t.local_sgd_period if self.local_sgd else 1
        if self.local_sgd:
            rt.broadcast_parameters(list(self.model.parameters()), self.dist)
        self.ddp = self.dist.enabled and not self.local_sgd
        self.plain_net = rt.data_parallel(self.model, static_graph=t.accum_steps == 1 and not t.compile) \
            if self.ddp else self.model
        self.net = torch.compile(self.plain_net) if t.compile else self.plain_net

    def _without_compile(self, exc: Exception) -> None:
        """torch.compile failed (compiling happens at the first forward, and backward, of each new
        shape): the run goes on with the plain model (and the C kernels, where it has them), after a
        warning that says why. (Under DDP a failure in backward leaves DDP's reducer mid-step, and the
        next forward says so: only the forward's failures are taken back there.)"""
        log.warning("torch.compile failed (%s: %s); training without it", type(exc).__name__, str(exc)[:500])
        self.opt.zero_grad(set_to_none=True)  # what the failed pass accumulated
        self.net = self.plain_net
        self.model.use_attention_kernels(self.kernels)

    def clock(self) -> float:
        return time.monotonic() - self.t_start

    def mean_clock(self) -> float:
        """The ranks' mean training time: every rank takes the same stop, save and learning-rate
        decisions from it (a rank that stopped alone would leave the others waiting in all_reduce)."""
        return rt.all_reduce_sum([self.clock()], self.dist, self.device)[0] / self.dist.world_size

    def step(self, micro: list, elapsed: float) -> _Step:
        """Eq. 3's rate, then the step's forward and backward passes, queued on the device (nothing
        read back). The loss is a sum over the step's tokens divided by their count: over all ranks
        with DDP, which averages gradients (per copy, as R-Drop's criterion divides by the doubled
        batch's tokens); over this rank's with local SGD, whose copies are averaged. DDP's count is
        all-reduced on the device and scales the loss there."""
        t, m, dist, device = self.cfg.train, self.cfg.model, self.dist, self.device
        local_tokens = sum(b.n_tgt_tokens for b in micro)
        tokens_dev = rt.all_reduce_tensor(rt.host_to_device([float(local_tokens)], device), dist) if self.ddp else None
        by_time = t.lr_decay_by_time or t.lr_schedule_by_time
        time_frac = (self.clock() if self.local_sgd else elapsed) / (60 * t.max_time_min) if by_time else 0.0
        lr = learning_rate(self.state.step + 1, m.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac,
                           time_frac, t.lr_schedule_by_time)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.ddp:
            grad_scale = (dist.world_size / (self.copies * tokens_dev)).float().reshape(())  # on the device
        else:
            grad_scale = 1 / (self.copies * float(local_tokens))
        args = (micro, t, m, self.copies, grad_scale, device, self.precision, self.kernels, self.scaler)
        try:
            sums, flops = forward_backward(self.net, *args, synced=self.ddp)
        except Exception as exc:  # compiling fails in many ways; the plain model raises real errors again
            if self.net is self.plain_net:
                raise
            self._without_compile(exc)
            sums, flops = forward_backward(self.net, *args, synced=self.ddp)
        self.state.flops += flops * dist.world_size
        norm = grad_norm(self.model, self.scaler)
        clock_s = self.clock()
        numbers = step_numbers(sums, norm, tokens_dev, clock_s, dist, device, reduce=not self.local_sgd)
        s = _Step(numbers, norm, tokens_dev is not None, local_tokens, lr, clock_s)
        if self.update_early:  # skipped on the device where the step is not finite, as ``apply`` decides
            update(self.model, self.opt, self.scaler, t.clip_norm, norm, skip=not_finite(numbers))
            s.updated = True
        return s

    def read(self, s: _Step) -> _Step:
        """The step's numbers on the host: its one wait for the device (``read_numbers``)."""
        s.loss, s.nll, s.kl, s.tokens, mean_clock, s.norm_value = read_numbers(
            s.numbers, s.summed_tokens, float(s.local_tokens), s.clock_s, self.dist, reduce=not self.local_sgd)
        s.mean_clock = mean_clock if self.ddp else None
        return s

    def apply(self, s: _Step) -> bool:
        """The update if the step's loss (R-Drop's KL term included: it reaches the gradients too) and
        gradient norm are finite (queued by ``step`` already with ``update_early``); else the step is
        skipped, and too many in a row stop the run. Returns whether the step counts (a skipped one does
        under local SGD, so the ranks average together)."""
        t, state = self.cfg.train, self.state
        finite = math.isfinite(s.loss + s.kl) and math.isfinite(s.norm_value)  # (``not_finite`` on the device)
        if finite:
            self.bad_in_row = 0
            if not s.updated:
                update(self.model, self.opt, self.scaler, t.clip_norm, s.norm)
        else:
            self.bad_in_row += 1
            if not s.updated:  # (a queued update was skipped on the device, and cleared the gradients)
                self.opt.zero_grad(set_to_none=True)
            log.warning("step %d: non-finite loss or gradient (loss %s, gradient norm %s); skipping the update "
                        "(%d in a row)", state.step + 1, s.loss, s.norm_value, self.bad_in_row)
            if self.bad_in_row >= t.max_bad_steps:
                raise UserError(f"{self.bad_in_row} non-finite losses or gradients in a row at step "
                                f"{state.step + 1}; stopping. The last good checkpoint is {self.run_dir / 'last.pt'}; "
                                f"try a lower lr_scale or precision=fp32")
            if not self.local_sgd:
                return False
        state.step += 1
        if finite and self.ema is not None:
            self.ema_update()
        self.pending_tokens += int(s.tokens) if finite else 0
        state.train_seconds = self.clock()
        state.history.append((state.step, s.loss / s.tokens))
        self.monitor.advance()
        return True

    def log_step(self, s: _Step, last_sync_step: int) -> None:
        """Count the tokens since the last synchronization point; every ``log_every_steps`` steps a
        line of the train log and the progress bar's numbers."""
        state = self.state
        state.tokens += self.pending_tokens
        self.window_tokens += self.pending_tokens
        self.pending_tokens = 0
        if not _crossed(self.cfg.train.log_every_steps, last_sync_step, state.step):
            return
        tps = self.window_tokens / max(time.monotonic() - self.window_t0, 1e-9)
        self.window_tokens, self.window_t0 = 0, time.monotonic()
        loss_tok = s.loss / s.tokens
        self.monitor.postfix(loss=f"{loss_tok:.3f}", lr=f"{s.lr:.2e}", tok_s=f"{tps:,.0f}", ep=state.epoch)
        rss = rt.resident_mb()
        self.monitor.scalars({"train_loss": loss_tok, "train_nll": s.nll / s.tokens, "lr": s.lr,
                              **({"train_kl": s.kl / s.tokens} if self.copies == 2 else {}),
                              "tokens_per_s": tps, "epoch": state.epoch, "elapsed_s": state.train_seconds,
                              **({"rss_mb": rss} if rss is not None else {})})

    def validate(self) -> dict | None:
        with self.ema_weights():
            valid = _validate_and_track(self.model, self.valid_data, self.cfg, self.device, self.precision,
                                        self.state, self.monitor.scalars, self.toks, self.valid_refs, self.dist)
        self.release_host_memory()  # validation's batches leave holes of their own sizes
        return valid

    def release_host_memory(self) -> None:
        """Training on the CPU: the heap's holes back to the kernel (aiayn/host/allocator.py)."""
        if self.device.type == "cpu":
            release_free_memory()

    def checkpoint(self, valid: dict | None) -> None:
        """The run's state into ``run_dir`` by the main rank (every rank calls it: local SGD gathers
        each rank's own Adam state first, and every rank's RNG state is gathered); old BPE-dropout
        segmentations pruned."""
        state, dist = self.state, self.dist
        is_best = valid is not None and (valid["valid_bleu"] >= state.best_valid_bleu
                                         if self.cfg.train.best_metric == "bleu"
                                         else valid["valid_loss"] <= state.best_valid_loss)
        _check_finite_weights(self.model, state.step, self.run_dir)
        rank_opts = rt.gather_to_main(self.opt.state_dict(), dist) if self.local_sgd else None
        rank_rng = rt.gather_to_main(rt.rng_state(), dist) if dist.enabled else None
        if dist.is_main:
            _save(self.run_dir, self.model, self.opt, self.scaler, self.stream.state_dict(), state, self.cfg,
                  self.tokenizers, self.cfg.train.keep_last, valid, is_best, rank_opts, rank_rng, self.ema_state())
            self.stream.saved()

    def finish(self, stop_reason: str) -> None:
        """The end: validate, write the final checkpoint and the summary."""
        valid = self.validate()
        self.checkpoint(valid)
        if self.dist.is_main:
            summary = _summary(self.state, self.cfg, self.n_params, self.dist, self.device, self.precision,
                               stop_reason, valid)
            write_json_atomic(self.run_dir / "summary.json", summary)  # the demo reads its presence as "trained"
            self.monitor.close()
            print(_summary_text(summary), flush=True)
        if self.dist.enabled:
            torch.distributed.barrier()


def _check_finite_weights(model, step: int, run_dir: Path) -> None:
    """Refuse to checkpoint non-finite weights: the files already written stay the last good ones."""
    finite = torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()
    if not bool(finite):
        raise UserError(f"step {step}: the model holds non-finite weights; not checkpointing them. "
                        f"The last good checkpoint is {run_dir / 'last.pt'}")


class _Monitor:
    """The main rank's outputs while training: ``train_log.jsonl``, TensorBoard curves and the
    tqdm bar. On the other ranks every method does nothing (the one place rank decides them)."""

    def __init__(self, run_dir: Path, state: TrainState, is_main: bool, progress: bool, max_steps: int):
        self.state, self.is_main = state, is_main
        self.jsonl = self.writer = self.bar = None
        if not is_main:
            return
        self.jsonl = open(run_dir / "train_log.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is a dependency, but keep training without it
            self.writer = None
        if progress:
            from tqdm import tqdm
            total = max_steps if max_steps < 1_000_000 else None  # a time-bounded run has no step total
            self.bar = tqdm(total=total, initial=state.step, unit="step", dynamic_ncols=True, mininterval=2.0)

    def scalars(self, values: dict) -> None:
        """One line of ``train_log.jsonl`` at the current step; the numbers also to TensorBoard."""
        if not self.is_main:
            return
        self.jsonl.write(json.dumps({"step": self.state.step, **values}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, self.state.step)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def postfix(self, **values) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def _stop_reason(t: TrainConfig, state: TrainState, elapsed: float) -> str | None:
    """Why training stops before its next step ("max_time", "max_epochs", "patience"), or None.
    Checked before every step, so a finished run that is started again stops at once."""
    if t.max_time_min and elapsed >= 60 * t.max_time_min:
        return "max_time"
    if t.max_epochs and state.epoch >= t.max_epochs:
        return "max_epochs"
    if t.patience and state.bad_validations >= t.patience:
        return "patience"
    return None


def _crossed(every: int, since: int, step: int) -> bool:
    """Whether a multiple of ``every`` (0 = never) lies in (since, step]: a step-count event
    fell between the last synchronization point and this one (every step, unless local SGD)."""
    return every > 0 and step // every > since // every


def _average_copies(model, tokens: int, seconds: float, dist, device) -> tuple[int, float]:
    """Local SGD's averaging: every rank's copy of the model becomes the copies' mean; returns the
    ranks' target tokens since the last averaging, summed, and their mean training time."""
    rt.average_parameters(list(model.parameters()), dist)
    tokens_sum, seconds_sum = rt.all_reduce_sum([float(tokens), seconds], dist, device)
    return int(tokens_sum), seconds_sum / dist.world_size


def _validate_and_track(model, valid_data, cfg, device, precision, state: TrainState, log_scalars,
                        tokenizers: tuple | None = None, references: list[str] | None = None,
                        dist=None) -> dict | None:
    """``validate``, then the bests and the count of validations without a gain in ``train.best_metric``."""
    if valid_data is None:
        return None
    valid = validate(model, valid_data, cfg, device, precision, tokenizers, references, dist)
    state.valid_seconds += valid["valid_seconds"]
    state.valid_bleu_seconds += valid.get("valid_bleu_seconds", 0.0)
    gained = (valid["valid_bleu"] > state.best_valid_bleu if cfg.train.best_metric == "bleu"
              else valid["valid_loss"] < state.best_valid_loss)
    state.best_valid_loss = min(state.best_valid_loss, valid["valid_loss"])
    state.best_valid_bleu = max(state.best_valid_bleu, valid.get("valid_bleu", -math.inf))
    state.bad_validations = 0 if gained else state.bad_validations + 1
    log_scalars(valid)
    log.info("step %d: valid loss %.4f nll %.4f ppl %.2f%s (%.1f s)", state.step, valid["valid_loss"],
             valid["valid_nll"], valid["valid_ppl"],
             f" BLEU {valid['valid_bleu']:.2f}" if "valid_bleu" in valid else "", valid["valid_seconds"])
    return valid


def _summary(state: TrainState, cfg: RunConfig, n_params: int, dist, device, precision, stop_reason, valid) -> dict:
    """Run summary with the paper's training-cost estimate (Table 2) beside the counted FLOPs."""
    peak = rt.matmul_tflops(device)
    hours = state.train_seconds / 3600
    return {
        "steps": state.step, "epochs": state.epoch, "stop_reason": stop_reason,
        "target_tokens": state.tokens, "train_seconds": round(state.train_seconds, 1),
        "tokens_per_s": round(state.tokens / max(state.train_seconds, 1e-9), 1),
        "params": n_params, "devices": dist.world_size, "device": str(device), "precision": precision,
        "valid": valid, "best_valid_loss": state.best_valid_loss,
        **({"best_valid_bleu": state.best_valid_bleu} if math.isfinite(state.best_valid_bleu) else {}),
        "best_metric": cfg.train.best_metric,
        "valid_seconds": round(state.valid_seconds, 1), "valid_bleu_seconds": round(state.valid_bleu_seconds, 1),
        "counted_flops": state.flops,
        "device_fp32_matmul_tflops": round(peak, 4),
        # Table 2: training time x number of devices x sustained FLOP/s of the device
        "table2_cost_estimate_flops": state.train_seconds * dist.world_size * peak * 1e12,
        "model_flops_utilization_vs_fp32_matmul": state.flops / max(state.train_seconds * dist.world_size * peak * 1e12, 1),
        "hours": round(hours, 3),
    }


def _summary_text(s: dict) -> str:
    v = s["valid"] or {}
    vtxt = f", valid loss {v['valid_loss']:.3f} ppl {v['valid_ppl']:.2f}" if v else ""
    return (f"trained {s['steps']} steps ({s['epochs']} epochs, {s['target_tokens']:,} target tokens) in "
            f"{s['train_seconds']:.0f} s, {s['tokens_per_s']:,.0f} tok/s, stop: {s['stop_reason']}{vtxt}\n"
            f"cost: counted {s['counted_flops']:.3g} FLOPs; Table 2 estimate (time x devices x "
            f"{s['device_fp32_matmul_tflops']:.3f} TFLOP/s) {s['table2_cost_estimate_flops']:.3g} FLOPs")
