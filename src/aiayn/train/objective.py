"""The optimizer of §5.3, the learning rate of Eq. 3 and the label-smoothed loss of §5.4.

Shapes: B batch, T target length, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aiayn.model.transformer import PreSoftmax
from aiayn.train.fused_loss import fused_label_smoothed_loss
from aiayn.train.rows import LossSums, acc_dtype, smoothed_row_losses

if TYPE_CHECKING:
    from aiayn.train.config import TrainConfig


def noam_lr(step: float, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), times ``scale``.

    ``step`` counts optimizer steps from 1 (step 0 is treated as step 1).
    """
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def learning_rate(step: float, d_model: int, warmup_steps: int, scale: float = 1.0,
                  max_steps: int = 0, decay_frac: float = 0.0, time_frac: float = 0.0) -> float:
    """Eq. 3 (``noam_lr``), optionally times a linear ramp to zero over the run's last part.

    With ``decay_frac`` f > 0 (a deviation, off by default) the rate is multiplied by
    min(1, (1 - p) / f), where p is the run's progress in [0, 1]: p = step / max_steps,
    or ``time_frac`` (another measure of the run's progress: the share of its epochs or of its
    wall-time budget done) when that is larger.
    The rate is unchanged until p = 1 - f, then falls linearly to 0 at p = 1. Short
    fixed-budget runs end nearer a minimum this way than with Eq. 3's slow step^-0.5 tail
    (budgeted training). ``Schedule.rate`` passes the epochs' share (``train.max_epochs``), so the
    ramp ends with a run that its epochs bound, and the budget's (``train.lr_decay_by_time``), so it
    ends with a wall-time budget on a machine slower than the one ``max_steps`` was chosen for; it
    also measures Eq. 3 itself in the budget (``train.lr_schedule_by_time``).
    """
    lr = noam_lr(step, d_model, warmup_steps, scale)
    if decay_frac > 0 and (max_steps > 0 or time_frac > 0):
        progress = max(step / max_steps if max_steps > 0 else 0.0, time_frac)
        lr *= max(0.0, min(1.0, (1.0 - progress) / decay_frac))
    return lr


