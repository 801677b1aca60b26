"""How the processes of a run train together, three strategies of one interface (§5.2 trained on 8
GPUs): ``OneProcess``; ``DataParallel`` (DDP), where every step is a synchronization point whose
gradients are averaged; and ``LocalSGD`` (``train.local_sgd_period``), where every process trains its
own copy of the model, from the main rank's weights, with its own Adam, and the copies are averaged
every ``period`` steps. ``for_run`` picks one; the training step (``aiayn.train.step``) and loop
(``aiayn.train.loop``) call the same methods whichever it is.

A step's numbers travel as one (7,) float64 vector on the device (``numbers``): the loss, NLL and KL
sums, the ranks' clocks summed (0 where not all-reduced), the ranks' target tokens (0 where not
all-reduced), the gradient norm (0 where none was taken) and the ranks' counted FLOPs summed (0 where
not all-reduced); ``read`` is the step's one wait for the device.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

from aiayn.checkpoint.contents import Contents
from aiayn.checkpoint.run import own_optimizer
from aiayn.train import runtime as rt
from aiayn.train.config import TrainConfig

log = logging.getLogger(__name__)


def average_parameters(params: list[torch.Tensor], dist: rt.Dist) -> None:
    """Set every rank's parameters to their mean over the ranks, in one all-reduce of a flat
    float32 copy: local SGD's averaging step (``train.local_sgd_period``)."""
    if not dist.enabled:
        return
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    tdist.all_reduce(flat)
    flat /= dist.world_size
    offset = 0
    for p in params:
        p.detach().copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def data_parallel(model: torch.nn.Module, static_graph: bool) -> torch.nn.Module:
    """``model`` wrapped in DistributedDataParallel: the gradients are views of the all-reduce buckets
    (no copy between them), and the buffers are not re-sent at every forward (the model's only
    buffer, the sinusoid table, never changes). ``static_graph``: the same parameters and the same
    graph at every step, which lets DDP order its buckets once; not with accumulation (``no_sync``),
    with which PyTorch's static graph mis-reduces (pytorch/pytorch#143580)."""
    buffers = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")  # (the name from torch 2.13 on)
    return DistributedDataParallel(model, gradient_as_bucket_view=True, static_graph=static_graph, **{buffers: False})


def compile_model(net: torch.nn.Module, **options) -> torch.nn.Module:
    """``torch.compile`` with every dimension dynamic (``train.compile``): length-bucketed batches
    bring a new (B, S, T) nearly every step, and a graph compiled for one shape would be compiled
    again for the next; dynamic from the start, the model compiles one graph per padding case
    (``src_padded`` true or false: a source mask or none), tested over bucket shapes. Duck sizing
    is turned off for the process: with it, a first batch whose sources and targets have one
    length (common in bucketed batches) gives a graph for S == T only, compiled again at S != T.
    Float attributes are constants (``specialize_float``), as the embedding's sqrt(d_model): lifted
    to graph inputs, they failed DDP's graph split at its buckets, and a run under torchrun trained
    without compiling. ``options``: more of ``torch.compile``'s arguments (a test's ``backend``).
    The cache's place is chosen first: importing torch._dynamo sets inductor's default."""
    inductor_cache_per_capability()
    import torch._dynamo.config
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (loads the shape settings below)
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.specialize_float = True
    return torch.compile(net, dynamic=True, **options)


def inductor_cache_per_capability(env=os.environ) -> None:
    """Under ``ATEN_CPU_CAPABILITY`` (a CPU held to AVX2, say), torch.compile's cache of its own:
    inductor's on-disk cache does not key its compiled graphs on that setting, and a run held to it
    after a run without it (or the other way round) loads graphs made for the other vector width and
    computes on corrupted memory (non-finite outputs, or a crash in malloc). Left alone where
    ``TORCHINDUCTOR_CACHE_DIR`` is set."""
    capability = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability and not env.get("TORCHINDUCTOR_CACHE_DIR"):
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
            base = default_cache_dir()
        except ImportError:  # (another PyTorch: its default place, by its rule of 2.13)
            import getpass
            import tempfile
            base = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        env["TORCHINDUCTOR_CACHE_DIR"] = f"{base}_{capability}"


