"""Device, precision and process-group set-up: the only place that knows about CUDA, CPU
bf16 and torchrun. Rank-dependent side effects go through ``Dist.is_main``; which log lines a rank
writes, through ``MainRankLines`` and ``OwnState``.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as tdist

from aiayn.errors import UserError
from aiayn.host.isa import BF16_ISAS, onednn_uses

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Place:
    """Where this process trains: its place among the ranks (``dist``), its device and its precision
    ("fp32", "bf16" or "fp16"; ``resolve_precision``)."""
    dist: Dist
    device: torch.device
    precision: str


OWN_STATE = "own_rank"  # the attribute of a log record about its rank's own state (``OwnState``)


class MainRankLines(logging.Filter):
    """The lines a rank other than the main one writes (``aiayn.cli`` sets it on the handlers of such a
    rank of a torchrun, without ``-v``): its errors, and its lines about its own state (``OwnState``).
    Every other line, which each rank would write alike (the data's, the configuration's, the machine's),
    is the main rank's to write, once. With ``node_first`` (the first process of another machine, torchrun's
    LOCAL_RANK 0), its warnings too: that machine's CPU may lack what the main rank's has (the C kernels'
    fallback, a torch.compile that failed), and a node's output is its own."""

    def __init__(self, node_first: bool = False):
        super().__init__()
        self.lowest = logging.WARNING if node_first else logging.ERROR

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.lowest or hasattr(record, OWN_STATE)


class OwnState(logging.LoggerAdapter):
    """``logger`` for lines about this rank's own state (its copy of the model under local SGD): in a
    distributed run they name the rank, and every rank writes its own (``MainRankLines`` lets them by)."""

    def __init__(self, logger: logging.Logger, dist: Dist):
        super().__init__(logger, {OWN_STATE: dist.rank})
        self.dist = dist

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}
        return (f"rank {self.dist.rank} of {self.dist.world_size}: {msg}" if self.dist.enabled else msg), kwargs


