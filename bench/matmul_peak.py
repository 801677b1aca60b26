"""Peak matrix-multiply throughput of this CPU: the denominator of every "fraction of peak".

    python bench/matmul_peak.py [--reps 20 --warmup 3 --threads 2]

C = A @ B with A (M,K), B (K,N) costs 2*M*K*N FLOPs. The reference cases are M = K = N = 2048
in float32 and bfloat16 (medians over --reps calls); a few shapes that occur inside the
Transformer (4096 tokens x d_model -> d_ff, d_ff -> d_model, d_model -> V) show how close
real layer shapes get. Writes results/matmul_peak.json.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

import benchlib as bl

log = logging.getLogger("bench.matmul_peak")

CASES = [  # name, M, K, N, dtype
    ("fp32_2048", 2048, 2048, 2048, torch.float32),
    ("bf16_2048", 2048, 2048, 2048, torch.bfloat16),
    ("fp32_4096x512x2048", 4096, 512, 2048, torch.float32),
    ("fp32_4096x2048x512", 4096, 2048, 512, torch.float32),
    ("fp32_4096x512x8000", 4096, 512, 8000, torch.float32),
    ("bf16_4096x512x2048", 4096, 512, 2048, torch.bfloat16),
]


def time_matmul(M: int, K: int, N: int, dtype: torch.dtype, warmup: int, reps: int) -> dict:
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(K, N).to(dtype)
    c = torch.empty(M, N, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    st = bl.time_stats(times)
    flop = 2.0 * M * K * N
    return {"shape_mkn": [M, K, N], "dtype": str(dtype).replace("torch.", ""), "flop": flop, "time_s": st,
            "gflops_median": flop / st["median"] / 1e9, "gflops_best": flop / st["min"] / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=bl.DEFAULT_THREADS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every dimension (smoke runs: 0.125)")
    args = ap.parse_args(argv)
    bl.setup_logging()
    torch.set_num_threads(args.threads)
    machine = bl.machine_info(args.threads)
    cases, rows = {}, []
    for name, M, K, N, dtype in CASES:
        M, K, N = (max(16, int(x * args.scale)) for x in (M, K, N))
        if dtype == torch.bfloat16 and not bl.cpu_has_bf16():
            log.warning("%s: %s (BENCH_BF16=1 times it anyway)", name, bl.NO_BF16)
            cases[name] = {"error": bl.NO_BF16}
            continue
        try:
            r = time_matmul(M, K, N, dtype, args.warmup, args.reps)
        except Exception as exc:  # noqa: BLE001 - e.g. no bf16 kernel: record and go on
            log.error("%s failed: %r", name, exc)
            cases[name] = {"error": repr(exc)}
            continue
        cases[name] = r
        rows.append([name, f"{M}x{K}x{N}", f"{r['gflops_median']:.1f}", f"{r['gflops_best']:.1f}",
                     f"{r['time_s']['median'] * 1e3:.2f}"])
    bl.print_table(["case", "MxKxN", "GFLOP/s median", "best", "ms median"], rows)
    bl.write_result("matmul_peak", {"bench": "matmul_peak", "machine": machine, "args": vars(args),
                                    "flop_formula": "2*M*K*N per matmul", "cases": cases,
                                    "peak_rss_mb": bl.peak_rss_mb()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
