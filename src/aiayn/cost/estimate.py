"""``aiayn estimate``: what a recipe costs in time and device-hours, before renting the devices.

Per step (§5.1): ``tokens`` target tokens and as many source tokens, in sentences of ``length``
subword tokens (EOS included) on both sides, so ``tokens / length`` sentences; the training
FLOPs are ``aiayn.train.flops.train_flops`` of one such sentence times that count (3x the
forward matmul FLOPs, padding ignored: batches of similar lengths pad little, §5.1).

Throughput per device, in model FLOP/s, is taken from the first of:

1. a measurement: ``--device NAME`` where ``bench/results/NAME/train_base.json`` exists (the
   base model trained by ``bench/train_throughput.py`` on that machine; its aiayn-bf16 figure,
   else aiayn-fp32), or ``--measured FILE`` for such a file elsewhere;
2. ``aiayn.cost.devices``: aiayn's own figure for the base or big model on that device where
   one was measured (H200; the H100 takes it as its own, an assumption);
3. the device's dense peak x a utilization from published runs of these models by other code
   (``--utilization`` replaces it and 2; an assumption, printed as one).

Time = steps x step FLOPs / (devices x throughput). Table 2's own estimate of the training cost
is training time x number of devices x the device's sustained TFLOPS figure (the paper's 9.5 for
P100), printed beside the paper's 3.3e18 (base) and 2.3e19 (big), which is that product for its
training times on 8 P100 (§5.2; ``PAPER_TABLE2``).

The command also prints one device's peak memory for a batch of the recipe (or of the
per-device share of ``--tokens-per-step``): ``aiayn.cost.memory``, from the model's shapes.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import UserError
from aiayn.model.config import ModelConfig, get_preset
from aiayn.train.flops import forward_flops, train_flops
from aiayn.cost.devices import DEVICES

PAPER_TOKENS_PER_STEP = 25_000  # §5.1: about 25,000 source and 25,000 target tokens per batch
PAPER_TABLE2 = {"base": (3.3e18, "12 h x 8 P100 x 9.5 TFLOP/s"), "big": (2.3e19, "3.5 days x 8 P100 x 9.5 TFLOP/s")}
DEFAULT_LENGTH = 31  # assumed: 30 subword tokens + EOS; `--data DIR` takes the mean of a prepared train split
BENCH_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def paper_batch(devices: int, max_per_device: int, tokens: int = PAPER_TOKENS_PER_STEP) -> tuple[int, int]:
    """(tokens per device per batch, batches accumulated per step) that make ``tokens`` per step
    on ``devices`` devices with at most ``max_per_device`` tokens in one batch (§5.1's 25,000
    on 8 P100 is 3125 x 8 x 1; on 1 device 3125 x 1 x 8; on 3, 2777 x 3 x 3)."""
    if devices < 1 or max_per_device < 1 or tokens < 1:
        raise UserError(f"devices, tokens per device and tokens per step must be >= 1, got {devices}, "
                        f"{max_per_device}, {tokens}")
    if tokens < devices:  # tokens // devices would be an empty batch on every device
        raise UserError(f"{tokens:,} tokens per step cannot be shared by {devices} devices (under one token each)")
    accum = math.ceil(tokens / (devices * max_per_device))
    return tokens // (devices * accum), accum


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's target (and source) tokens (§5.1): ``per_device_tokens`` in a batch on each
    of ``devices`` devices, ``accum_steps`` batches accumulated."""

    per_device_tokens: int
    devices: int
    accum_steps: int

    @property
    def tokens(self) -> int:
        return self.per_device_tokens * self.devices * self.accum_steps