@dataclass(frozen=True)
class Schedule:
    """The run's learning rate (Eq. 3 and its named deviations): ``model.d_model`` and the
    ``train`` fields of the same names. ``by_budget``: ``train.lr_decay_by_time`` or
    ``train.lr_schedule_by_time``, the schedules that follow the budget (``budget_fraction``);
    ``whole_by_time``: ``train.lr_schedule_by_time``. ``max_epochs`` (0: no limit): the ramp's
    progress is also the share of these epochs done, where that is further along."""
    d_model: int
    warmup_steps: int
    lr_scale: float
    max_steps: int
    lr_decay_frac: float
    by_budget: bool
    whole_by_time: bool
    max_time_min: float
    max_flops: float
    max_epochs: int = 0

    def budget_fraction(self, elapsed: float, flops: float) -> float:
        """How much of the run's budget is spent: the larger of the wall time's share of
        ``max_time_min`` and the counted FLOPs' share of ``max_flops`` (each 0 where it is not set).
        A run bounded by FLOPs runs the same schedule on any machine, and one bounded by time runs
        it compressed on a slow one."""
        time_frac = elapsed / (60 * self.max_time_min) if self.max_time_min > 0 else 0.0
        flops_frac = flops / self.max_flops if self.max_flops > 0 else 0.0
        return max(time_frac, flops_frac)

    def progress(self, step: int, elapsed: float = 0.0, flops: float = 0.0, epochs: float = 0.0,
                 budget: bool = True) -> float:
        """How much of the run is done: the largest share of its limits (``max_steps``, and with
        ``budget`` the wall time's and counted FLOPs' shares of ``budget_fraction``, and ``max_epochs``),
        each where it is set. What the ramp of ``rate`` follows (with ``budget`` = ``by_budget``) and
        what ``train.save_every_frac`` spaces the checkpoints by (with every limit), so the two never
        measure the run differently."""
        return max(step / self.max_steps if self.max_steps > 0 else 0.0,
                   self.budget_fraction(elapsed, flops) if budget else 0.0,
                   epochs / self.max_epochs if self.max_epochs > 0 else 0.0)

    @property
    def follows_progress(self) -> bool:
        """Whether ``rate`` reads more than the step: the budget's share (``by_budget``, where it moves
        the ramp or Eq. 3's step) or the epochs' (``max_epochs``, where there is a ramp to move)."""
        ramp = self.lr_decay_frac > 0
        return self.by_budget and (ramp or self.whole_by_time and self.max_steps > 0) or ramp and self.max_epochs > 0

    def first(self) -> float:
        """The rate of step 1 (the optimizer's construction)."""
        return self.rate(1)

    def rate(self, step: int, elapsed: float = 0.0, flops: float = 0.0, epochs: float = 0.0) -> float:
        """The rate of optimizer step ``step`` (from 1), after ``elapsed`` training seconds, ``flops``
        counted FLOPs and ``epochs`` epochs (fractional: the data position once the step's batches are
        drawn, so a run that ``max_epochs`` bounds ends its ramp at 0 as one that ``max_steps`` bounds
        does). ``whole_by_time`` takes Eq. 3 at step' = max(step, p * max_steps), p the budget's
        share spent: a slower machine then runs the whole schedule that ``max_steps`` describes (warmup
        to the peak, the step^-0.5 decay, the ramp) in fewer updates, so its warmup ends at the same
        fraction of the budget instead of late or never; a run that reaches ``max_steps`` first has
        step' = step."""
        frac = self.budget_fraction(elapsed, flops) if self.by_budget else 0.0
        at = max(float(step), frac * self.max_steps) if self.whole_by_time and self.max_steps > 0 else step
        return learning_rate(at, self.d_model, self.warmup_steps, self.lr_scale, self.max_steps, self.lr_decay_frac,
                             self.progress(step, elapsed, flops, epochs, budget=self.by_budget))


def make_optimizer(params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                   fused: bool = False) -> torch.optim.Optimizer:
    """§5.3's Adam, or Adam with decoupled weight decay (AdamW; Loshchilov and Hutter, 2019).

    With ``weight_decay`` λ > 0 (``train.weight_decay``, a deviation, 0 by default) each step
    first shrinks every parameter by the current rate, p <- p * (1 - lr * λ), then takes Adam's
    step, so the decay follows Eq. 3's schedule. It applies to every parameter (embeddings,
    biases and LayerNorm gains included), as fairseq's ``--weight-decay`` does.
    """
    cls = torch.optim.AdamW if weight_decay > 0 else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


def optimizer_for(params, t: "TrainConfig", schedule: Schedule, device: torch.device) -> torch.optim.Optimizer:
    """A run's optimizer (``make_optimizer``) from its train section: ``adam_beta1``, ``adam_beta2``,
    ``adam_eps``, ``weight_decay``, and ``fused_adam`` where ``device`` has PyTorch's fused Adam (CPU,
    CUDA); the rate of the schedule's first step (the step sets each step's own)."""
    return make_optimizer(params, schedule.first(), (t.adam_beta1, t.adam_beta2), t.adam_eps, t.weight_decay,
                          fused=t.fused_adam and device.type in ("cpu", "cuda"))


def smoothed_targets(target: Tensor, vocab_size: int, eps_ls: float, pad_id: int) -> Tensor:
    """The label-smoothed target distribution q (the Annotated Transformer's picture).

    Convention: the gold token gets 1 - eps_ls; eps_ls is spread evenly over the V - 2 other
    tokens that are neither the gold token nor padding; the padding token gets 0; rows whose
    target is padding are all zero (they contribute no loss). target (N,) -> q (N,V).
    """
    q = torch.full((target.numel(), vocab_size), eps_ls / (vocab_size - 2), dtype=torch.float64)
    q.scatter_(1, target.view(-1, 1), 1.0 - eps_ls)
    q[:, pad_id] = 0.0
    q[target.view(-1) == pad_id] = 0.0
    return q


