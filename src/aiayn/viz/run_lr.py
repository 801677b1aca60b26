"""The learning rate of one trained run (``aiayn plot lr --run RUN``), §5.3 as the run took it.

Two curves on one figure:

- *logged*: the rate each logged step used, ``lr`` of ``RUN/train_log.jsonl`` (every
  ``train.log_every_steps``): the truth;
- *configured*: the rate ``RUN/config.json`` gives, computed by the training's own schedule
  (``aiayn.train.loop.schedule_of``, ``aiayn.train.objective.Schedule``: Eq. 3, its scale, the ramp of
  ``lr_decay_frac``, the budgets of time, FLOPs and epochs), not a copy of it. A schedule that follows
  the run's progress (``Schedule.follows_progress``) is taken at the progress each logged step records
  (``lr_at``: the elapsed seconds, counted FLOPs and epochs its rate was computed from), so it is drawn
  at the logged steps; one that follows the step alone is drawn at every step.

The same code on the same inputs gives the same float, so the two agree to the last bit unless the
configuration changed: ``config.json`` is the configuration of the run's last start, and a run resumed
with other settings (a longer ``max_steps`` under a ramp) used the earlier ones before it. Points where
they differ by more than ``AGREE_REL`` are marked and the first is named.

Shapes: N logged steps.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from aiayn.errors import InputError, UserError
from aiayn.train.objective import Schedule
from aiayn.viz.attention import agg_pyplot, save_figure
from aiayn.viz.curves import lr_steps

log = logging.getLogger(__name__)

# A few float64 operations (powers, a min, products) in another order differ by a few ulps: 16 x 2^-53
AGREE_REL = 16 * 2.0 ** -53
LR_AT_KEYS = frozenset(inspect.signature(Schedule.rate).parameters) - {"self", "step"}  # elapsed, flops, epochs


@dataclass
class LoggedRates:
    """What ``train_log.jsonl`` says of the rate: steps (N,) ascending, lr (N,), and lr_at (N,),
    ``Schedule.rate``'s keywords of each step (None where the line has none: a log of an older aiayn)."""
    steps: list[int]
    lr: list[float]
    lr_at: list[dict | None]


def read_logged_rates(path: Path) -> LoggedRates:
    """The train log's lines that hold an ``lr`` (validation's lines hold none), one per step (the last
    where a step appears twice). A last line cut short (a run killed while writing it, or still
    training) is left out with a warning; any other line that is not a train-log line is a UserError
    naming the file and line, as is a log without a rate."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: not found; a run writes it at its first logged step "
                        f"(train.log_every_steps)") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a train log (not UTF-8 text)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    lines = text.splitlines(keepends=True)
    by_step: dict[int, tuple[float, dict | None]] = {}
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            if i == len(lines) and not line.endswith("\n"):
                log.warning("%s:%d: the last line is cut short (a run killed while writing it, or still "
                            "training); plotted without it", path, i)
                continue
            raise InputError(path, i, "not a train-log line (a JSON object per line)")
        if "lr" in rec:
            by_step[_step(rec, path, i)] = (_number(rec["lr"], "lr", path, i), _lr_at(rec.get("lr_at"), path, i))
    if not by_step:
        raise UserError(f"{path}: no line holds an lr ({len(lines)} line(s)); nothing to plot")
    steps = sorted(by_step)
    return LoggedRates(steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps])


def _step(rec: dict, path: Path, i: int) -> int:
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise InputError(path, i, f"step must be a positive integer, got {json.dumps(step)}")
    return step


def _number(value, name: str, path: Path, i: int) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InputError(path, i, f"{name} must be a finite number, got {json.dumps(value)}")
    return float(value)


def _lr_at(value, path: Path, i: int) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= LR_AT_KEYS:
        raise InputError(path, i, f"lr_at must be an object of {', '.join(sorted(LR_AT_KEYS))}, got "
                                  f"{json.dumps(value)}")
    return {k: _number(v, f"lr_at.{k}", path, i) for k, v in value.items()}


def run_schedule(run_dir: Path) -> Schedule:
    """The schedule of ``RUN/config.json`` (a recipe: ``load_recipe``), made as the training makes it."""
    from aiayn.config import ConfigError
    from aiayn.train.config import load_recipe
    from aiayn.train.loop import schedule_of
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: {'not a file' if os.path.lexists(path) else 'not found'}; --run takes a run "
                        f"directory that aiayn train wrote (config.json, train_log.jsonl)")
    try:
        cfg = load_recipe(path)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    return schedule_of(cfg)


@dataclass
class Comparison:
    """The configured curve (x, y), its rate at each logged step (N,; NaN where it cannot be known) and
    the relative difference of the logged rate from it (N,; NaN where unknown, 0 where both are 0)."""
    x: np.ndarray
    y: np.ndarray
    at_logged: np.ndarray
    rel: np.ndarray

    @property
    def known(self) -> np.ndarray:
        return ~np.isnan(self.at_logged)

    @property
    def differs(self) -> np.ndarray:
        """(N,) the logged steps whose rate is not the configured one (``AGREE_REL``)."""
        return np.nan_to_num(self.rel, nan=0.0) > AGREE_REL


def compare(schedule: Schedule, logged: LoggedRates) -> Comparison:
    """The configured rates beside the logged ones. A schedule that follows the step alone is drawn at
    every step up to the last logged one (``lr_steps``); one that follows the run's progress at the
    logged steps that record it."""
    at_logged = np.array([schedule.rate(s, **at) if at is not None else
                          (math.nan if schedule.follows_progress else schedule.rate(s))
                          for s, at in zip(logged.steps, logged.lr_at)])  # (N,)
    if schedule.follows_progress:
        known = ~np.isnan(at_logged)
        x, y = np.array(logged.steps)[known], at_logged[known]
    else:
        x = lr_steps(logged.steps[-1], [schedule.warmup_steps, *logged.steps])
        y = np.array([schedule.rate(int(s)) for s in x])
    lr = np.array(logged.lr)
    scale = np.maximum(np.abs(lr), np.abs(at_logged))  # (N,)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(lr - at_logged) / scale, 0.0)
    return Comparison(x, y, at_logged, np.where(np.isnan(at_logged), np.nan, rel))


def describe(s: Schedule) -> str:
    """One line of what the schedule is: Eq. 3's constants and the deviations in force."""
    text = f"Eq. 3, d_model {s.d_model}, warmup {s.warmup_steps:,}" + (f", x {s.lr_scale:g}" if s.lr_scale != 1 else "")
    budget = " / ".join([f"{s.max_time_min:g} min"] * (s.by_budget and s.max_time_min > 0)
                        + [f"{s.max_flops:.3g} FLOPs"] * (s.by_budget and s.max_flops > 0))
    if s.whole_by_time and s.max_steps > 0 and budget:
        text += f"; taken at max(step, p x {s.max_steps:,}), p the share of the budget ({budget}) spent"
    if s.lr_decay_frac > 0:
        ends = [f"{s.max_steps:,} steps"] + [budget] * bool(budget) + [f"{s.max_epochs} epochs"] * (s.max_epochs > 0)
        text += (f"; times a ramp to 0 over the last {s.lr_decay_frac:.0%} of {' or '.join(ends)}"
                 + (", whichever is further along" if len(ends) > 1 else ""))
    return text


