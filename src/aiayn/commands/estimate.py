"""``aiayn estimate``: what a recipe costs in time and device-hours (``aiayn.cost.estimate``)."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from aiayn.config import apply_sets, doc_help, option_sets
from aiayn.errors import UserError
from aiayn.cost import estimate
from aiayn.train.config import load_recipe
from aiayn.cost.devices import DEVICES
from aiayn.cost.estimate import (BENCH_RESULTS, DEFAULT_LENGTH, data_length, device_throughput, format_estimate,
                                  measured_throughput, paper_model, step_batch)
from aiayn.cost.memory import format_peak, peak_memory


def run(args: argparse.Namespace) -> int:
    sets = list(args.set or [])  # as `aiayn train` reads them: the recipe, its --set, then --precision
    cfg = apply_sets(load_recipe(args.recipe), [*sets, *option_sets(sets, [("--precision", "train.precision", args.precision)])])
    t = cfg.train
    if args.devices < 1:
        raise UserError(f"--gpus must be >= 1, got {args.devices}")
    for flag, value in (("--tokens-per-step", args.tokens_per_step), ("--max-device-tokens", args.max_device_tokens)):
        if value is not None and value < 1:  # (0 read as "not given" would estimate another batch than asked)
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.price is not None and not (math.isfinite(args.price) and args.price >= 0):
        raise UserError(f"--price must be a finite number >= 0 (a device-hour's price), got {args.price}")
    measurement = Path(args.measured) if args.measured else BENCH_RESULTS / args.device / "train_base.json"
    if args.utilization is not None and measurement.is_file():  # a measured rate has no utilization to replace
        raise UserError(f"--utilization applies where nothing was measured, and {measurement} is a measurement: "
                        f"drop one of them")
    thr = measured_throughput(Path(args.measured)) if args.measured else \
        device_throughput(args.device, args.utilization, model=paper_model(cfg.model))
    if args.max_device_tokens and not args.tokens_per_step:
        raise UserError("--max-device-tokens goes with --tokens-per-step (without it the recipe's batch is estimated "
                        "as written: change train.max_tgt_tokens in the recipe instead)")
    length = data_length(Path(args.data)) if args.data else args.length
    batch = step_batch(args.devices, t.max_tgt_tokens, t.accum_steps, args.tokens_per_step, args.max_device_tokens)
    if length > batch.per_device_tokens:  # a step of tokens / length sentences: under one a batch is no batch
        raise UserError(f"sentences of {length} tokens do not fit a batch of {batch.per_device_tokens} tokens on one "
                        f"device; lower --length or raise the batch (--tokens-per-step, train.max_tgt_tokens)")
    e = estimate.estimate(cfg.model, t.max_steps, batch, thr, length)
    # one batch on one device: the recipe's, or the per-device share of --tokens-per-step on both sides
    src_tokens = e.per_device_tokens if args.tokens_per_step else t.max_src_tokens
    precision = "bf16" if t.precision == "auto" else t.precision  # fp16 where the GPU lacks bf16: the same bytes
    peak = peak_memory(cfg.model, t, src_tokens, e.per_device_tokens, precision)
    if args.json:
        print(json.dumps({k: v for k, v in vars(e).items() if k != "throughput"} | {"throughput": vars(thr)}
                         | {"peak_memory": vars(peak) | {"total": peak.total, "src_tokens": src_tokens,
                                                         "tgt_tokens": e.per_device_tokens, "precision": precision}},
                         indent=2))
    else:
        print(f"recipe: {args.recipe}")
        print(format_estimate(e, cfg.model, args.price))
        print(format_peak(peak, src_tokens, e.per_device_tokens, precision))
    return 0


def register(sub) -> None:
    p = sub.add_parser("estimate", help="time, device-hours and FLOPs of a recipe on N devices (Table 2's estimate)",
                       description=doc_help(estimate.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("--recipe", required=True, help="recipe file (e.g. recipes/wmt14-ende-base.json)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override a field of the recipe, as in `aiayn train` (repeatable; e.g. train.max_steps=50000)")
    p.add_argument("--gpus", dest="devices", type=int, default=8, help="devices training together (default 8)")
    p.add_argument("--device", default="p100",
                   help=f"device: {', '.join(DEVICES)}, or a bench/results folder with a measured train_base.json "
                        f"(default p100, the paper's)")
    p.add_argument("--measured", help="a train_base.json from bench/train_throughput.py to take the throughput from")
    p.add_argument("--utilization", type=float, default=None,
                   help="model FLOP/s / peak where nothing was measured (default, from published runs: "
                        + ", ".join(f"{k} {d.utilization:g}" for k, d in DEVICES.items()) + ")")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="reach this many target tokens per step by accumulation, whatever the device count "
                        "(25000: the paper's batch, as scripts/wmt14.sh trains); default: the recipe as written")
    p.add_argument("--max-device-tokens", type=int, default=None,
                   help="with --tokens-per-step: at most this many tokens in one batch on one device (default: "
                        "the recipe's max_tgt_tokens, 3125 in the WMT14 recipes)")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH,
                   help=f"subword tokens per sentence, EOS included (default {DEFAULT_LENGTH}, assumed)")
    p.add_argument("--data", help="a prepared data directory: --length from its train split's mean length")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the training precision the peak memory is estimated for (default: the recipe's "
                        "train.precision; auto counts as bf16, 2 bytes like fp16)")
    p.add_argument("--price", type=float, default=None, help="price of one device-hour, to print the cost")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.set_defaults(func=run)
