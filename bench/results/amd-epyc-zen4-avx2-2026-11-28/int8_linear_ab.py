"""(a) one Int8Linear 256x512 -> 2048 (int8_gemm.c, quantize + product + rescale) vs nn.Linear fp32, 2 threads,
alternated; wall ms per call (median of rounds of 30 calls) and process CPU ms per call."""
import torch, time, statistics, os, sys
from aiayn.kernels.loader import load
from aiayn.decode.int8 import Int8Linear, onednn_vnni
torch.set_num_threads(int(os.environ.get("T", "2")))
k = load()
print("vnni", onednn_vnni(), "kernels", k.path.name, "threads", torch.get_num_threads(), "load", open("/proc/loadavg").read().split()[:3])
torch.manual_seed(0)
N, I, O = 256, 512, 2048
lin = torch.nn.Linear(I, O).eval()
q = Int8Linear.from_linear(lin, kernels=k)
assert q.w_packed is not None
x = torch.randn(N, I)
xq = torch.randint(-127, 128, (N, I), dtype=torch.int8); wt = q.w_q.t()
def tm(f, n=30):
    f(); t = time.perf_counter(); c = time.process_time()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e3, (time.process_time() - c) / n * 1e3
cases = {"fp32 nn.Linear": lambda: lin(x), "int8 Int8Linear": lambda: q(x), "_int_mm (oneDNN)": lambda: torch._int_mm(xq, wt)}
res = {c: [] for c in cases}
with torch.inference_mode():
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 9):
        for c, f in cases.items():
            res[c].append(tm(f))
for c, v in res.items():
    print(f"{c:18s} wall median {statistics.median(a for a, _ in v):7.2f} ms   cpu median {statistics.median(b for _, b in v):7.2f} ms   wall: " + " ".join("%.1f" % a for a, _ in v))
f, i = (statistics.median(a for a, _ in res[c]) for c in ("fp32 nn.Linear", "int8 Int8Linear"))
fc, ic = (statistics.median(b for _, b in res[c]) for c in ("fp32 nn.Linear", "int8 Int8Linear"))
print(f"fp32/int8: {f / i:.2f}x by wall, {fc / ic:.2f}x by cpu time")
