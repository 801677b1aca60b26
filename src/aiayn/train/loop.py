"""The training loop (§5): ``train``, whose loop reads in one screen (``_train``), and ``_Run``,
what a run holds between its steps. Each part it uses is built once, from the configuration it
needs: the batches (``aiayn.data.stream.BatchStream``), the optimizer step
(``aiayn.train.step.TrainStep.for_run``: its loss, and how the ranks take it together,
``aiayn.train.parallel``), validation (``aiayn.train.validation``), the run directory's checkpoints
(``aiayn.checkpoint.run.RunCheckpoints``), the moving average of the weights (``aiayn.train.ema``) and
the outputs (``aiayn.train.monitor``).

Per optimizer step: ``accum_steps`` token-bounded batches per device; the loss is the sum of
label-smoothed cross-entropy over every target token of the step on every device, divided by
that total token count; the learning rate follows Eq. 3 with the step counted in optimizer
steps. Checkpoints every N steps / M minutes (atomic); a run directory that holds ``last.pt``
is resumed exactly (model, optimizer, schedule, RNG, data position).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import time
from pathlib import Path

import torch

from aiayn.checkpoint import run_lineage
from aiayn.checkpoint.run import Learner, RunCheckpoints, TrainState, last_checkpoint, tokenizer_payload
from aiayn.config import replace
from aiayn.data.dataset import DataDir
from aiayn.data.stream import BatchStream
from aiayn.data.vocab import joint_vocabulary
from aiayn.errors import UserError
from aiayn.files import check_ancestors
from aiayn.host.allocator import TRIM_EVERY_STEPS, HeapGrowth, trim_choice, trim_unless_never
from aiayn.kernels.loader import check_target
from aiayn.model.transformer import Transformer, count_parameters
from aiayn.train import finetune
from aiayn.train import runtime as rt
from aiayn.train.config import RunConfig, TrainConfig, batching, unused_settings
from aiayn.train.ema import WeightAverage
from aiayn.train.monitor import Monitor, summary
from aiayn.train.objective import Schedule, optimizer_for
from aiayn.train.rundir import Claim, remove_stale_temps
from aiayn.train.step import Step, TrainStep
from aiayn.train.validation import Validator

log = logging.getLogger(__name__)


def fit_to_data(cfg: RunConfig, data: DataDir) -> RunConfig:
    """Vocabulary sizes come from the data directory (a model cannot disagree with its tokenizer).
    Two tokenizers of one joint vocabulary (an imported Marian model's) may share the embedding."""
    m = cfg.model
    if data.shared_vocab or joint_vocabulary(data.src_tokenizer, data.tgt_tokenizer):
        model = replace(m, vocab_size=data.vocab_size, tgt_vocab_size=None)
    else:
        model = replace(m, vocab_size=data.vocab_size, tgt_vocab_size=data.tgt_vocab_size,
                        tie_src_tgt_embeddings=False)
        if m.tie_src_tgt_embeddings:  # the preset's (or a --set's) true cannot hold: said, not dropped unseen
            log.info("model.tie_src_tgt_embeddings: false, as the data directory's source and target "
                     "vocabularies are separate (§3.4's shared embedding needs one vocabulary)")
    if (m.vocab_size, m.tgt_vocab_size) != (model.vocab_size, model.tgt_vocab_size):
        log.info("vocabulary: %s, the data directory's (the configuration's model.vocab_size %s is not used)",
                 f"{model.vocab_size:,}" + (f" + {model.tgt_vocab_size:,}" if model.tgt_vocab_size else ""),
                 f"{m.vocab_size:,}")
    return replace(cfg, model=model)


def schedule_of(cfg: RunConfig) -> Schedule:
    """The run's learning rate (Eq. 3 and the ``train`` fields that change it)."""
    t = cfg.train
    return Schedule(cfg.model.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac,
                    by_budget=t.lr_decay_by_time or t.lr_schedule_by_time, whole_by_time=t.lr_schedule_by_time,
                    max_time_min=t.max_time_min, max_flops=t.max_flops, max_epochs=t.max_epochs)


def precision_of(cfg: RunConfig, device: torch.device) -> str:
    """The precision a run of ``cfg`` trains in on ``device`` (``train.precision``, auto resolved)."""
    return rt.resolve_precision(cfg.train.precision, device)[0]


def train(data_dir: str | Path, run_dir: str | Path, cfg: RunConfig, progress: bool = True,
          init_from: str | Path | None = None, resume_optimizer: bool = False) -> TrainState:
    """Train (or resume) a model on ``data_dir`` into ``run_dir``; returns the final state. The main
    rank holds the run directory's lock (``rundir.RunLock``) until it returns. ``init_from``: a new
    run starts from that checkpoint's weights (and with ``resume_optimizer`` its Adam state;
    ``aiayn.train.finetune``)."""
    check_target()  # AIAYN_KERNELS_MARCH, refused before the data is read (the C kernels load at the first step)
    with contextlib.ExitStack() as held:
        state = _train(data_dir, run_dir, cfg, progress, held, init_from, resume_optimizer)
    rt.leave_process_group()  # every rank has passed the end's barrier
    return state


def _start_run_dir(run_dir: Path, held: contextlib.ExitStack) -> Claim:
    """The main rank's claim on ``run_dir``: created, locked for this process, and cleared of the
    temporaries an earlier killed run left; until the claim's ``begin``, a refused start removes what
    it made (``rundir.Claim``)."""
    check_ancestors(run_dir)
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise UserError(f"{run_dir}: exists and is not a folder; choose another --out")
    try:
        claim = held.enter_context(Claim(run_dir))
    except OSError as exc:  # no permission, a read-only disk (a full one is said where the command catches it)
        if not isinstance(exc, PermissionError) and exc.errno != errno.EROFS:
            raise
        raise UserError(f"{exc.filename or run_dir}: cannot write ({exc.strerror}); choose another --out") from None
    remove_stale_temps(run_dir)
    return claim


def _train(data_dir: str | Path, run_dir: str | Path, cfg: RunConfig, progress: bool,
           held: contextlib.ExitStack, init_from: str | Path | None = None,
           resume_optimizer: bool = False) -> TrainState:
    """§5's loop: draw a step's batches, take the step, log, validate and checkpoint when due."""
    run = _Run(data_dir, Path(run_dir), cfg, progress, held, init_from, resume_optimizer)
    t, state, ranks = cfg.train, run.state, run.stepper.strategy
    elapsed = last_save = ranks.start_clock(run.clock)
    last_sync_step, stop_reason = state.step, "max_steps"
    last_progress = run.schedule.progress(state.step, elapsed, state.flops, run.stream.epochs)
    run.learner.model.train()
    # Batches are drawn one step ahead (``BatchStream.prefetch``): the next step's are collated and on
    # their way to the device while the device computes this one.
    run.stream.prefetch()
    while state.step < t.max_steps:
        # (one process: its clock; the ranks: their mean clock at the last synchronization, so they stop together)
        elapsed = ranks.elapsed(elapsed, run.clock)
        stop = _stop_reason(t, state, elapsed)
        if stop:
            stop_reason = stop
            break
        batches = run.stream.next_step()
        state.epoch = run.stream.epoch
        if not batches:
            continue  # the epoch limit reached (the stop check above ends the run): nothing was drawn
        step = run.stepper.step(batches, state.step + 1, elapsed, state.flops, run.stream.epochs,
                                while_busy=run.stream.prefetch)
        state.flops += ranks.counted_flops(step.flops)
        if step.mean_clock is not None:
            elapsed = step.mean_clock
        if not run.apply(step):
            continue  # a non-finite step, skipped (unless the ranks count it, to synchronize together)
        run.look_at_heap()
        if state.step % ranks.period:
            continue  # between two synchronization points: no logging, checkpoint or validation
        elapsed = run.synchronize(elapsed)
        run.log_step(step, _crossed(t.log_every_steps, last_sync_step, state.step))
        due_steps = _crossed(t.save_every_steps, last_sync_step, state.step)
        due_time = t.save_every_min and elapsed - last_save >= 60 * t.save_every_min
        progress = run.schedule.progress(state.step, elapsed, state.flops, run.stream.epochs)
        due_share = t.save_every_frac and _shares(progress, t.save_every_frac) > _shares(last_progress, t.save_every_frac)
        due_valid = _crossed(t.validate_every_steps, last_sync_step, state.step)
        last_sync_step, last_progress = state.step, progress
        due = due_steps or due_time or due_share
        valid = run.validate() if due_valid or (due and t.validate_at_save) else None
        if due:
            run.save(valid)
            last_save = elapsed
        elif run.checkpoints.is_best(state, valid):  # best.pt at every best validation; no step checkpoint
            run.save(valid, step_file=False)
    if state.step != last_sync_step:  # stopped between two synchronization points
        run.synchronize(elapsed)
        state.tokens, run.pending_tokens = state.tokens + run.pending_tokens, 0
    run.finish(stop_reason)
    return state


class _Run:
    """What one training run holds between its steps: the data, the model and its optimizer (restored
    from the run directory, or fresh), the step, the run directory's checkpoints, the clock, the
    counters of logging and the outputs."""

    def __init__(self, data_dir, run_dir: Path, cfg: RunConfig, progress: bool, held: contextlib.ExitStack,
                 init_from, resume_optimizer: bool):
        data = DataDir(data_dir)
        cfg = fit_to_data(cfg, data)
        t, m = cfg.train, cfg.model
        self.place = place = rt.start(device=t.device, precision=t.precision, timeout_s=t.dist_timeout_s,
                                      tf32=t.tf32, threads=t.threads, seed=t.seed)
        self.dist, self.device = place.dist, place.device
        self.heap = HeapGrowth(TRIM_EVERY_STEPS, when=trim_choice())  # AIAYN_HEAP_TRIM checked at start
        self.validator = Validator(data, cfg.train, cfg.model, place)
        claim = _start_run_dir(run_dir, held) if self.dist.is_main else None
        tokenizers = tokenizer_payload(data)
        resume = last_checkpoint(run_dir, tokenizers, m)  # None: a new run
        saved = resume.saved if resume is not None else None
        # every rank resumes the same checkpoint with the same tokenizers (several machines: RUN shared)
        found = f"{resume.path.name} at step {saved.step}" if saved else "no checkpoint (a new run)"
        rt.check_alike({"--out": found, "--data": f"tokenizers sha256 {tokenizers['src_sha256'][:12]} and "
                                                  f"{tokenizers['tgt_sha256'][:12]}"}, self.dist)
        self.stream = BatchStream(data, batching(t), m, run_dir, self.dist, self.device,
                                  saved.sampler if saved else None)
        for line in unused_settings(t) if self.dist.is_main else ():
            log.warning("%s", line)
        # What a checkpoint restores besides the data position, freshly made: the model (seeded by
        # ``runtime.start``), Adam (§5.3; AdamW with ``weight_decay``; the step sets each step's rate)
        # and fp16's gradient scaler (None otherwise).
        model = Transformer(m).to(self.device)
        self.schedule = schedule_of(cfg)  # the rate of each step, and the run's progress (save_every_frac)
        opt = optimizer_for(model.parameters(), t, self.schedule, self.device)
        scaler = torch.amp.GradScaler(self.device.type) if place.precision == "fp16" else None
        self.learner = Learner(model, opt, scaler)
        if saved is not None:  # resumed exactly: weights, optimizer, generators, counters (the stream's position above)
            self.learner.restore(saved, self.dist)
        elif init_from is not None:
            self.learner.lineage = finetune.init_from(init_from, model, opt, m, tokenizers, resume_optimizer)
        else:  # a new run, named by its seed and initial weights (what ``aiayn average`` compares)
            self.learner.lineage = run_lineage(model.state_dict(), t.seed)
        self.state = TrainState.of(saved) if saved is not None else TrainState()
        self.first_step = self.state.step  # (a finished run started again adds no seconds)
        # the step last validated (and its numbers) and saved: the checkpoint resumed from, if any
        self.validated = (saved.step, saved.valid) if saved is not None and saved.valid else (-1, None)
        self.saved_step = saved.step if saved is not None else -1
        saved_ema = saved.ema if saved is not None else None
        self.checkpoints = RunCheckpoints(run_dir, cfg, tokenizers, self.dist, self.learner, self.stream, resume)
        if t.ema_decay:
            self.learner.ema = WeightAverage(model, t.ema_decay, self.device, saved_ema)
        self.t_start = time.monotonic() - self.state.train_seconds
        self.stepper = TrainStep.for_run(t, self.learner, place, self.schedule, self.clock, run_dir)
        if saved is not None:  # each rank's own Adam, where the ranks keep their own
            self.stepper.strategy.resume_optimizer(self.learner.opt, saved)
        self.n_params = count_parameters(model)
        log.info("model: %s parameters; device %s, precision %s, %s", f"{self.n_params:,}",
                 self.device, place.precision, self.stepper.strategy.describe())
        self.monitor = Monitor(run_dir, self.state, self.dist.is_main, progress, t.max_steps)
        held.callback(self.monitor.end)  # the bar ended, TensorBoard written, however the run stops (Ctrl-C)
        self.pending_tokens = 0  # this rank's target tokens since the last synchronization point
        if claim is not None:  # every check passed: from here on what the run writes stays
            claim.begin()

    def clock(self) -> float:
        return time.monotonic() - self.t_start

    def apply(self, s: Step) -> bool:
        """Count the step, after ``TrainStep.step`` took its update (or skipped it: not finite).
        Returns whether the step counts."""
        state = self.state
        if not s.finite and not self.stepper.strategy.counts_skipped:
            return False
        state.step += 1
        self.pending_tokens += int(s.tokens) if s.finite else 0
        state.train_seconds = self.clock()
        state.history.append((state.step, s.loss / s.tokens))
        self.monitor.advance()
        return True

    def synchronize(self, elapsed: float) -> float:
        """A synchronization point of the ranks (``parallel``): the tokens since the last one, summed
        over the ranks, the FLOPs counted; returns the run's training seconds."""
        self.pending_tokens, mean_clock, flops = self.stepper.strategy.synchronize(
            self.learner.model, self.pending_tokens, self.clock)
        self.state.flops += flops
        return elapsed if mean_clock is None else mean_clock

    def log_step(self, s: Step, due: bool) -> None:
        """Count the tokens since the last synchronization point; where ``due`` (every
        ``train.log_every_steps`` steps) a line of the train log and the progress bar's numbers."""
        self.state.tokens += self.pending_tokens
        self.monitor.count(self.pending_tokens)
        self.pending_tokens = 0
        if due:
            self.monitor.train_step(s.loss, s.nll, s.kl if s.kl_logged else None, s.tokens, s.lr, s.norm,
                                    s.lr_at)

    def validate(self) -> dict | None:
        with self.monitor.paused():  # (not training time for tokens_per_s)
            valid = self.validator(self.learner, self.state, self.monitor.scalars)
        self.release_host_memory()  # validation's batches leave holes of their own sizes
        self.validated = (self.state.step, valid)
        self.state.train_seconds = self.clock()  # the run's seconds hold its validations' (valid_seconds)
        return valid

    def save(self, valid: dict | None, step_file: bool = True) -> None:
        """A checkpoint of the step (``RunCheckpoints.save``); without ``step_file``, ``last.pt`` and
        ``best.pt`` only, between the step checkpoints."""
        with self.monitor.paused():
            self.checkpoints.save(self.state, valid, self.stepper.strategy.rank_optimizers(self.learner.opt), step_file)
        if step_file:
            self.saved_step = self.state.step

    def look_at_heap(self) -> None:
        """Training on the CPU, after each step: every ``TRIM_EVERY_STEPS`` steps the heap's holes back
        to the kernel while it grows (``HeapGrowth``)."""
        if self.device.type == "cpu":
            self.heap.look()

    def release_host_memory(self) -> None:
        """Training on the CPU: the heap's holes back to the kernel, unless AIAYN_HEAP_TRIM=never (aiayn/host/allocator.py)."""
        if self.device.type == "cpu":
            trim_unless_never()

    def finish(self, stop_reason: str) -> None:
        """The end: validate, write the final checkpoint and the summary; a step validated or saved
        already (the last one of the loop, or the checkpoint a finished run resumed from) is not
        again, so that patience and the best count each validation once. The ranks meet a last time
        before the summary, the main rank's alone to write and print."""
        step, valid = self.validated
        fresh = step != self.state.step
        if fresh:
            valid = self.validate()
        if fresh or self.saved_step != self.state.step:
            self.save(valid)
        if fresh or self.state.step != self.first_step:  # the end's validation and checkpoint are the run's seconds
            self.state.train_seconds = self.clock()
        if self.dist.enabled:  # the ranks' last collective: what the main rank does after is its own
            torch.distributed.barrier()  # (a full disk, a closed stdout: its error alone, not a lost peer's)
        if self.dist.is_main:
            self.monitor.close(summary(self.state, self.checkpoints.best_metric, self.n_params, self.place,
                                       stop_reason, valid, self.stream.epochs)
                               | {"parallel": self.stepper.strategy.name})


def _stop_reason(t: TrainConfig, state: TrainState, elapsed: float) -> str | None:
    """Why training stops before its next step ("max_time", "max_flops", "max_epochs", "patience"), or None.
    Checked before every step, so a finished run that is started again stops at once."""
    if t.max_time_min and elapsed >= 60 * t.max_time_min:
        return "max_time"
    if t.max_flops and state.flops >= t.max_flops:
        return "max_flops"
    if t.max_epochs and state.epoch >= t.max_epochs:
        return "max_epochs"
    if t.patience and state.bad_validations >= t.patience:
        return "patience"
    return None


def _shares(progress: float, frac: float) -> int:
    """The multiples of ``frac`` that ``progress`` has reached (``train.save_every_frac``). A progress
    of k * frac exactly (3 of 10 steps, frac 0.1) reaches k, though its quotient may fall a few
    roundings short of k (0.3 / 0.1 = 2.9999999999999996): the share, the epochs' sum, frac's own
    decimal, the division and this product are at most 6 relative errors of 2^-53, within 2^-48."""
    quotient = progress / frac
    return math.floor(quotient * (1 + 2 ** -48))


def _crossed(every: int, since: int, step: int) -> bool:
    """Whether a multiple of ``every`` (0 = never) lies in (since, step]: a step-count event
    fell between the last synchronization point and this one (every step, unless local SGD)."""
    return every > 0 and step // every > since // every