def step_batch(devices: int, per_device_tokens: int, accum_steps: int, tokens_per_step: int | None = None,
               max_device_tokens: int | None = None) -> StepBatch:
    """A recipe's step on ``devices`` devices: its ``per_device_tokens`` x devices x ``accum_steps``
    (``train.max_tgt_tokens``, ``train.accum_steps``), or ``tokens_per_step`` reached with
    ``paper_batch`` (at most ``max_device_tokens``, default the recipe's per-device tokens, in one batch)."""
    if tokens_per_step:
        per_device_tokens, accum_steps = paper_batch(devices, max_device_tokens or per_device_tokens, tokens_per_step)
    return StepBatch(per_device_tokens, devices, accum_steps)


def step_flops(m: ModelConfig, tokens: float, length: int) -> float:
    """Training FLOPs of one step of ``tokens`` target (and source) tokens in ``length``-token sentences."""
    return train_flops(m, 1, length, length) * tokens / length


@dataclass(frozen=True)
class Throughput:
    """Sustained model FLOP/s of one device, Table 2's TFLOPS figure for it, and where both come from."""

    tflops: float
    table2_tflops: float
    device: str
    source: str
    measured: bool


def measured_throughput(path: Path) -> Throughput:
    """The base model's training rate measured by bench/train_throughput.py (``train_base.json``)."""
    try:
        data = json.loads(Path(path).read_text())
        systems, machine = data["systems"], data["machine"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path}: not a bench/train_throughput.py result ({exc})") from exc
    for name in ("aiayn-bf16", "aiayn-fp32"):
        s = systems.get(name, {})
        if s.get("model_gflops_per_s"):
            device = f"{machine.get('cpu_model', '?')} ({machine.get('threads', '?')} threads)"
            return Throughput(s["model_gflops_per_s"] / 1e3, s["peak_gflops"] / 1e3, device,
                              f"measured: {path} {name}, {machine.get('date', '?')[:10]} (matmul peak "
                              f"{s['peak_gflops'] / 1e3:.3f} TFLOP/s as Table 2's figure)", True)
    raise UserError(f"{path}: no aiayn-bf16 or aiayn-fp32 figure")


def device_throughput(name: str, utilization: float | None = None, results: Path = BENCH_RESULTS,
                      model: str | None = None) -> Throughput:
    """A measured figure for ``name`` (a bench/results folder) if there is one; else aiayn's own
    figure for ``model`` ("base", "big") on that device (``aiayn.cost.devices``); else peak x
    utilization (the device's default when None)."""
    measured = results / name / "train_base.json"
    if measured.is_file():
        return measured_throughput(measured)
    if name not in DEVICES:
        folders = sorted(p.parent.name for p in results.glob("*/train_base.json"))
        raise UserError(f"unknown device {name!r}; known: {', '.join(DEVICES)}; measured: {', '.join(folders)}")
    d = DEVICES[name]
    own = dict(d.aiayn_tflops)
    if utilization is None and model in own:
        return Throughput(own[model], d.table2_tflops, d.name,
                          f"{d.aiayn_source}: aiayn's {model} model at {own[model]:g} TFLOP/s, "
                          f"{own[model] / d.peak_tflops:.1%} of the {d.peak_tflops:g} {d.precision} peak", d.aiayn_measured)
    utilization = d.utilization if utilization is None else utilization
    if not 0 < utilization <= 1:
        raise UserError(f"utilization must be in (0, 1], got {utilization}")
    return Throughput(d.peak_tflops * utilization, d.table2_tflops, d.name,
                      f"assumed: {utilization:.0%} of {d.peak_tflops:g} TFLOP/s {d.precision} peak ({d.source}); "
                      f"no aiayn run measured on it", False)


def data_length(data_dir: Path) -> int:
    """Mean tokens per sentence of a prepared train split, the longer side, EOS included."""
    from aiayn.data.dataset import DataDir
    train = DataDir(data_dir).manifest["splits"].get("train")
    if train is None:
        raise UserError(f"{data_dir}: no train split")
    return round(max(train["src"]["length"]["mean"], train["tgt"]["length"]["mean"])) + 1