def broadcast_parameters(params: list[torch.Tensor], dist: rt.Dist) -> None:
    """Give every rank rank 0's parameters (what DDP does when it wraps a model)."""
    if dist.enabled:
        for p in params:
            tdist.broadcast(p.detach(), 0)


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

    name = "one_process"  # summary.json's ``parallel``
    period = 1  # steps between two synchronization points
    counts_skipped = False  # a non-finite step counts as a step (so the ranks average together)
    own_optimizers = False  # each rank an optimizer of its own, saved and resumed per rank

    def __init__(self, place: rt.Place):
        self.place = place

    def describe(self) -> str:
        """How the run's processes train, for the start's line."""
        return "1 process"

    def prepare(self, model: torch.nn.Module, static_graph: bool, compile: bool) -> tuple[torch.nn.Module, ...]:
        """The net the step runs, plain (``wrap``) and compiled with ``compile`` (``train.compile``;
        else the plain one again)."""
        plain = self.wrap(model, static_graph)
        return plain, compile_model(plain) if compile else plain

    def wrap(self, model: torch.nn.Module, static_graph: bool) -> torch.nn.Module:
        """``model`` for the ranks (``static_graph``: the same graph at every step, DDP's option)."""
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

    def start_clock(self, clock) -> float:
        """The run's training seconds at its start, the ranks' mean: every rank takes the same stop,
        save and learning-rate decisions from it (a rank that stopped alone would leave the others
        waiting in all_reduce)."""
        dist = self.place.dist
        return rt.all_reduce_sum([clock()], dist, self.place.device)[0] / dist.world_size

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

    def resume_optimizer(self, opt, saved: Contents) -> None:
        """After the checkpoint ``saved`` is restored: the optimizer state each rank resumes with."""
        own_optimizer(opt, saved, self.place.dist, self.own_optimizers)

    def step_log(self, log: logging.Logger) -> logging.Logger | logging.LoggerAdapter:
        """Where a step's lines (a skipped update) go: ``log``, the ranks' step being one, said once."""
        return log


class DataParallel(OneProcess):
    """DDP: the ranks' gradients all-reduced at every step, through a ``DistributedDataParallel``
    net; the loss divided by the target tokens of all ranks, counted on the device and all-reduced
    with the step's sums, clocks and FLOPs (no wait for the host). Every rank takes the stop, save
    and learning-rate decisions from the ranks' mean clock."""

    name = "ddp"

    def describe(self):
        return f"{self.place.dist.world_size} processes, their gradients all-reduced at every step (DDP)"

    def wrap(self, model, static_graph):
        return data_parallel(model, static_graph=static_graph)

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

    name = "local_sgd"
    counts_skipped = True
    own_optimizers = True

    def __init__(self, place: rt.Place, period: int):
        super().__init__(place)
        self.period, self.pending_flops = period, 0.0

    def describe(self):
        return (f"{self.place.dist.world_size} processes, each its own copy of the model and its own Adam, the copies "
                f"averaged every {self.period} steps (local SGD)")

    def wrap(self, model, static_graph):
        broadcast_parameters(list(model.parameters()), self.place.dist)
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
        average_parameters(list(model.parameters()), dist)
        tokens_sum, seconds_sum, flops_sum = rt.all_reduce_sum([float(tokens), seconds, self.pending_flops], dist,
                                                               self.place.device)
        self.pending_flops = 0.0
        return int(tokens_sum), seconds_sum / dist.world_size, flops_sum

    def rank_optimizers(self, opt):
        return rt.gather_to_main(opt.state_dict(), self.place.dist)

    def step_log(self, log):
        return rt.OwnState(log, self.place.dist)  # each rank's step is its own copy's: said by its rank


def for_run(t: TrainConfig, place: rt.Place) -> OneProcess:
    """How the run of train section ``t`` trains on ``place``: one process; with several, local SGD
    where ``t.local_sgd_period`` > 0, else DDP. A period in one process, which has no copies to average,
    is said."""
    if not place.dist.enabled:
        if t.local_sgd_period > 0:
            log.warning("train.local_sgd_period=%d has no effect in one process: local SGD averages the copies of "
                        "several (torchrun --nproc_per_node G)", t.local_sgd_period)
        return OneProcess(place)
    return LocalSGD(place, t.local_sgd_period) if t.local_sgd_period > 0 else DataParallel(place)