def init_distributed(device_type: str, timeout_s: float = 120.0) -> Dist:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
    ``launch_env``); NCCL on CUDA, gloo on CPU. A collective, or the start-up, that waits ``timeout_s``
    for another rank is an error (``train.dist_timeout_s``; ``timed_out``), not PyTorch's default wait,
    which is far longer."""
    global JOINED
    dist = launch_env(os.environ)
    if dist.enabled and not tdist.is_initialized():
        tdist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                 timeout=datetime.timedelta(seconds=timeout_s))
        JOINED = True
    return dist


# Whether this process has joined a process group (``init_distributed``). A group that a
# DistributedDataParallel has used outlives ``destroy_process_group`` (PyTorch's reducer keeps it, and
# with it gloo's threads), and those threads can abort the interpreter's exit ("terminate called
# without an active exception", SIGABRT) of a rank whose work is done: the command line ends such a
# process at once, its output flushed (``aiayn.cli.main``).
JOINED = False


LAUNCHED_BY = "start the processes with torchrun (torchrun --nproc_per_node G -m aiayn.cli train ...), which sets them"


def launch_env(env) -> Dist:
    """The place torchrun's variables in ``env`` give this process (none: one process). A set that
    torchrun would not give is a UserError naming the variable, where PyTorch would raise a KeyError
    or wait for ranks that cannot come; a rank other than 0 alone (RANK without WORLD_SIZE) would
    train as a run of its own."""
    def number(name: str) -> int:
        try:
            return int(env[name])
        except ValueError:
            raise UserError(f"{name}={env[name]!r}: not a whole number; {LAUNCHED_BY}") from None

    if "WORLD_SIZE" not in env:
        if "RANK" in env and number("RANK") != 0:
            raise UserError(f"RANK={env['RANK']} is set without WORLD_SIZE: a process of a distributed run "
                            f"needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; {LAUNCHED_BY}")
        return Dist()
    world = number("WORLD_SIZE")
    if world < 1:
        raise UserError(f"WORLD_SIZE={world} is below 1; {LAUNCHED_BY}")
    if "RANK" not in env:
        if world == 1:
            return Dist()
        raise UserError(f"WORLD_SIZE={world} is set without RANK; {LAUNCHED_BY}")
    rank, local = number("RANK"), number("LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is not below WORLD_SIZE={world} (ranks count from 0); {LAUNCHED_BY}")
    if local < 0:
        raise UserError(f"LOCAL_RANK={local} is negative; {LAUNCHED_BY}")
    if world == 1:
        return Dist()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise UserError(f"{name} is not set: the ranks of WORLD_SIZE={world} meet at MASTER_ADDR:MASTER_PORT; "
                            f"{LAUNCHED_BY}")
    return Dist(rank, world, local)


def leave_process_group() -> None:
    """Destroy the process group ``init_distributed`` joined, at a run's normal end: its collectives are
    over. (Where a DistributedDataParallel used it, gloo's threads live on; see ``JOINED``.)"""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def start(*, device: str, precision: str, timeout_s: float, tf32: bool, threads: int, seed: int) -> Place:
    """The process's place in the run (distributed or not), its device and its precision, from
    ``train.device``, ``train.precision``, ``train.dist_timeout_s`` and ``train.tf32``; ``threads``
    applied (0: torch's default) and every generator seeded with ``seed``. The main process logs the
    precision and why it was chosen (``resolve_precision``)."""
    device_type = "cuda" if (device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())) else "cpu"
    dist = init_distributed(device_type, timeout_s)
    where = resolve_device(device, dist)
    chosen, why = resolve_precision(precision, where)
    if dist.is_main:
        log.info(describe_precision(chosen, why))
    use_tf32(where, tf32)
    if threads > 0:
        torch.set_num_threads(threads)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")  # (torchrun's: the processes of this machine)
    crowded = crowded_cores(int(local) if local.isdigit() else 1, torch.get_num_threads(), cpu_cores())
    if crowded and where.type == "cpu" and dist.local_rank == 0:  # (said once a machine)
        log.warning("%s", crowded)
    seed_everything(seed)
    return Place(dist, where, chosen)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def crowded_cores(processes: int, threads: int, cores: int) -> str | None:
    """The warning for ``processes`` training processes of one machine (torchrun's LOCAL_WORLD_SIZE) of
    ``threads`` threads each on its ``cores`` cores, where they are more than the cores (None: they fit).
    Each step of the ranks waits for the slowest, and a thread that waits for a core holds up all."""
    if processes < 2 or processes * threads <= cores:
        return None
    return (f"{processes} processes of {threads} thread(s) each on this machine's {cores} CPU cores: they take "
            f"turns on the cores, and every step waits for the slowest; run at most {cores} threads in all, with "
            f"fewer processes (torchrun --nproc_per_node) or fewer threads each (train.threads)")


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that waited out the process group's timeout (gloo's error;
    NCCL's watchdog ends the process itself), or the start-up's wait for the other ranks (``init_distributed``:
    the main rank's store waiting for them, another's connection to it: PyTorch's store errors)."""
    if not tdist.is_available():
        return False
    if tdist.is_initialized() and isinstance(exc, RuntimeError) and "Timed out" in str(exc):
        return True
    text = str(exc).lower()  # ("wait timeout after 5000ms" under torchrun; "Timed out after 6 seconds" without)
    return isinstance(exc, (tdist.DistStoreError, tdist.DistNetworkError)) and ("timed out" in text or "timeout" in text)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective whose connection to another rank broke (gloo's "Connection closed
    by peer" or "reset by peer"): that rank ended (killed, out of memory, its own error) before or during
    the collective; NCCL's watchdog ends the process itself."""
    text = str(exc)
    return (tdist.is_available() and tdist.is_initialized() and isinstance(exc, RuntimeError)
            and "gloo" in text and ("by peer" in text or "Broken pipe" in text))


def resolve_device(spec: str, dist: Dist) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("device cuda requested but CUDA is not available")
        gpus = torch.cuda.device_count()
        if ":" not in spec and dist.local_rank >= gpus:  # (CUDA's own error: "invalid device ordinal")
            raise UserError(f"LOCAL_RANK={dist.local_rank}: this machine has {gpus} GPUs: start at most {gpus} "
                            f"processes on it (torchrun --nproc_per_node {gpus})")
        device = torch.device(spec if ":" in spec else f"cuda:{dist.local_rank}")
        torch.cuda.set_device(device)
        return device
    return torch.device(spec)


def use_tf32(device: torch.device, enabled: bool) -> None:
    """float32 matmuls and convolutions on CUDA in TF32 (inputs rounded to 10 mantissa bits, sums in
    float32; ``train.tf32``): CUDA's settings only, so nothing changes on the CPU. (Not
    ``torch.set_float32_matmul_precision``, which also lets oneDNN's CPU matmuls round.)"""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def cpu_supports_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively: on x86, the AVX512-BF16 or AMX instructions,
    present and not held back by ``ONEDNN_MAX_CPU_ISA`` (``host.isa.onednn_uses``); on Arm, oneDNN's
    answer (the BF16 extension). Not ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` alone: it
    answers True on every AVX-512 CPU, Skylake and Cascade Lake included, where oneDNN emulates bf16
    by conversions, slower than float32 (CHANGELOG.md, 2026-11-28)."""
    onednn = _onednn_has_bf16()
    if not onednn or not _is_x86():
        return onednn
    return onednn_uses(BF16_ISAS)


def _onednn_has_bf16() -> bool:
    """oneDNN's answer: bf16 matmuls natively or by emulation."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere on: bf16 tensor cores. Before it CUDA emulates bf16.


def fast_fp16(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability computes float16 at twice float32's rate or more:
    Volta on (7.0: tensor cores), and before it the GPUs that the CUDA C Programming Guide's table of
    arithmetic throughput gives twice float32's: 5.3 (Jetson TX1, Nano), 6.0 (P100), 6.2 (Jetson
    TX2). Elsewhere float16 is slower than float32 (6.1: GTX 10xx, P4, P40, at 1/64 of its rate)."""
    return capability >= (7, 0) or capability in ((5, 3), (6, 0), (6, 2))


def resolve_precision(spec: str, device: torch.device) -> tuple[str, str]:
    """``train.precision`` = ``spec`` on ``device``: the precision ("fp32", "bf16", "fp16") and why,
    in words for the log. auto on CUDA: bf16 where the GPU computes it natively (compute capability
    >= 8.0), else fp16, which trains with a gradient scaler, where the GPU's fp16 is fast (``fast_fp16``),
    else fp32; not ``torch.cuda.is_bf16_supported()``, which answers True on a T4 (7.5) or a V100 (7.0)
    by emulating bf16. auto on the CPU: bf16 where it is native (``cpu_supports_bf16``: AVX512-BF16,
    AMX, Arm's BF16), else fp32."""
    if spec == "auto":
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = f"auto: {torch.cuda.get_device_name(device)}, compute capability {major}.{minor}, "
            if (major, minor) >= NATIVE_BF16_CAPABILITY:
                return "bf16", where + "native bf16"
            if fast_fp16((major, minor)):
                return "fp16", where + "has no native bf16"
            return "fp32", where + "has neither native bf16 nor fast fp16"
        if device.type == "cpu" and cpu_supports_bf16():
            return "bf16", "auto: the CPU has native bf16 matmuls (AVX512-BF16, AMX or Arm's BF16)"
        return "fp32", f"auto: {device.type} without native bf16"
    if spec == "fp16" and device.type != "cuda":
        raise UserError("precision fp16 needs CUDA (it uses a gradient scaler); use bf16 or fp32 on CPU")
    return spec, f"train.precision={spec}"


def describe_precision(precision: str, why: str) -> str:
    """The log's line for ``resolve_precision``'s answer."""
    scaled = " with loss scaling" if precision == "fp16" else ""
    return f"precision: {precision}{scaled} ({why})"


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a precision ("fp32", "bf16", "fp16") computes its products in."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision_dtype(precision))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's generator states as tensors and plain values, which a checkpoint loads
    without running code (``weights_only``): torch's CPU generator, numpy's and Python's
    ``random`` (their Mersenne Twister words as int64 tensors), and the current CUDA device's
    generator where CUDA is in use. ``set_rng_state`` puts them back."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, py_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64),
                        "gauss": py_gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: each rank uses one
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s generators (CUDA's only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def all_reduce_sum(values: list[float], dist: Dist, device: torch.device) -> list[float]:
    if not dist.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    tdist.all_reduce(t)
    return t.tolist()


def host_to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` as a float64 tensor on ``device``, without waiting for it: on CUDA copied from
    page-locked memory with ``non_blocking`` (a copy from pageable memory first waits for all the
    device's queued work); elsewhere made there."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.float64, device=device)
    return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)


def all_reduce_tensor(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    """``t`` summed over the ranks (in place), without reading it on the host: on CUDA the
    all-reduce is queued behind the device's work and nothing waits for it here."""
    if dist.enabled:
        tdist.all_reduce(t)
    return t


def gather_to_main(obj, dist: Dist) -> list | None:
    """Every rank's ``obj`` (picklable) on the main rank, in rank order; None on the others.
    A collective: every rank calls it."""
    if not dist.enabled:
        return [obj]
    out = [None] * dist.world_size if dist.is_main else None
    tdist.gather_object(obj, out, dst=0)
    return out


def check_alike(found: dict[str, str], dist: Dist) -> None:
    """Refuse a start whose ranks found different things in what they all read: ``found`` maps each
    input, by a name that every rank gives alike (``--out``, ``--data``), to what this rank found there
    (the checkpoint it resumes, the tokenizers). On several machines RUN must be one folder they share
    and DATA alike on each, or the ranks would train from different states until a collective waits
    out its timeout. A collective: every rank calls it, and every rank raises the same UserError."""
    global AGREED
    if not dist.enabled:
        return
    every: list = [None] * dist.world_size
    tdist.all_gather_object(every, found)
    for rank, theirs in enumerate(every):
        for what, there in theirs.items():
            if there != every[0][what]:
                raise UserError(f"{what}: rank {rank} finds {there}, rank 0 {every[0][what]}: every process must "
                                f"read the same --out and --data (on several machines, --out on a file system "
                                f"they share: docs/training.md)")
    AGREED = True


# Whether the ranks have agreed to start (``check_alike``): a rank that loses another before that saw
# a start refused (a locked --out, another run's files), not a run cut short that a resume goes on with.
AGREED = False


def resident_mb() -> float | None:
    """This process's resident memory in MiB now (Linux /proc/self/statm), or None elsewhere.
    Logged with every training record, so growth over a long run shows in the train log."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def matmul_tflops(device: torch.device, n: int = 1024, seconds: float = 0.5,
                  dtype: torch.dtype = torch.float32) -> float:
    """A quick measure of sustained matmul throughput in ``dtype`` (fp32 for the Table 2 cost estimate)."""
    import time
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12
