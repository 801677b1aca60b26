"""One training step (§5): the forward and backward passes over a step's batches, the update, and
the step's numbers read back once. ``TrainStep`` is the step: ``train.loop`` takes its steps
through it, and so do the benchmarks (bench/train_throughput.py, bench/gpu_train.py), so what they
time is the loop's step.

Its parts, in order: Eq. 3's rate (``objective.learning_rate``), ``forward_backward`` (gradients
accumulate over the batches; the sums stay on the device), ``grad_norm``, ``update`` (queued before
the read where ``update_early``, with the device flag ``not_finite``), then ``step_numbers`` and
``read_numbers`` (or both: ``read_step``), the step's one wait for the device.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from aiayn import execution
from aiayn.errors import UserError
from aiayn.execution.attention import attention_backends
from aiayn.model.config import ModelConfig
from aiayn.train import runtime as rt
from aiayn.train.config import TrainConfig
from aiayn.train.flops import train_flops
from aiayn.train.fused_loss import fused_loss_on
from aiayn.train.objective import label_smoothed_loss, learning_rate, rdrop_kl

log = logging.getLogger(__name__)


def train_kernels(t: TrainConfig, device: torch.device):
    """The C kernels for the loss and the attention (``train.c_kernels``, CPU only), or None for
    PyTorch's operations."""
    if not t.c_kernels or device.type != "cpu":
        return None
    from aiayn.kernels.loader import load
    return load()


def forward_backward(net, micro: list, t: TrainConfig, m, copies: int, grad_scale, device,
                     precision: str, kernels, scaler, synced: bool) -> tuple[torch.Tensor, float]:
    """One optimizer step's forward and backward passes over its batches, gradients accumulating.

    Each batch's objective (§5.4's label-smoothed loss, summed over its tokens; with R-Drop the
    two copies' losses plus ``rdrop_alpha`` times their symmetric KL) is multiplied by
    ``grad_scale`` (a float, or a device tensor) before ``backward``. A DDP ``net`` (``synced``)
    all-reduces only on the last batch. Returns this rank's summed loss, NLL and KL (per copy) as
    one (3,) float64 tensor on the device, never read here (no wait for the device), and the step's
    counted FLOPs.
    """
    sums3 = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, kl
    flops = 0.0
    for j, b in enumerate(micro):
        b = b.to(device)
        last = j == len(micro) - 1
        with (net.no_sync() if synced and not last else contextlib.nullcontext()), \
                attention_backends(device, t.cudnn_attention):
            src, tgt_in, tgt_out = b.src, b.tgt_in, b.tgt_out
            if copies == 2:
                src, tgt_in, tgt_out = twice(src), twice(tgt_in), twice(tgt_out)
            fused = copies == 1 and fused_loss_on(t.fused_loss, device)  # R-Drop needs the logits
            with rt.autocast(device, precision):
                logits = net(src, tgt_in, project=not fused, src_padded=b.src_padded)  # (copies*B, T, V), or PreSoftmax
            sums = label_smoothed_loss(logits, tgt_out, t.eps_ls, m.pad_id, kernels)
            objective = sums.loss
            if copies == 2:
                kl = rdrop_kl(logits, b.tgt_out, m.pad_id)
                objective = objective + t.rdrop_alpha * kl
                sums3[2] += kl.detach().double()
            scaled = objective * grad_scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        sums3[0] += sums.loss.detach().double() / copies
        sums3[1] += sums.nll.detach().double() / copies
        bs, S = src.shape
        flops += train_flops(m, bs, S, b.tgt_in.size(1))
    return sums3, flops


def update_early(opt, scaler) -> bool:
    """Whether a step's update is queued before its numbers are read (the device then goes on while the
    host reads them): with fused Adam, which takes a device flag that skips its step (``update``'s
    ``skip``); not under fp16's scaler, which has its own."""
    return scaler is None and bool(opt.defaults.get("fused"))


def grad_norm(model, scaler) -> torch.Tensor | None:
    """The accumulated gradients' total 2-norm as a device scalar (not read here), or None under
    fp16's loss scaling, whose scaler finds non-finite gradients itself and skips their step."""
    if scaler is not None:
        return None
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


