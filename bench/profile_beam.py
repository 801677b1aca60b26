"""Where aiayn's beam search spends its time: torch.profiler operator table + cProfile of the
Python side, on one small call (seconds).

    python bench/profile_beam.py [--size small --batch 16 --src-len 20 --out-len 20 --threads 2]

Same setting as translate_throughput.py (random weights, forced output length, beam 4), one
warm-up call, then one profiled call per profiler. Prints the top operators by self CPU time
and the top Python functions by own time, and, where the C attention kernel ran (which the
operator table cannot see), one more call's time in its self- and encoder-decoder attention;
nothing is written. The process first takes the
``aiayn`` command's settings (huge pages, denormals, allocator: aiayn/host/process.py), as the
decoding workers do (``--plain-process`` leaves them out).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

if "--plain-process" not in sys.argv:  # before the first tensor, as aiayn/host/process.py asks
    from aiayn.host.process import configure_process

    configure_process()

import torch  # noqa: E402

import benchlib as bl  # noqa: E402
from translate_throughput import build_aiayn  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(bl.SIZES), default="small")
    ap.add_argument("--mode", choices=["fp32", "bf16", "bf16w", "int8", "int8bf16"], default="fp32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--out-len", type=int, default=20)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--threads", type=int, default=bl.DEFAULT_THREADS)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--plain-process", action="store_true", help="without the aiayn command's process settings")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = build_aiayn(args.size, args.mode, args.batch, args.src_len, args.out_len, args.beam)
    run()  # warm-up
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    print(f"one call: {wall:.3f}s = {1e3 * wall / args.out_len:.2f} ms per step "
          f"({args.batch} x {args.beam} rows, {args.out_len} steps, size {args.size}, {args.mode})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    kernel_time(run)
    return 0


def kernel_time(run) -> None:
    """One more call, timing each of the beam attention kernel's runs (aiayn/kernels/loader.py)."""
    from aiayn.kernels import loader

    spent = {"self": 0.0, "cross": 0.0, "runs": 0}
    plain = loader.Kernels._run

    def timed(self, q, k, v, g, anc, pad, new):
        t = time.perf_counter()
        out = plain(self, q, k, v, g, anc, pad, new)
        spent["self" if anc is not None else "cross"] += time.perf_counter() - t
        spent["runs"] += 1
        return out

    loader.Kernels._run = timed
    try:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    finally:
        loader.Kernels._run = plain
    if spent["runs"]:
        print(f"attention kernel, one more call ({wall:.3f}s): self-attention {spent['self']:.3f}s, "
              f"encoder-decoder {spent['cross']:.3f}s, {spent['runs']} runs")
    else:
        print("the attention kernel did not run (PyTorch's attention: in the operator table)")


if __name__ == "__main__":
    raise SystemExit(main())