def verdict(logged: LoggedRates, c: Comparison) -> str:
    """One line: whether the logged rates are the configured ones."""
    known = int(c.known.sum())
    if known == 0:
        return ("the configured schedule follows the run's time, FLOPs or epochs, which this log does not "
                "record (a log of an older aiayn): only the logged rate is drawn")
    largest = float(np.nanmax(c.rel))
    if not c.differs.any():
        return f"they agree at all {known} logged steps (largest relative difference {largest:.2g})"
    first = logged.steps[int(np.argmax(c.differs))]
    return (f"they differ at {int(c.differs.sum())} of {known} logged steps, from step {first:,} (largest relative "
            f"difference {largest:.2g}); config.json holds the settings of the run's last start")


def run_name(run_dir: Path) -> str:
    """The run as the user named it (its folder's name where that was '.' or '..')."""
    text = os.path.normpath(str(run_dir))
    return Path(text).resolve().name if text in (".", "..") or text.endswith("/..") else text


def plot_run_lr(run_dir: str | Path, out: str | Path) -> Path:
    """Write the figure of the module docstring for the run directory ``run_dir`` to the PNG ``out``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        hint = (f"; its run directory is {run_dir.parent}" if run_dir.is_file()
                and (run_dir.parent / "config.json").is_file() else "")
        raise UserError(f"{run_dir}: {'not a folder' if os.path.lexists(run_dir) else 'not found'}; --run takes "
                        f"a run directory that aiayn train wrote{hint}")
    schedule = run_schedule(run_dir)
    logged = read_logged_rates(run_dir / "train_log.jsonl")
    c = compare(schedule, logged)
    said = verdict(logged, c)
    (log.warning if c.differs.any() else log.info)("%s: %s", run_dir, said)

    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    where = "at the progress each logged step records" if schedule.follows_progress else "at every step"
    if len(c.x):
        ax.plot(c.x, c.y, color="C0", lw=1.5, zorder=1,
                label=f"configured: config.json's schedule, the training's own code, {where}")
    ax.plot(logged.steps, logged.lr, ls="none", marker="o", ms=3.5, mfc="none", color="C1", zorder=2,
            label=f"logged: train_log.jsonl's lr, the rate the run used ({len(logged.steps):,} steps)")
    if c.differs.any():
        bad = np.flatnonzero(c.differs)
        ax.plot(np.array(logged.steps)[bad], np.array(logged.lr)[bad], ls="none", marker="x", ms=6, color="C3",
                zorder=3, label=f"logged, not the configured rate ({len(bad):,} steps)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    title = [*textwrap.wrap(f"learning rate of run {run_name(run_dir)}", 100), *textwrap.wrap(describe(schedule), 100)]
    ax.set_title("\n".join(title), fontsize=10)
    ax.legend(fontsize=8, title="\n".join(textwrap.wrap(said, 100)), title_fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.12))  # below the axes: never over a curve
    ax.grid(alpha=0.3)
    return save_figure(fig, out)
