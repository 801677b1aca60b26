"""How the processes of a run train together, three strategies of one interface (§5.2 trained on 8
GPUs): ``OneProcess``; ``DataParallel`` (DDP), where every step is a synchronization point whose
gradients are averaged; and ``LocalSGD`` (``train.local_sgd_period``), where every process trains its
own copy of the model, from the main rank's weights, with its own Adam, and the copies are averaged
every ``period`` steps. ``for_place`` picks one; the training step (``aiayn.train.step``) and loop
(``aiayn.train.loop``) call the same methods whichever it is.

A step's numbers travel as one (7,) float64 vector on the device (``numbers``): the loss, NLL and KL
sums, the ranks' clocks summed (0 where not all-reduced), the ranks' target tokens (0 where not
all-reduced), the gradient norm (0 where none was taken) and the ranks' counted FLOPs summed (0 where
not all-reduced); ``read`` is the step's one wait for the device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from aiayn.train import runtime as rt


@dataclass
class Read:
    """A step's numbers on the host (``read``)."""
    loss: float
    nll: float
    kl: float
    tokens: float  # the step's target tokens over the ranks (this rank's where not all-reduced)
    norm: float
    flops: float  # the ranks' counted FLOPs summed where all-reduced, else this rank's
    mean_clock: float | None  # the ranks' mean clock where all-reduced, else None


def pack(sums: torch.Tensor, norm: torch.Tensor | None, tokens_dev: torch.Tensor | None,
         reduced: torch.Tensor | None) -> torch.Tensor:
    """The (7,) vector of the module docstring from the (3,) sums, the norm, the all-reduced tokens
    and the all-reduced (5,) sums, clocks and FLOPs (None: not all-reduced)."""
    zero = sums.new_zeros(1)
    head, flops_t = (reduced[:4], reduced[4:]) if reduced is not None else (torch.cat([sums, zero]), zero)
    tail = [tokens_dev if tokens_dev is not None else zero,
            norm.detach().double().view(1) if norm is not None else zero]
    return torch.cat([head] + tail + [flops_t])


class OneProcess:
    """One process: the loss is divided by the step's own target tokens; every step a
    synchronization point; its clock is the run's."""

    period = 1  # steps between two synchronization points
    counts_skipped = False  # a non-finite step counts as a step (so the ranks average together)

    def __init__(self, place: rt.Place):
        self.place = place

    def prepare(self, model: torch.nn.Module, static_graph: bool) -> torch.nn.Module:
        """The net the step runs (``static_graph``: the same graph at every step, DDP's option)."""
        return model

    def no_sync(self, net, last: bool):
        """The context of a batch's backward (DDP: no all-reduce but on the step's last batch)."""
        return contextlib.nullcontext()

    def step_tokens(self, local_tokens: int) -> torch.Tensor | None:
        """The ranks' target tokens of the step, on the device (None: not all-reduced)."""
        return None

    def grad_scale(self, local_tokens: int, tokens_dev: torch.Tensor | None, passes: int):
        """What the step's summed objective is multiplied by before backward."""
        return 1 / (passes * float(local_tokens))

    def numbers(self, sums, norm, tokens_dev, clock_s: float, flops: float) -> torch.Tensor:
        return pack(sums, norm, tokens_dev, None)

    def read(self, numbers: torch.Tensor, local_tokens: int, clock_s: float, flops: float) -> Read:
        loss, nll, kl, _, _, norm, _ = numbers.tolist()
        return Read(loss, nll, kl, float(local_tokens), norm, flops, None)

    def budget_seconds(self, elapsed: float, clock) -> float:
        """The training seconds the schedules measured in the run's budget read."""
        return elapsed

    def elapsed(self, last: float, clock) -> float:
        """The run's training seconds before a step (``last``: the value after the last one)."""
        return clock()

    def counted_flops(self, flops: float) -> float:
        """The FLOPs of a step (``Read.flops``) that count into the run's now."""
        return flops

    def synchronize(self, model, tokens: int, clock) -> tuple[int, float | None, float]:
        """At a synchronization point: the target tokens since the last one (``tokens``: this rank's),
        the ranks' mean clock (None: unchanged) and FLOPs to count."""
        return tokens, None, 0.0

    def rank_optimizers(self, opt) -> list | None:
        """Every rank's own optimizer state for a checkpoint (None: the ranks share one)."""
        return None


class DataParallel(OneProcess):
    """DDP: the ranks' gradients all-reduced at every step, through a ``DistributedDataParallel``
    net; the loss divided by the target tokens of all ranks, counted on the device and all-reduced
    with the step's sums, clocks and FLOPs (no wait for the host). Every rank takes the stop, save
    and learning-rate decisions from the ranks' mean clock."""

    def prepare(self, model, static_graph):
        return rt.data_parallel(model, static_graph=static_graph)

    def no_sync(self, net, last):
        return net.no_sync() if not last else contextlib.nullcontext()

    def step_tokens(self, local_tokens):
        return rt.all_reduce_tensor(rt.host_to_device([float(local_tokens)], self.place.device), self.place.dist)

    def grad_scale(self, local_tokens, tokens_dev, passes):
        return (self.place.dist.world_size / (passes * tokens_dev)).float().reshape(())  # on the device

    def numbers(self, sums, norm, tokens_dev, clock_s, flops):
        sent = torch.cat([sums, rt.host_to_device([clock_s, flops], self.place.device)])
        return pack(sums, norm, tokens_dev, rt.all_reduce_tensor(sent, self.place.dist))  # (5,) all-reduced

    def read(self, numbers, local_tokens, clock_s, flops):
        loss, nll, kl, clock_sum, tokens, norm, flops_sum = numbers.tolist()
        return Read(loss, nll, kl, tokens, norm, flops_sum, clock_sum / self.place.dist.world_size)

    def elapsed(self, last, clock):
        return last


class LocalSGD(OneProcess):
    """Local SGD: each rank its own copy, Adam and loss (over its own tokens); the copies averaged
    every ``period`` steps, where the ranks' tokens, clocks and FLOPs since the last averaging are
    all-reduced too, so that the ranks agree on the budget. A non-finite step counts (skipped on
    its rank alone), so the ranks average together."""

    counts_skipped = True

    def __init__(self, place: rt.Place, period: int):
        super().__init__(place)
        self.period, self.pending_flops = period, 0.0

    def prepare(self, model, static_graph):
        rt.broadcast_parameters(list(model.parameters()), self.place.dist)
        return model

    def budget_seconds(self, elapsed, clock):
        return clock()

    def elapsed(self, last, clock):
        return last

    def counted_flops(self, flops):
        self.pending_flops += flops  # counted at the next averaging
        return 0.0

    def synchronize(self, model, tokens, clock):
        """The copies averaged (every rank's becomes their mean)."""
        dist, seconds = self.place.dist, clock()
        rt.average_parameters(list(model.parameters()), dist)
        tokens_sum, seconds_sum, flops_sum = rt.all_reduce_sum([float(tokens), seconds, self.pending_flops], dist,
                                                               self.place.device)
        self.pending_flops = 0.0
        return int(tokens_sum), seconds_sum / dist.world_size, flops_sum

    def rank_optimizers(self, opt):
        return rt.gather_to_main(opt.state_dict(), self.place.dist)


def for_place(place: rt.Place, local_sgd_period: int) -> OneProcess:
    """One process; local SGD where ``local_sgd_period`` > 0 and there are several; else DDP."""
    if not place.dist.enabled:
        return OneProcess(place)
    return LocalSGD(place, local_sgd_period) if local_sgd_period > 0 else DataParallel(place)