def update(model, opt, scaler, clip_norm: float, norm: torch.Tensor | None = None,
           skip: torch.Tensor | None = None) -> None:
    """The optimizer step on the accumulated gradients (unscaled first under fp16's loss
    scaling, clipped to ``clip_norm`` if > 0, with ``norm`` from ``grad_norm`` where given),
    then the gradients cleared. ``skip`` (fused Adam, no scaler): a float32 flag on the device,
    1 = leave the parameters, Adam's moments and its step count as they are (the fused step's
    ``found_inf``, which fp16's scaler sets the same way), so the update is queued unread."""
    if scaler is not None:
        scaler.unscale_(opt)
    if clip_norm > 0:
        if norm is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        else:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_norm, norm)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    elif skip is not None:
        if not opt.defaults.get("fused"):
            raise ValueError("update: skip needs a fused optimizer")
        opt.found_inf = skip
        try:
            opt.step()
        finally:
            del opt.found_inf
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def step_numbers(sums: torch.Tensor, norm: torch.Tensor | None, tokens_dev: torch.Tensor | None,
                 clock_s: float, dist, device, reduce: bool, flops: float = 0.0) -> torch.Tensor:
    """The step's numbers as one (7,) float64 vector on the device, not read here: the loss, NLL and
    KL sums (summed over the ranks with ``reduce`` and data parallelism, the ranks' clocks and counted
    ``flops`` in the same all-reduce), the clocks' sum (0 without that all-reduce), the ranks' target
    tokens ``tokens_dev`` (0 without), the gradient norm (0 where none was taken) and the FLOPs' sum (0
    without the all-reduce: ``read_numbers`` then takes this rank's from the host). The host values
    sent, the clock and the FLOPs, go without a wait (``host_to_device``)."""
    zero = sums.new_zeros(1)
    if reduce and dist.enabled:
        packed = rt.all_reduce_tensor(torch.cat([sums, rt.host_to_device([clock_s, flops], device)]), dist)  # (5,)
        head, flops_t = packed[:4], packed[4:]
    else:
        head, flops_t = torch.cat([sums, zero]), zero
    tail = [tokens_dev if tokens_dev is not None else zero,
            norm.detach().double().view(1) if norm is not None else zero]
    return torch.cat([head] + tail + [flops_t])


def not_finite(numbers: torch.Tensor) -> torch.Tensor:
    """``update``'s ``skip`` flag for the step of ``numbers`` (``step_numbers``): 1.0 where the loss
    + KL or the gradient norm is not finite, the test ``TrainStep.settle`` takes on the host."""
    return (~(torch.isfinite(numbers[0] + numbers[2]) & torch.isfinite(numbers[5]))).float()


def read_numbers(numbers: torch.Tensor, summed_tokens: bool, local_tokens: float, clock_s: float, dist,
                 reduce: bool, flops: float = 0.0) -> tuple[float, ...]:
    """``step_numbers`` on the host, the step's one wait for the device: (loss, nll, kl, tokens, mean
    clock, norm, flops), the tokens over the ranks where ``summed_tokens`` (else this rank's ``local_tokens``),
    the ranks' mean clock and summed FLOPs where they were all-reduced (else ``clock_s`` and ``flops``)."""
    loss, nll, kl, clock_sum, tokens, norm_value, flops_sum = numbers.tolist()
    reduced = reduce and dist.enabled
    mean_clock = clock_sum / dist.world_size if reduced else clock_s
    return (loss, nll, kl, tokens if summed_tokens else local_tokens, mean_clock, norm_value,
            flops_sum if reduced else flops)


def read_step(sums: torch.Tensor, norm: torch.Tensor | None, tokens_dev: torch.Tensor | None,
              local_tokens: float, clock_s: float, dist, device, reduce: bool, flops: float = 0.0) -> tuple[float, ...]:
    """``step_numbers`` then ``read_numbers``: the step's numbers on the host, in one wait."""
    numbers = step_numbers(sums, norm, tokens_dev, clock_s, dist, device, reduce, flops)
    return read_numbers(numbers, tokens_dev is not None, local_tokens, clock_s, dist, reduce, flops)


def budget_fraction(t, elapsed: float, flops: float) -> float:
    """How much of the run's budget is spent: the larger of the wall time's share of ``max_time_min``
    and the counted FLOPs' share of ``max_flops`` (each 0 where it is not set). The time-based
    schedules (``lr_decay_by_time``, ``lr_schedule_by_time``) follow it, so a run bounded by FLOPs
    runs the same schedule on any machine, and one bounded by time runs it compressed on a slow one."""
    time_frac = elapsed / (60 * t.max_time_min) if t.max_time_min > 0 else 0.0
    flops_frac = flops / t.max_flops if t.max_flops > 0 else 0.0
    return max(time_frac, flops_frac)


def twice(x: torch.Tensor) -> torch.Tensor:
    """A batch stacked on itself along B (R-Drop's two passes in one forward): (B,...) -> (2B,...)."""
    return torch.cat([x, x])


