"""The host's share of a training step, on the CPU: a model of a recipe's structure (its layers,
heads and step) at tiny widths, so that the arithmetic is negligible and what remains is what the
host does to issue the step (Python, the dispatcher, autograd, autocast's casts), the part of a
GPU step that leaves the device idle when the model is small (BENCHMARKS.md §7: the GPU demo's step,
4 ms of GPU work in 18-25 ms). fp32 against bf16 autocast, plain and with the linear maps' weights
cast once a forward (``train.cast_weights_once``), the loop's own step (``bench/gpu_train.py``'s
``build_aiayn``), one thread, interleaved rounds; the operations a step issues counted by
torch.profiler, casts (``aten::_to_copy``) apart, and where the host's time goes (the operations
with the most self time).

    python bench/host_step.py [--recipe recipes/multi30k-gpu.json] [--rounds 5] [--steps 30]

Results: ``$BENCH_RESULTS/host_step.json`` (default bench/results/).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402
import gpu_train as gt  # noqa: E402

WIDTHS = {"d_model": 16, "d_ff": 32, "d_k": 4, "d_v": 4}  # the structure kept, the arithmetic gone


def operations(step) -> dict:
    """The aten operations one step issues, casts apart, and the casts' callers."""
    with torch.profiler.profile() as prof:
        step(0)
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    casts = [e for e in ops if e.name == "aten::_to_copy"]
    callers = collections.Counter(e.cpu_parent.cpu_parent.name if e.cpu_parent is not None and e.cpu_parent.cpu_parent
                                  is not None else "(top)" for e in casts)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
    return {"aten_ops": len(ops), "casts": len(casts), "cast_callers": dict(callers.most_common(8)),
            "most_self_time_us": {e.key: round(e.self_cpu_time_total) for e in top}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/multi30k-gpu.json")
    ap.add_argument("--batch", type=int, default=16, help="sentences a batch (of --len tokens each side)")
    ap.add_argument("--len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dataclasses.replace(gt.model_config(args.recipe, 64), **WIDTHS)
    device = torch.device("cpu")
    batches = gt.synthetic_batches(cfg, args.batch, args.len, args.len, device)
    steps = {"fp32": gt.build_aiayn(cfg, batches, device, "fp32"), "bf16": gt.build_aiayn(cfg, batches, device, "bf16"),
             "bf16-castonce": gt.build_aiayn(cfg, batches, device, "bf16", cast_once=True)}
    for step in steps.values():
        for _ in range(5):
            step(0)
    rounds = gt.timed_rounds(steps, args.rounds, device, lambda r: [(0,)] * args.steps)
    times = {p: [s / args.steps * 1e3 for s in rounds[p]] for p in steps}  # ms a step, each round
    result = {"recipe": args.recipe, "widths": WIDTHS, "batch": [args.batch, args.len, args.len], "threads": 1,
              "machine": bl.machine_info(1), "systems": {}}
    for p in steps:
        ms = statistics.median(times[p])
        result["systems"][p] = {"step_ms": round(ms, 2), "rounds_ms": [round(x, 2) for x in times[p]],
                                **operations(steps[p])}
        s = result["systems"][p]
        print(f"{p}: {ms:.2f} ms a step, {s['aten_ops']} aten operations, {s['casts']} casts {s['cast_callers']}; "
              f"most self time (us): {s['most_self_time_us']}")
    ms = {p: r["step_ms"] for p, r in result["systems"].items()}
    result["bf16_over_fp32"] = round(ms["bf16"] / ms["fp32"], 2)
    result["castonce_over_bf16"] = round(ms["bf16-castonce"] / ms["bf16"], 2)
    print(f"host time a step: bf16 autocast / fp32 {result['bf16_over_fp32']:.2f}x; "
          f"cast once / bf16 autocast {result['castonce_over_bf16']:.2f}x")
    bl.write_result("host_step", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
