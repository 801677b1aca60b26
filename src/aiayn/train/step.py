"""One training step (§5), ``TrainStep.step``: the loop's and the benchmarks' (bench/train_throughput.py,
bench/gpu_train.py), made from the run's train section by ``TrainStep.for_run``. How the ranks take it
together is a strategy of ``aiayn.train.parallel``; the loss, plain or R-Drop's, one of
``aiayn.train.loss``. In order: Eq. 3's rate (``objective.Schedule``), the forward and backward passes
(gradients accumulate over the batches; the sums stay on the device), ``grad_norm``, the update
(``aiayn.train.updates``: queued before the read where ``update_early``, with the device flag
``not_finite``), the step's one wait for the device, then the update after it (or the step skipped).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from aiayn.checkpoint.run import Learner, last_good
from aiayn.errors import UserError
from aiayn.execution import Execution, apply, compiled, training
from aiayn.execution.attention import attention_backends
from aiayn.kernels.loader import for_training
from aiayn.train import parallel
from aiayn.train.config import TrainConfig
from aiayn.train.flops import train_flops
from aiayn.train.fused_loss import fused_loss_on
from aiayn.train.loss import make_loss
from aiayn.train.objective import Schedule
from aiayn.train.parallel import OneProcess, Read
from aiayn.train.runtime import Place
from aiayn.train.updates import grad_norm, not_finite, update, update_early

log = logging.getLogger(__name__)

# fp16's loss scale below which its gradients are taken to be non-finite at any scale (fairseq's
# --min-loss-scale): GradScaler starts at 2^16, so some 30 skipped updates in a row with no growth between
MIN_LOSS_SCALE = 1e-4


@dataclass(frozen=True)
class StepRules:
    """What a step follows besides its rate and loss: the ``train`` fields of the same names; DDP's
    ``static_graph`` (``parallel.data_parallel``); ``execution``: how the model computes on its device
    (``aiayn.execution.training``: the C kernels, fp32 attention, fast dropout, padded rows)."""
    clip_norm: float = 0.0
    max_bad_steps: int = 5
    cudnn_attention: bool = False
    compile: bool = False
    static_graph: bool = True
    execution: Execution = Execution()


@dataclass
class Step(Read):
    """A step's numbers on the host (``parallel.Read``), its rate, whether it was finite (updated)."""
    lr: float = 0.0
    lr_at: dict = field(default_factory=dict)  # the progress the rate was taken at: ``Schedule.rate``'s keywords
    finite: bool = True
    kl_logged: bool = False  # its loss has a KL term to log (R-Drop's)


