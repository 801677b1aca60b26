"""One training step (§5): the forward and backward passes over a step's batches, the update, and
the step's numbers read back once. ``train.loop`` takes its steps through these, and so do the
benchmarks (bench/train_throughput.py, bench/gpu_train.py), so what they time is the loop's step.

In order: ``forward_backward`` (gradients accumulate over the batches; the sums stay on the
device), ``grad_norm``, ``update`` (queued before the read where ``update_early``, with the
device flag ``not_finite``), then ``step_numbers`` and ``read_numbers`` (or both: ``read_step``),
the step's one wait for the device.
"""
from __future__ import annotations

import contextlib

import torch

from aiayn.model.attention import attention_backends
from aiayn.model.flops import train_flops
from aiayn.train import runtime as rt
from aiayn.train.config import TrainConfig
from aiayn.train.fused_loss import fused_loss_on
from aiayn.train.objective import label_smoothed_loss, rdrop_kl


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
                 clock_s: float, dist, device, reduce: bool) -> torch.Tensor:
    """The step's numbers as one (6,) float64 vector on the device, not read here: the loss, NLL and
    KL sums (summed over the ranks with ``reduce`` and data parallelism, the ranks' clocks in the
    same all-reduce), the clocks' sum (0 without that all-reduce), the ranks' target tokens
    ``tokens_dev`` (0 without) and the gradient norm (0 where none was taken). The one host value
    sent, the clock, goes without a wait (``host_to_device``)."""
    zero = sums.new_zeros(1)
    if reduce and dist.enabled:
        packed = rt.all_reduce_tensor(torch.cat([sums, rt.host_to_device([clock_s], device)]), dist)  # (4,)
    else:
        packed = torch.cat([sums, zero])
    tail = [tokens_dev if tokens_dev is not None else zero,
            norm.detach().double().view(1) if norm is not None else zero]
    return torch.cat([packed] + tail)


def not_finite(numbers: torch.Tensor) -> torch.Tensor:
    """``update``'s ``skip`` flag for the step of ``numbers`` (``step_numbers``): 1.0 where the loss
    + KL or the gradient norm is not finite, the test ``_Run.apply`` takes on the host."""
    return (~(torch.isfinite(numbers[0] + numbers[2]) & torch.isfinite(numbers[5]))).float()


def read_numbers(numbers: torch.Tensor, summed_tokens: bool, local_tokens: float, clock_s: float, dist,
                 reduce: bool) -> tuple[float, ...]:
    """``step_numbers`` on the host, the step's one wait for the device: (loss, nll, kl, tokens, mean
    clock, norm), the tokens over the ranks where ``summed_tokens`` (else this rank's ``local_tokens``),
    the ranks' mean clock where it was all-reduced (else ``clock_s``)."""
    loss, nll, kl, clock_sum, tokens, norm_value = numbers.tolist()
    mean_clock = clock_sum / dist.world_size if reduce and dist.enabled else clock_s
    return loss, nll, kl, tokens if summed_tokens else local_tokens, mean_clock, norm_value


def read_step(sums: torch.Tensor, norm: torch.Tensor | None, tokens_dev: torch.Tensor | None,
              local_tokens: float, clock_s: float, dist, device, reduce: bool) -> tuple[float, ...]:
    """``step_numbers`` then ``read_numbers``: the step's numbers on the host, in one wait."""
    numbers = step_numbers(sums, norm, tokens_dev, clock_s, dist, device, reduce)
    return read_numbers(numbers, tokens_dev is not None, local_tokens, clock_s, dist, reduce)


def twice(x: torch.Tensor) -> torch.Tensor:
    """A batch stacked on itself along B (R-Drop's two passes in one forward): (B,...) -> (2B,...)."""
    return torch.cat([x, x])
