"""The training loop (§5): ``train``, whose loop reads in one screen (``_train``), and ``_Run``,
what a run holds between its steps. Each part it uses is built once, from the configuration it
needs: the batches (``aiayn.data.stream.BatchStream``), the optimizer step and how the ranks take it
together, as the benchmarks build it too (``aiayn.train.step.TrainStep.for_run``), validation
(``aiayn.train.validation``), the run directory's checkpoints (``aiayn.train.checkpointing.RunCheckpoints``),
the moving average of the weights (``aiayn.train.ema``) and the outputs (``aiayn.train.monitor``).

Per optimizer step: ``accum_steps`` token-bounded batches per device; the loss is the sum of
label-smoothed cross-entropy over every target token of the step on every device, divided by
that total token count; the learning rate follows Eq. 3 with the step counted in optimizer
steps. Checkpoints every N steps / M minutes (atomic); a run directory that holds ``last.pt``
is resumed exactly (model, optimizer, schedule, RNG, data position).
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from aiayn.config import replace
from aiayn.data.dataset import DataDir
from aiayn.data.stream import BatchStream
from aiayn.data.vocab import joint_vocabulary
from aiayn.host.allocator import TRIM_EVERY_STEPS, release_free_memory
from aiayn.model.transformer import Transformer, count_parameters
from aiayn.train import runtime as rt
from aiayn.train.checkpointing import RunCheckpoints, TrainState, tokenizer_payload
from aiayn.train.config import RunConfig, TrainConfig
from aiayn.train.ema import WeightAverage
from aiayn.train.monitor import Monitor, summary
from aiayn.train.objective import learning_rate, make_optimizer
from aiayn.train.rundir import RunLock, remove_stale_temps
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
    return replace(cfg, model=model)


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
        step = run.stepper.queue(batches, state.step + 1, elapsed, state.flops)
        run.stream.prefetch()  # the next step's batches, prepared while the device works
        step = run.stepper.read(step)
        if run.local_sgd:  # counted at the next averaging, so that the ranks agree on the budget
            run.pending_flops += step.flops
        else:  # DDP: the ranks' sum, all-reduced with the step's numbers
            state.flops += step.flops_sum
        if step.mean_clock is not None:
            elapsed = step.mean_clock
        if not run.apply(step):
            continue  # a non-finite step, skipped (local SGD counts it, so the ranks average together)
        if state.step % TRIM_EVERY_STEPS == 0:
            run.release_host_memory()
        if state.step % run.period:
            continue  # local SGD between two averagings: no logging, checkpoint or validation
        if run.local_sgd:
            run.pending_tokens, elapsed, flops = _average_copies(run.model, run.pending_tokens, run.pending_flops,
                                                                 run.clock(), run.dist, run.device)
            state.flops, run.pending_flops = state.flops + flops, 0.0
        run.log_step(step, last_sync_step)
        due_steps = _crossed(t.save_every_steps, last_sync_step, state.step)
        due_time = t.save_every_min and elapsed - last_save >= 60 * t.save_every_min
        due_valid = _crossed(t.validate_every_steps, last_sync_step, state.step)
        last_sync_step = state.step
        valid = run.validate() if due_valid or ((due_steps or due_time) and t.validate_at_save) else None
        if due_steps or due_time:
            run.checkpoints.save(state, valid, run.ema, run.local_sgd)
            last_save = elapsed
    if run.local_sgd and state.step != last_sync_step:  # stopped between two averagings
        tokens, _, flops = _average_copies(run.model, run.pending_tokens, run.pending_flops, run.clock(), run.dist,
                                           run.device)
        state.tokens, state.flops = state.tokens + tokens, state.flops + flops
    run.finish(stop_reason)
    return state


class _Run:
    """What one training run holds between its steps: the data, the model and its optimizer (restored
    from the run directory, or fresh), the step (one process, DDP, or local SGD's copies averaged every
    ``period`` steps), the run directory's checkpoints, the clock, the counters of logging and the outputs."""

    def __init__(self, data_dir, run_dir: Path, cfg: RunConfig, progress: bool, held: contextlib.ExitStack,
                 init_from, resume_optimizer: bool):
        data = DataDir(data_dir)
        self.cfg = cfg = fit_to_data(cfg, data)
        t = cfg.train
        self.dist, self.device, self.precision = rt.start(t)
        self.validator = Validator(data, cfg, self.device, self.precision, self.dist)
        self.stream = BatchStream(data, cfg, run_dir, self.dist, self.device)
        if self.dist.is_main:
            _start_run_dir(run_dir, held)
        # What a checkpoint restores besides the data position, freshly made: the model (seeded by
        # ``runtime.start``), Adam (§5.3; AdamW with ``weight_decay``; ``TrainStep`` sets each step's
        # rate) and fp16's gradient scaler (None otherwise).
        m = cfg.model
        self.model = Transformer(m).to(self.device)
        self.opt = make_optimizer(self.model.parameters(),
                                  learning_rate(1, m.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac),
                                  (t.adam_beta1, t.adam_beta2), t.adam_eps, t.weight_decay,
                                  fused=t.fused_adam and self.device.type in ("cpu", "cuda"))
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.checkpoints = RunCheckpoints(run_dir, cfg, tokenizer_payload(data), self.dist, self.model, self.opt,
                                          self.scaler, self.stream)
        self.state, saved_ema = self.checkpoints.resume_or_start(init_from, resume_optimizer)
        self.ema = WeightAverage(self.model, t.ema_decay, self.device, saved_ema) if t.ema_decay else None
        self.t_start = time.monotonic() - self.state.train_seconds
        self.stepper = TrainStep.for_run(self.model, self.opt, self.scaler, t, m, self.device, self.precision,
                                         self.dist, self.clock, run_dir)
        self.local_sgd, self.period = self.stepper.local_sgd, self.stepper.period
        self.n_params = count_parameters(self.model)
        log.info("model: %s parameters; device %s, precision %s, %d process(es)", f"{self.n_params:,}",
                 self.device, self.precision, self.dist.world_size)
        self.monitor = Monitor(run_dir, self.state, self.dist.is_main, progress, t.max_steps)
        self.pending_tokens = 0
        self.pending_flops = 0.0  # local SGD: this rank's counted FLOPs since the last averaging

    def clock(self) -> float:
        return time.monotonic() - self.t_start

    def mean_clock(self) -> float:
        """The ranks' mean training time: every rank takes the same stop, save and learning-rate
        decisions from it (a rank that stopped alone would leave the others waiting in all_reduce)."""
        return rt.all_reduce_sum([self.clock()], self.dist, self.device)[0] / self.dist.world_size

    def apply(self, s: Step) -> bool:
        """Count the step, after ``TrainStep.settle`` took its update (or skipped it: not finite).
        Returns whether the step counts (a skipped one does under local SGD, so the ranks average
        together)."""
        state = self.state
        finite = self.stepper.settle(s, state.step + 1)
        if not finite and not self.local_sgd:
            return False
        state.step += 1
        if finite and self.ema is not None:
            self.ema.update()
        self.pending_tokens += int(s.tokens) if finite else 0
        state.train_seconds = self.clock()
        state.history.append((state.step, s.loss / s.tokens))
        self.monitor.advance()
        return True

    def log_step(self, s: Step, last_sync_step: int) -> None:
        """Count the tokens since the last synchronization point; every ``log_every_steps`` steps a
        line of the train log and the progress bar's numbers."""
        self.state.tokens += self.pending_tokens
        self.monitor.count(self.pending_tokens)
        self.pending_tokens = 0
        if _crossed(self.cfg.train.log_every_steps, last_sync_step, self.state.step):
            self.monitor.train_step(s.loss, s.nll, s.kl if self.stepper.copies == 2 else None, s.tokens, s.lr)

    def validate(self) -> dict | None:
        with self.ema.weights() if self.ema is not None else contextlib.nullcontext():
            valid = self.validator(self.model, self.state, self.monitor.scalars)
        self.release_host_memory()  # validation's batches leave holes of their own sizes
        return valid

    def release_host_memory(self) -> None:
        """Training on the CPU: the heap's holes back to the kernel (aiayn/host/allocator.py)."""
        if self.device.type == "cpu":
            release_free_memory()

    def finish(self, stop_reason: str) -> None:
        """The end: validate, write the final checkpoint and the summary."""
        valid = self.validate()
        self.checkpoints.save(self.state, valid, self.ema, self.local_sgd)
        if self.dist.is_main:
            self.monitor.close(summary(self.state, self.cfg, self.n_params, self.dist, self.device, self.precision,
                                       stop_reason, valid))
        if self.dist.enabled:
            torch.distributed.barrier()


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


def _crossed(every: int, since: int, step: int) -> bool:
    """Whether a multiple of ``every`` (0 = never) lies in (since, step]: a step-count event
    fell between the last synchronization point and this one (every step, unless local SGD)."""
    return every > 0 and step // every > since // every


def _average_copies(model, tokens: int, flops: float, seconds: float, dist, device) -> tuple[int, float, float]:
    """Local SGD's averaging: every rank's copy of the model becomes the copies' mean; returns the
    ranks' target tokens since the last averaging, summed, their mean training time, and their
    counted FLOPs since the last averaging, summed."""
    rt.average_parameters(list(model.parameters()), dist)
    tokens_sum, seconds_sum, flops_sum = rt.all_reduce_sum([float(tokens), seconds, flops], dist, device)
    return int(tokens_sum), seconds_sum / dist.world_size, flops_sum