@dataclass
class Step:
    """One optimizer step in flight (``TrainStep.queue``), then its numbers on the host (``TrainStep.read``)."""
    numbers: torch.Tensor  # (7,) ``step_numbers`` on the device
    norm: torch.Tensor | None  # the gradient norm on the device (None under fp16)
    summed_tokens: bool  # DDP: ``numbers`` holds the ranks' target tokens
    local_tokens: int
    lr: float
    clock_s: float  # this rank's clock when the step was queued
    flops: float  # this rank's counted FLOPs (``train.flops.train_flops``)
    updated: bool = False  # the update is queued already (``update_early``)
    loss: float = 0.0
    nll: float = 0.0
    kl: float = 0.0
    tokens: float = 0.0  # the step's target tokens over the ranks (this rank's with local SGD)
    norm_value: float = 0.0
    mean_clock: float | None = None  # DDP: the ranks' mean clock
    flops_sum: float = 0.0  # DDP: the ranks' counted FLOPs, summed (else this rank's)


class TrainStep:
    """The training loop's optimizer step (§5), for one process, DDP or local SGD's copies.

    ``queue`` sets Eq. 3's rate and queues the forward and backward passes (and the update, where
    ``update_early``) on the device, nothing read back; ``read`` is the step's one wait for the
    device; ``settle`` takes the update after the read, or skips a step whose loss or gradient norm
    is not finite (``t.max_bad_steps`` in a row stop the run). The loss is a sum over the step's
    tokens divided by their count: over all ranks with DDP, which averages gradients (per copy, as
    R-Drop's criterion divides by the doubled batch's tokens); over this rank's with local SGD, whose
    copies are averaged. DDP's count is all-reduced on the device and scales the loss there.

    ``plain_net``: ``model``, or its DDP wrapper; ``net``: that, or ``plain_net`` compiled
    (``runtime.compile_model``); a compiled net that fails is dropped for the plain one.
    ``clock``: the run's clock in seconds (queued steps record it; local SGD's time-based
    schedules read it).
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler, t: TrainConfig, m: ModelConfig,
                 device: torch.device, precision: str, kernels=None, dist: rt.Dist | None = None,
                 plain_net: torch.nn.Module | None = None, net: torch.nn.Module | None = None,
                 local_sgd: bool = False, clock: Callable[[], float] = time.monotonic,
                 run_dir: Path | None = None):
        self.model, self.opt, self.scaler, self.t, self.m = model, opt, scaler, t, m
        self.device, self.precision, self.kernels = device, precision, kernels
        self.dist = dist if dist is not None else rt.Dist()
        self.plain_net = plain_net if plain_net is not None else model
        self.net = net if net is not None else self.plain_net
        self.local_sgd, self.clock, self.run_dir = local_sgd, clock, run_dir
        self.ddp = self.dist.enabled and not local_sgd
        self.period = t.local_sgd_period if local_sgd else 1  # steps between two synchronization points
        self.copies = 2 if t.rdrop_alpha > 0 else 1  # R-Drop feeds every batch twice
        self.update_early = update_early(opt, scaler)
        self.bad_in_row = 0
        # torch.compile traces PyTorch's attention; the C kernels' calls would break its graphs
        execution.apply(model, execution.training(t, device, None if self.net is not self.plain_net else kernels))

    @classmethod
    def for_run(cls, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler, t: TrainConfig, m: ModelConfig,
                device: torch.device, precision: str, dist: rt.Dist | None = None,
                clock: Callable[[], float] = time.monotonic, run_dir: Path | None = None) -> "TrainStep":
        """A training run's step, from how its ranks train together: one process; DDP, where every
        step is a synchronization point; or local SGD (``train.local_sgd_period``), where every
        process trains its own copy of the model, from the main rank's weights, and ``train.loop``
        averages the copies every ``period`` steps. The net compiled with ``train.compile``; on the
        CPU the C kernels (``train.c_kernels``) and the linear maps' padded rows (``train.cpu_row_bits``).
        The benchmarks build their step here too (one process)."""
        dist = dist if dist is not None else rt.Dist()
        local_sgd = dist.enabled and t.local_sgd_period > 0
        if local_sgd:
            rt.broadcast_parameters(list(model.parameters()), dist)
        ddp = dist.enabled and not local_sgd
        plain_net = rt.data_parallel(model, static_graph=t.accum_steps == 1 and not t.compile) if ddp else model
        net = rt.compile_model(plain_net) if t.compile else plain_net
        return cls(model, opt, scaler, t, m, device, precision, train_kernels(t, device), dist, plain_net, net,
                   local_sgd, clock, run_dir)

    def queue(self, micro: list, step: int, elapsed: float = 0.0, flops: float = 0.0) -> Step:
        """Optimizer step ``step`` (counted from 1) over the batches ``micro``: Eq. 3's rate, then the
        forward and backward passes, queued on the device. ``elapsed``: the run's training seconds
        (the ranks' mean under DDP), ``flops``: its counted FLOPs over all ranks so far, for the
        schedules measured in the run's budget (``budget_fraction``)."""
        t, dist, device = self.t, self.dist, self.device
        local_tokens = sum(b.n_tgt_tokens for b in micro)
        tokens_dev = rt.all_reduce_tensor(rt.host_to_device([float(local_tokens)], device), dist) if self.ddp else None
        by_budget = t.lr_decay_by_time or t.lr_schedule_by_time
        budget_frac = budget_fraction(t, self.clock() if self.local_sgd else elapsed, flops) if by_budget else 0.0
        lr = learning_rate(step, self.m.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac,
                           budget_frac, t.lr_schedule_by_time)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.ddp:
            grad_scale = (dist.world_size / (self.copies * tokens_dev)).float().reshape(())  # on the device
        else:
            grad_scale = 1 / (self.copies * float(local_tokens))
        args = (micro, t, self.m, self.copies, grad_scale, device, self.precision, self.kernels, self.scaler)
        try:
            sums, flops = forward_backward(self.net, *args, synced=self.ddp)
        except Exception as exc:  # compiling fails in many ways; the plain model raises real errors again
            if self.net is self.plain_net:
                raise
            self._without_compile(exc)
            sums, flops = forward_backward(self.net, *args, synced=self.ddp)
        norm = grad_norm(self.model, self.scaler)
        clock_s = self.clock()
        numbers = step_numbers(sums, norm, tokens_dev, clock_s, dist, device, reduce=not self.local_sgd, flops=flops)
        s = Step(numbers, norm, tokens_dev is not None, local_tokens, lr, clock_s, flops)
        if self.update_early:  # skipped on the device where the step is not finite, as ``settle`` decides
            update(self.model, self.opt, self.scaler, t.clip_norm, norm, skip=not_finite(numbers))
            s.updated = True
        return s

    def _without_compile(self, exc: Exception) -> None:
        """torch.compile failed (compiling happens at the first forward, and backward, of each new
        shape): the run goes on with the plain model (and the C kernels, where it has them), after a
        warning that says why. (Under DDP a failure in backward leaves DDP's reducer mid-step, and the
        next forward says so: only the forward's failures are taken back there.)"""
        log.warning("torch.compile failed (%s: %s); training without it", type(exc).__name__, str(exc)[:500])
        self.opt.zero_grad(set_to_none=True)  # what the failed pass accumulated
        self.net = self.plain_net
        execution.use_attention_kernels(self.model, self.kernels)

    def read(self, s: Step) -> Step:
        """The step's numbers on the host: its one wait for the device (``read_numbers``)."""
        s.loss, s.nll, s.kl, s.tokens, mean_clock, s.norm_value, s.flops_sum = read_numbers(
            s.numbers, s.summed_tokens, float(s.local_tokens), s.clock_s, self.dist, not self.local_sgd, s.flops)
        s.mean_clock = mean_clock if self.ddp else None
        return s

    def settle(self, s: Step, step: int) -> bool:
        """The update of step ``step`` if its loss (R-Drop's KL term included: it reaches the gradients
        too) and gradient norm are finite (queued by ``queue`` already where ``update_early``); else the
        step is skipped, and ``t.max_bad_steps`` in a row stop the run. Returns whether it was finite."""
        finite = math.isfinite(s.loss + s.kl) and math.isfinite(s.norm_value)  # (``not_finite`` on the device)
        if finite:
            self.bad_in_row = 0
            if not s.updated:
                update(self.model, self.opt, self.scaler, self.t.clip_norm, s.norm)
            return True
        self.bad_in_row += 1
        if not s.updated:  # (a queued update was skipped on the device, and cleared the gradients)
            self.opt.zero_grad(set_to_none=True)
        log.warning("step %d: non-finite loss or gradient (loss %s, gradient norm %s); skipping the update "
                    "(%d in a row)", step, s.loss, s.norm_value, self.bad_in_row)
        if self.bad_in_row >= self.t.max_bad_steps:
            last = f" The last good checkpoint is {self.run_dir / 'last.pt'};" if self.run_dir is not None else ""
            raise UserError(f"{self.bad_in_row} non-finite losses or gradients in a row at step {step}; stopping."
                            f"{last} try a lower lr_scale or precision=fp32")
        return False
