"""``aiayn demo`` sized to the machine it runs on.

The demo trains for a fixed wall time, so the number of updates it gets depends on the CPU (a Zen 3
with AVX2 counts about a sixth of a Zen 5's training FLOPs in the same minutes). One recipe cannot
suit both: a model sized for the fast machine is still warming up when the slow one stops. So before
training the demo predicts the budget, the training FLOPs this machine counts in the demo's minutes
(``aiayn.train.flops``: 3 x the forward's matmuls, as ``train.max_flops`` counts them):

    budget = minutes x 60 x processes x R x UTILIZATION

with R this machine's matmul rate on one process's threads, in the precision training will use
(``train.precision`` auto: bf16 where the CPU has it natively, else fp32; ``train.runtime``), measured
here for a second, and UTILIZATION the share of it training reaches; it takes the last of ``SIZES``
whose ``from_flops`` the budget reaches. The choice and why are printed and kept in
``OUT/sizing.json``, so a re-run resumes the same recipe; ``--recipe`` forces one.

Each size's recipe was calibrated by counted FLOPs, not minutes: trained to a budget with
``train.max_flops`` (its schedule, ``lr_schedule_by_time``, following the FLOPs as it follows the
clock), which gives the same run on any machine, so a fast machine calibrates what a slow one will
run. The scores by budget and the commands: BENCHMARKS.md, "The demo by budget".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from aiayn.demo.config import RECIPES
from aiayn.errors import UserError
from aiayn.files import write_json_atomic

UTILIZATION = 0.45  # counted training FLOPs / the matmul rate of training's precision, 2 processes (BENCHMARKS.md)


@dataclass(frozen=True)
class Size:
    """One of the demo's recipes and the smallest predicted budget it is taken for."""

    recipe: str  # a file of aiayn/recipes
    from_flops: float  # counted training FLOPs


SIZES = (Size("multi30k-small.json", 0.0), Size("multi30k.json", 6e14))
QUICK_SIZES = (Size("multi30k-quick.json", 0.0),)


def choose_size(sizes: tuple[Size, ...], budget: float) -> Size:
    """The last of ``sizes`` (in increasing ``from_flops``) whose ``from_flops`` ``budget`` reaches."""
    chosen = sizes[0]
    for size in sizes:
        if budget >= size.from_flops:
            chosen = size
    return chosen


def predicted_budget(minutes: float, processes: int, threads: int, measure=None,
                     precision: str = "fp32") -> tuple[float, float]:
    """(the counted training FLOPs predicted for ``minutes`` of training with ``processes`` processes
    of ``threads`` threads each, the matmul TFLOP/s of one process in ``precision`` it came from)."""
    import torch

    from aiayn.train.runtime import matmul_tflops, precision_dtype

    dtype = precision_dtype(precision)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        tflops = (measure or (lambda: matmul_tflops(torch.device("cpu"), n=512, seconds=1.0, dtype=dtype)))()
    finally:
        torch.set_num_threads(before)
    return minutes * 60 * processes * tflops * 1e12 * UTILIZATION, tflops


def sized_recipe(quick: bool, minutes: float, processes: int, threads: int, out: Path, measure=None,
                 precision: str = "fp32") -> tuple[Path, dict]:
    """The recipe of ``RECIPES`` for this machine (module docstring) and the record of the choice; a
    choice already made in ``out`` (``sizing.json``) is kept, so a re-run resumes the run it started."""
    record_path = out / "sizing.json"
    sizes = QUICK_SIZES if quick else SIZES
    if record_path.exists():
        try:
            record = json.loads(record_path.read_text())
            recipe = record["recipe"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{record_path}: not the demo's sizing record ({e}); remove it or use --overwrite") from e
        if recipe not in [s.recipe for s in sizes]:  # the other variant's run: not resumed as this one
            began = "--quick" if recipe in [s.recipe for s in QUICK_SIZES] else "without --quick"
            raise UserError(f"{record_path}: the run here began {began} ({recipe}), but this run is "
                            f"{'--quick' if quick else 'without --quick'}; use another --out, or --overwrite "
                            f"to start afresh")
        return RECIPES / recipe, record
    budget, tflops = predicted_budget(minutes, processes, threads, measure, precision)
    size = choose_size(sizes, budget)
    record = {"recipe": size.recipe, "predicted_flops": budget, "precision": precision,
              "matmul_tflops_per_process": round(tflops, 4),
              "processes": processes, "threads_per_process": threads, "minutes": minutes,
              "utilization": UTILIZATION,
              "sizes": [{"recipe": s.recipe, "from_flops": s.from_flops} for s in sizes]}
    write_json_atomic(record_path, record)
    return RECIPES / size.recipe, record


def describe(record: dict) -> str:
    """One line: the recipe chosen and why."""
    sizes = ", ".join(f"{s['recipe']} from {s['from_flops']:.2g}" for s in record["sizes"])
    choice = (f"recipes by budget: {sizes}; --recipe forces one" if len(record["sizes"]) > 1
              else "the one recipe on any machine; --recipe forces another")
    return (f"{record['recipe']}: this machine's {record.get('precision', 'fp32')} matmuls run at {record['matmul_tflops_per_process'] * 1e3:.0f} "
            f"GFLOP/s a process, so {record['minutes']:g} minutes x {record['processes']} processes x "
            f"{record['utilization']:.0%} of it is a budget of about {record['predicted_flops']:.2g} counted FLOPs "
            f"({choice})")