def label_smoothed_loss(logits: Tensor | PreSoftmax, target: Tensor, eps_ls: float, pad_id: int,
                        kernels=None) -> LossSums:
    """Cross-entropy against ``smoothed_targets`` (§5.4), summed over non-pad positions.

    logits (B,T,V), or the projection's inputs (``PreSoftmax``: the model's output with
    ``project=False``, ``train.fused_loss``), whose logits are then taken a chunk of rows at a
    time, never whole (``aiayn.train.fused_loss``; ``kernels`` unused). target (B,T). The same sums as ``label_smoothed_loss_reference`` with a
    hand-written backward (``_SmoothedCrossEntropy``): per row only log Z, z_gold, z_pad and
    sum_v z_v are needed forward, and d loss / d z = p - q is written in one pass backward,
    in blocks of rows (``_block_rows``: small enough to stay in cache on the CPU, few and large on a
    GPU), in the logits' dtype. No (N,V) float32
    log-probabilities are kept, which is most of the saving over autograd's log_softmax.

    ``kernels`` (``aiayn.kernels.loader.load()``, or None) does the (N,V) passes of both directions
    in C on the CPU, one read of each row forward and one read and one write backward
    (``cross_entropy.c``; the same sums up to rounding, tested against this module's PyTorch
    path). Other devices and dtypes, or None, take the PyTorch path.
    """
    if isinstance(logits, PreSoftmax):
        return fused_label_smoothed_loss(logits, target, eps_ls, pad_id)
    V = logits.size(-1)
    z = logits.reshape(-1, V)  # (N,V)
    tgt = target.reshape(-1)
    keep = tgt.ne(pad_id)
    if kernels is not None and not kernels.supports_rows(z):
        kernels = None
    loss, nll = _SmoothedCrossEntropy.apply(z, tgt, keep, float(eps_ls), int(pad_id), kernels)
    return LossSums(loss, nll, keep.sum())


_BLOCK_ELEMENTS = 2 ** 20  # CPU: rows per block = this // V (4 MB of float32 per block, kept in cache)
_BLOCK_ELEMENTS_CUDA = 2 ** 28  # CUDA: 1 GiB of float32 per block, a handful of blocks per batch