class TrainStep:
    """The training loop's optimizer step (§5). The loss is a sum over the step's tokens divided by their
    count (``strategy.grad_scale``: the tokens of the ranks whose gradients are averaged; per pass, as
    R-Drop's criterion divides by the doubled batch's tokens). A non-finite step is skipped, and
    ``rules.max_bad_steps`` in a row stop the run. ``clock``: the run's clock in seconds."""

    def __init__(self, learner: Learner, loss, strategy: OneProcess, schedule: Schedule,
                 rules: StepRules = StepRules(), clock: Callable[[], float] = time.monotonic,
                 run_dir: Path | None = None):
        self.learner, self.loss, self.strategy, self.schedule, self.rules = learner, loss, strategy, schedule, rules
        self.clock, self.run_dir, self.bad_in_row = clock, run_dir, 0
        self.update_early = update_early(learner.opt, learner.scaler)
        # the net: the model, or its DDP wrapper, compiled with ``train.compile`` (``parallel.compile_model``)
        self.plain_net, self.net = strategy.prepare(learner.model, rules.static_graph, rules.compile)
        # the one place the model meets its device's speed code; torch.compile traces PyTorch's attention
        apply(learner.model, rules.execution if self.net is self.plain_net else compiled(rules.execution))

    @classmethod
    def for_run(cls, t: TrainConfig, learner: Learner, place: Place, schedule: Schedule,
                clock: Callable[[], float] = time.monotonic, run_dir: Path | None = None) -> "TrainStep":
        """The step of a run of train section ``t`` on ``place``: §5.4's loss, wrapped by R-Drop with
        ``t.rdrop_alpha``; how the ranks train together (``parallel.for_run``); the net compiled with
        ``t.compile``; how the model computes on its device (``aiayn.execution.training``)."""
        device = place.device
        kernels = for_training(t.c_kernels, device)
        m = learner.model.cfg
        loss = make_loss(t.eps_ls, m.pad_id, kernels, fused_loss_on(t.fused_loss, device), t.rdrop_alpha)
        if t.rdrop_alpha > 0 and m.p_drop == m.p_drop_attn == m.p_drop_ffn == 0:
            log.warning("train.rdrop_alpha without dropout (model.p_drop, p_drop_attn and p_drop_ffn are 0): R-Drop's "
                        "two passes are the same and their KL is 0, at twice a step's compute")
        rules = StepRules(t.clip_norm, t.max_bad_steps, t.cudnn_attention, t.compile,
                          static_graph=t.accum_steps == 1 and not t.compile, execution=training(t, device, kernels))
        return cls(learner, loss, parallel.for_run(t, place), schedule, rules, clock, run_dir)

    def step(self, micro: list, n: int, elapsed: float = 0.0, flops: float = 0.0, epochs: float = 0.0,
             while_busy: Callable[[], None] | None = None) -> Step:
        """Optimizer step ``n`` (counted from 1) over the batches ``micro``. ``elapsed``: the run's
        training seconds (the ranks' mean under DDP), ``flops``: its counted FLOPs over all ranks so
        far, for the schedules measured in the run's budget; ``epochs``: the epochs done once ``micro``
        was drawn (``BatchStream.epochs``), for the ramp of ``train.max_epochs``. ``while_busy`` runs
        while the device computes, before the step's one wait (the loop draws the next step's batches there)."""
        learner, strategy = self.learner, self.strategy
        local_tokens = sum(b.n_tgt_tokens for b in micro)
        tokens_dev = strategy.step_tokens(local_tokens)
        lr_at = {"elapsed": strategy.budget_seconds(elapsed, self.clock), "flops": flops, "epochs": epochs}
        lr = self.schedule.rate(n, **lr_at)
        for group in learner.opt.param_groups:
            group["lr"] = lr
        scale = strategy.grad_scale(local_tokens, tokens_dev, self.loss.passes)
        try:
            sums, step_flops = self.passes(micro, scale)
        except Exception as exc:  # compiling fails in many ways; the plain model raises real errors again
            if self.net is self.plain_net:
                raise
            self._without_compile(exc)
            sums, step_flops = self.passes(micro, scale)
        norm = grad_norm(learner.params, learner.scaler, learner.opt)
        clock_s = self.clock()
        numbers = strategy.numbers(sums, norm, tokens_dev, clock_s, step_flops)
        if self.update_early:  # skipped on the device where the step is not finite, as the host decides below
            update(learner, self.rules.clip_norm, norm, skip=not_finite(numbers))
        if while_busy is not None:
            while_busy()
        s = Step(**vars(strategy.read(numbers, local_tokens, clock_s, step_flops)), lr=lr, lr_at=lr_at,
                 kl_logged=self.loss.kl_logged)
        s.finite = self._settle(s, n, norm)
        if s.finite and learner.ema is not None:
            learner.ema.update()  # the moving average of the weights, after the update
        return s

    def passes(self, micro: list, scale) -> tuple[torch.Tensor, float]:
        """The forward and backward passes over the step's batches, gradients accumulating: each
        batch's objective times ``scale`` (a float, or a device tensor). Returns this rank's summed
        loss, NLL and KL (per pass) as one (3,) float64 tensor on the device, never read here, and
        the step's counted FLOPs."""
        place, scaler, m = self.strategy.place, self.learner.scaler, self.learner.model.cfg
        sums3 = torch.zeros(3, dtype=torch.float64, device=place.device)  # loss, nll, kl
        flops = 0.0
        for j, b in enumerate(micro):
            b = b.to(place.device)
            with self.strategy.no_sync(self.net, j == len(micro) - 1), \
                    attention_backends(place.device, self.rules.cudnn_attention):
                terms = self.loss(self.net, b, place)
                scaled = terms.objective * scale
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            sums3 += terms.sums
            bs, S = b.src.shape
            flops += train_flops(m, self.loss.passes * bs, S, b.tgt_in.size(1))
        return sums3, flops

    def _without_compile(self, exc: Exception) -> None:
        """torch.compile failed (at the first forward, and backward, of each new shape): the run goes on
        with the plain model and its execution (the C kernels, fast dropout, padded rows), after a warning that says why. (A
        failure in DDP's backward leaves its reducer mid-step: only the forward's are taken back there.)"""
        log.warning("torch.compile failed (%s: %s); training without it", type(exc).__name__, str(exc)[:500])
        self.learner.opt.zero_grad(set_to_none=True)  # what the failed pass accumulated
        self.net = self.plain_net
        apply(self.learner.model, self.rules.execution)  # the plain net's execution, C kernels and all

    def _settle(self, s: Step, n: int, norm: torch.Tensor | None) -> bool:
        """The update of step ``n`` if its loss (R-Drop's KL term included: it reaches the gradients too)
        and gradient norm are finite (queued already where ``update_early``); else the step is skipped.
        Under fp16, a finite loss behind gradients that are not finite is the scaler's overflow: the
        update skipped and the scale halved, as fairseq does, without counting towards
        ``max_bad_steps``; should the scale fall below ``MIN_LOSS_SCALE`` (gradients not finite at any
        scale: a NaN behind a finite loss), the run stops: left alone it reaches 0, and the next finite
        gradients are unscaled as 0 x 1/0, NaN written into the weights."""
        finite = math.isfinite(s.loss + s.kl) and math.isfinite(s.norm)  # (``not_finite`` on the device)
        if finite:
            self.bad_in_row = 0
            if not self.update_early:
                update(self.learner, self.rules.clip_norm, norm)
            return True
        scaler, says = self.learner.scaler, self.strategy.step_log(log)  # (local SGD: this rank's own step)
        last = f" {last_good(self.run_dir)};" if self.run_dir is not None else ""
        if not self.update_early:  # (a queued update was skipped on the device, and cleared the gradients)
            self.learner.opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()  # halves the scale: ``grad_norm``'s unscaling found the overflow
            if (scale := scaler.get_scale()) < MIN_LOSS_SCALE:
                raise UserError(f"fp16's loss scale fell to {scale:g} at step {n}, below {MIN_LOSS_SCALE:g}: the "
                                f"gradients are not finite at any scale and their updates were skipped; stopping."
                                f"{last} try train.precision=fp32 (bf16 where the GPU has it natively) or a lower "
                                f"lr_scale")
            if math.isfinite(s.loss + s.kl):
                says.info("step %d: fp16 gradients overflowed; its update skipped, the loss scale now %g", n, scale)
                return False
        self.bad_in_row += 1
        says.warning("step %d: non-finite loss or gradient (loss %s, gradient norm %s); skipping the update "
                     "(%d in a row)", n, s.loss, s.norm, self.bad_in_row)
        if self.bad_in_row >= self.rules.max_bad_steps:
            raise UserError(f"{self.bad_in_row} non-finite losses or gradients in a row at step {n}; stopping."
                            f"{last} try a lower lr_scale or precision=fp32")
        return False