def paper_model(m: ModelConfig) -> str | None:
    """'base' or 'big' when ``m`` has that Table 3 row's shape (vocabulary and dropout aside)."""
    shape = lambda c: (c.n_layers, c.decoder_layers, c.d_model, c.d_ff, c.n_heads, c.d_k, c.d_v)  # noqa: E731
    return next((n for n in ("base", "big") if shape(m) == shape(get_preset(n))), None)


@dataclass(frozen=True)
class Estimate:
    """The numbers ``aiayn estimate`` prints; times in seconds, FLOPs as counts."""

    steps: int
    devices: int
    per_device_tokens: int
    accum_steps: int
    length: int
    flops_per_token: float       # training FLOPs per target token (with its share of the source)
    flops_per_step: float
    seconds_per_step: float
    seconds: float
    device_hours: float
    model_flops: float           # steps x flops_per_step
    table2_flops: float          # seconds x devices x Table 2's TFLOPS figure
    throughput: Throughput

    @property
    def tokens_per_step(self) -> int:
        return self.per_device_tokens * self.devices * self.accum_steps


def estimate(m: ModelConfig, steps: int, batch: StepBatch, thr: Throughput, length: int = DEFAULT_LENGTH) -> Estimate:
    """Time and cost of ``steps`` optimizer steps (a recipe's ``train.max_steps``) of the model ``m``,
    each of ``batch`` (``step_batch``), on devices of throughput ``thr``, in sentences of ``length``
    tokens."""
    if length < 1:
        raise UserError(f"length must be >= 1, got {length}")
    devices, tokens = batch.devices, batch.tokens
    per_step = step_flops(m, tokens, length)
    seconds_per_step = per_step / (devices * thr.tflops * 1e12)
    seconds = seconds_per_step * steps
    return Estimate(steps=steps, devices=devices, per_device_tokens=batch.per_device_tokens,
                    accum_steps=batch.accum_steps, length=length, flops_per_token=per_step / tokens,
                    flops_per_step=per_step, seconds_per_step=seconds_per_step, seconds=seconds,
                    device_hours=seconds * devices / 3600, model_flops=per_step * steps,
                    table2_flops=seconds * devices * thr.table2_tflops * 1e12, throughput=thr)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds < 72 * 3600 else f"{seconds / 86400:.1f} days"


def _amount(x: float) -> str:
    """Hours or dollars as a table would give them: one decimal below 10 (1.7, $3.5), whole above ($1,813)."""
    return f"{x:,.1f}" if x < 10 else f"{x:,.0f}"


def format_estimate(e: Estimate, m: ModelConfig, price: float | None = None) -> str:
    thr = e.throughput
    fwd = forward_flops(m, 1, e.length, e.length) / e.length
    paper = paper_model(m)
    lines = [
        f"batch: {e.tokens_per_step:,} target (and source) tokens per step = {e.per_device_tokens} per device x "
        f"{e.devices} device(s) x {e.accum_steps} accumulated; sentences of {e.length} tokens (EOS included)",
        f"FLOPs per target token: forward {fwd:.4g}, training (3x) {e.flops_per_token:.4g}",
        f"FLOPs per step: {e.flops_per_step:.4g}; over {e.steps:,} steps {e.model_flops:.4g}",
        f"device: {thr.device}: {thr.tflops:.4g} model TFLOP/s sustained, {thr.source}",
        f"time: {e.seconds_per_step:.3g} s per step, {_duration(e.seconds)} to {e.steps:,} steps on {e.devices} "
        f"device(s) = {_amount(e.device_hours)} device-hours" + (f" = ${_amount(e.device_hours * price)} at "
                                                                 f"${price:g} per device-hour" if price else ""),
        f"Table 2's estimate (time x devices x {thr.table2_tflops:g} TFLOP/s): {e.table2_flops:.2g} FLOPs",
    ]
    for name, (flops, how) in PAPER_TABLE2.items():
        if paper in (None, name):
            lines.append(f"the paper's Table 2, {name} model: {flops:.2g} FLOPs ({how})")
    return "\n".join(lines)