def _block_rows(z: Tensor) -> int:
    """Rows of z (N,V) per block of the row-wise passes. On the CPU a block fits in cache; on a
    GPU a block costs a round of kernel launches and the host cannot launch them as fast as the
    device runs small ones (with cache-sized blocks it spent far longer launching a batch's kernels
    than the device spent running them; docs/gpu.md), so blocks are as large as memory allows. Same arithmetic per row
    either way, so the sums do not depend on it."""
    elements = _BLOCK_ELEMENTS_CUDA if z.device.type == "cuda" else _BLOCK_ELEMENTS
    return max(1, elements // z.size(-1))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed loss and NLL of logits z (N,V), with gold ids (N,) and row mask.

    With eps' = eps / (V - 2), log Z = logsumexp(z) and s = sum_v z_v, per kept row:
      nll  = log Z - z_g
      loss = log Z - (1 - eps) z_g - eps' (s - z_g - z_pad)       (q sums to 1)
    and d loss / d z = softmax(z) - q, d nll / d z = softmax(z) - onehot(g).
    Statistics are computed in float32 (float64 for float64 logits).
    """

    @staticmethod
    def forward(ctx, z: Tensor, tgt: Tensor, keep: Tensor, eps_ls: float, pad_id: int, kernels=None):
        N, V = z.shape
        acc = acc_dtype(z)
        if kernels is not None:  # (N,V) float32 or bfloat16 rows on the CPU: one read of each
            log_z, sum_z = kernels.cross_entropy_forward(z)
        else:
            block = _block_rows(z)
            log_z = torch.empty(N, dtype=acc, device=z.device)
            sum_z = torch.empty(N, dtype=acc, device=z.device)
            for i in range(0, N, block):
                zf = z[i:i + block].to(acc)  # (b,V)
                torch.logsumexp(zf, dim=-1, out=log_z[i:i + block])
                torch.sum(zf, dim=-1, out=sum_z[i:i + block])
        z_gold = z.gather(1, tgt.unsqueeze(1)).squeeze(1).to(acc)  # (N,)
        loss, nll = smoothed_row_losses(log_z, sum_z, z_gold, z[:, pad_id].to(acc), eps_ls, V)
        w = keep.to(acc)
        ctx.save_for_backward(z, tgt, w, log_z)
        ctx.eps_ls, ctx.pad_id, ctx.kernels = eps_ls, pad_id, kernels
        return (loss * w).sum(), (nll * w).sum()

    @staticmethod
    def backward(ctx, g_loss: Tensor, g_nll: Tensor):
        z, tgt, w, log_z = ctx.saved_tensors
        N, V = z.shape
        eps_ls, pad_id = ctx.eps_ls, ctx.pad_id
        eps_o = eps_ls / (V - 2)
        a = (g_loss + g_nll) * w  # (N,) coefficient of softmax(z)
        c = g_loss * eps_o * w  # (N,) q mass on each non-gold, non-pad token
        gold_extra = (g_loss * (1.0 - eps_ls - eps_o) + g_nll) * w  # (N,) gold: -(1-eps) g_loss - g_nll in all
        if ctx.kernels is not None:
            grad = ctx.kernels.cross_entropy_backward(z, log_z, a.contiguous(), c.contiguous(),
                                                      gold_extra.contiguous(), tgt.contiguous(), pad_id)
            return grad, None, None, None, None, None
        grad = torch.empty_like(z)
        block = _block_rows(z)
        for i in range(0, N, block):
            j = min(N, i + block)
            p = z[i:j].to(log_z.dtype).sub_(log_z[i:j, None]).exp_()  # (b,V) softmax
            p.mul_(a[i:j, None]).sub_(c[i:j, None])
            p[:, pad_id] += c[i:j]  # q_pad = 0
            p.scatter_add_(1, tgt[i:j, None], -gold_extra[i:j, None])
            grad[i:j] = p
        return grad, None, None, None, None, None


def rdrop_kl(logits: Tensor, target: Tensor, pad_id: int) -> Tensor:
    """R-Drop's consistency term (Liang et al., 2021, §2.1), summed over non-pad positions.

    ``logits`` (2B,T,V) holds the same B pairs twice, through two dropout masks: rows [0, B)
    and [B, 2B). Per position, with p1, p2 the two predicted distributions,
      (KL(p1 || p2) + KL(p2 || p1)) / 2 = 1/2 sum_v (p1_v - p2_v) (log p1_v - log p2_v).
    ``target`` (B,T) marks the positions that count (not ``pad_id``). The same value as
    ``rdrop_kl_reference`` with a hand-written backward (``_SymmetricKL``).
    """
    return _SymmetricKL.apply(*_non_pad_halves(logits, target, pad_id))


def _non_pad_halves(logits: Tensor, target: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """The two copies' logits (2B,T,V) at the non-pad positions of ``target`` (B,T): (N,V) each."""
    V = logits.size(-1)
    z1, z2 = logits.reshape(2, -1, V).unbind(0)  # (B*T,V) each
    keep = target.reshape(-1).ne(pad_id)
    return z1[keep], z2[keep]


class _SymmetricKL(torch.autograd.Function):
    """sum over rows of (KL(p1 || p2) + KL(p2 || p1)) / 2 for logits z1, z2 (N,V).

    With d = log p1 - log p2, KL12 = sum_v p1 d and KL21 = -sum_v p2 d, per row:
      f = (KL12 + KL21) / 2,  df/dz1 = (p1 (d - KL12 + 1) - p2) / 2,  df/dz2 = (p2 (-d - KL21 + 1) - p1) / 2.
    Forward writes both gradients in the same pass over each block of rows (training always
    needs them), so each (N,V) statistic is read once, where the autograd form reads each several
    times. Float32 statistics (float64 for float64 logits).
    """

    @staticmethod
    def forward(ctx, z1: Tensor, z2: Tensor):
        N, V = z1.shape
        block = _block_rows(z1)
        acc = acc_dtype(z1)
        g1, g2 = torch.empty_like(z1), torch.empty_like(z2)
        total = torch.zeros((), dtype=acc, device=z1.device)
        for i in range(0, N, block):
            l1 = z1[i:i + block].to(acc, copy=True)  # (b,V), becomes log p1, then p1
            l2 = z2[i:i + block].to(acc, copy=True)
            l1 -= torch.logsumexp(l1, dim=-1, keepdim=True)
            l2 -= torch.logsumexp(l2, dim=-1, keepdim=True)
            d = l1 - l2
            p1, p2 = l1.exp_(), l2.exp_()
            kl12 = (p1.unsqueeze(1) @ d.unsqueeze(2)).view(-1, 1)  # (b,1) row dot products
            kl21 = -(p2.unsqueeze(1) @ d.unsqueeze(2)).view(-1, 1)
            total += 0.5 * (kl12.sum() + kl21.sum())
            g1[i:i + block] = (d + (1 - kl12)).mul_(p1).sub_(p2).mul_(0.5)
            g2[i:i + block] = d.neg_().add_(1 - kl21).mul_(p2).sub_(p1).mul_(0.5)
        ctx.save_for_backward(g1, g2)
        return total

    @staticmethod
    def backward(ctx, g: Tensor):
        g1, g2 = ctx.saved_tensors
        return g1 * g.to(g1.dtype), g2 * g.to(g2.dtype)


def rdrop_kl_reference(logits: Tensor, target: Tensor, pad_id: int) -> Tensor:
    """The plain autograd form of ``rdrop_kl``: the slow path its tests compare to."""
    z1, z2 = _non_pad_halves(logits, target, pad_id)
    acc = acc_dtype(logits)
    lp1 = torch.log_softmax(z1.to(acc), dim=-1)  # (N,V)
    lp2 = torch.log_softmax(z2.to(acc), dim=-1)
    return 0.5 * ((lp1.exp() - lp2.exp()) * (lp1 - lp2)).sum()


def label_smoothed_loss_reference(logits: Tensor, target: Tensor, eps_ls: float, pad_id: int) -> LossSums:
    """The plain autograd form of ``label_smoothed_loss``: the slow path its tests compare to.

    logits (B,T,V), target (B,T). Computed without materializing q:
    loss = -(1-eps) log p_gold - eps/(V-2) (sum_v log p_v - log p_gold - log p_pad).
    One fused log-softmax over all positions (upcast to float32 inside the kernel under
    autocast); padding positions are masked on the (N,) vectors, which is cheaper than a
    logsumexp formulation that first gathers (copies) the real positions.
    """
    V = logits.size(-1)
    z = logits.reshape(-1, V)  # (N,V)
    tgt = target.reshape(-1)
    keep = tgt.ne(pad_id)
    up = torch.float32 if z.dtype in (torch.bfloat16, torch.float16) else None
    lprobs = torch.log_softmax(z, dim=-1, dtype=up)  # (N,V)
    gold = lprobs.gather(1, tgt.unsqueeze(1)).squeeze(1)  # (N,) log p_gold
    nll = -gold
    if eps_ls > 0:
        others = lprobs.sum(-1) - gold - lprobs[:, pad_id]
        loss = (1.0 - eps_ls) * nll - eps_ls / (V - 2) * others
    else:
        loss = nll
    zero = loss.new_zeros(())
    return LossSums(torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum(), keep.sum())
