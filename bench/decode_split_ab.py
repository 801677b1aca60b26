"""Beam search on one process with THREADS threads and BATCH sentences, for the two-process split
A/B of ``bench/decode_split_ab.sh`` (BENCHMARKS.md §2, session 12).

    python bench/decode_split_ab.py SIZE MODE THREADS BATCH N    # prints per-call seconds and the median

The translation benchmark's shapes (20 source tokens, beam 4, output forced to 69 tokens) and
aiayn's process settings; one warm-up call, then N timed calls.
"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from aiayn.hugepages import use_huge_pages
use_huge_pages()
import torch
from aiayn.denormals import flush_denormals
flush_denormals()
size, mode, threads, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
from aiayn.allocator import reuse_freed_memory
reuse_freed_memory()
from translate_throughput import build_aiayn
run = build_aiayn(size, mode, batch, 20, 69, 4)
run()
ts = []
for _ in range(n):
    t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
ts.sort()
print(size, mode, f"threads={threads} batch={batch}", " ".join(f"{t:.3f}" for t in ts), "median %.3f" % ts[len(ts)//2], flush=True)
