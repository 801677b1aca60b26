"""Peak GPU memory of aiayn's training step beside ``aiayn estimate``'s (aiayn/cost/memory.py).

Per model size and batch: B = tokens // L synthetic sentences of L source and L target tokens (no
padding, as bench/gpu_train.py's), the training loop's own step (``gpu_train.build_aiayn``: fused Adam,
the fused loss where triton imports), ``--steps`` steps from a freshly reset allocator, then
``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``, what the caching allocator held)
beside ``aiayn.cost.memory.peak_memory`` of the same batch, total and parts. On the CPU (smoke) the
steps run and no peak is read.

    python bench/gpu_memory.py --sizes base,big --tokens 3125,25000
    python bench/gpu_memory.py --sizes tiny --tokens 240 --vocab 500 --steps 2 --device cpu   # CPU smoke

Results: ``$BENCH_RESULTS/gpu_memory.json``, written again after every case.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiayn  # noqa: E402
from aiayn.train.config import TrainConfig  # noqa: E402
from aiayn.train.fused_loss import fused_loss_on  # noqa: E402
from aiayn.cost.memory import GiB, peak_memory  # noqa: E402
from gpu_train import EPS_LS, build_aiayn, sync, synthetic_batches  # noqa: E402


def measure_case(size: str, tokens: int, args, device) -> dict:
    cfg = aiayn.get_preset(size, vocab_size=args.vocab)
    B = max(1, tokens // args.len)
    fused = fused_loss_on("auto", device)
    t = TrainConfig(precision=args.precision, eps_ls=EPS_LS, fused_loss="on" if fused else "off")
    est = peak_memory(cfg, t, B * args.len, B * args.len, args.precision)
    case = {"size": size, "batch": [B, args.len, args.len], "tokens": B * args.len, "precision": args.precision,
            "fused_loss": fused, "estimate": vars(est) | {"total": est.total}}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        case["allocated_before"] = torch.cuda.memory_allocated(device)
    try:
        batches = synthetic_batches(cfg, B, args.len, args.len, device)
        step = build_aiayn(cfg, batches, device, args.precision)
        for k in range(args.steps):
            step(0)
        sync(device)
        del step, batches
    except Exception as exc:  # this case's failure, not the next case's (near the limit cuBLAS's is a RuntimeError)
        what = "out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else type(exc).__name__
        case["failed"] = f"{what}: {exc}"[:300]
    if device.type == "cuda":
        case["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        case["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        case["measured_over_estimate"] = round(case["max_memory_allocated"] / est.total, 3)
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="base,big")
    ap.add_argument("--tokens", default="3125,25000", help="source (and target) tokens per batch, comma-separated")
    ap.add_argument("--len", type=int, default=31, help="tokens per sentence (aiayn estimate's default 31)")
    ap.add_argument("--vocab", type=int, default=37000)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--steps", type=int, default=3, help="steps per case (Adam's moments appear at the first)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results")) / "gpu_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = []
    for size in args.sizes.split(","):
        for tokens in (int(x) for x in args.tokens.split(",")):
            case = measure_case(size, tokens, args, device)
            got = case.get("max_memory_allocated")
            print(f"{size:5s} {case['tokens']:>7,} tokens {args.precision}: estimate {case['estimate']['total'] / GiB:.2f} GiB"
                  + (f", max_memory_allocated {got / GiB:.2f} GiB ({case['measured_over_estimate']:.2f}x), "
                     f"reserved {case['max_memory_reserved'] / GiB:.2f} GiB" if got is not None else ", no CUDA peak")
                  + (f"; FAILED: {case['failed']}" if "failed" in case else ""), flush=True)
            cases.append(case)
            out.write_text(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args), "cases": cases},
                                      indent=1))  # after every case
    print(f"results: {out}")
    return 1 if any("failed" in c for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
