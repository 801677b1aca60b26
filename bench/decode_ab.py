"""In-loop A/Bs of decoding: the attention kernel, and the thread
and batch split of ``bench/decode_split_ab.sh``.

    python bench/decode_ab.py SIZE MODE VARIANT N [THREADS BATCH]   # e.g. small fp32 explicit 5

SIZE small | base, MODE fp32 | bf16w | int8 | int8bf16, VARIANT kernel (aiayn's: the C
kernels of aiayn/kernels/loader.py, beam-step attention, the int8 passes and the
log-softmax top-k) | kernel_unpacked (float32 through PyTorch's linear, not oneDNN's packed weights) | kernel_notopk (the same without the fused log-softmax top-k: the search's
log_softmax, mask and topk_rows) | sdpa (PyTorch's operations, aiayn's before) | explicit | explicit_f32 | math |
int8dyn (every nn.Linear replaced by PyTorch's dynamic int8 one, fbgemm; the shared output
projection stays fp32);
THREADS 2 and BATCH 64 by default. One process: the translation benchmark's beam search (BATCH
sentences x 20 tokens, beam 4, output forced to 69 tokens) with aiayn's process settings, one
warm-up call, then N timed calls (seconds printed, with their minimum and median). Run the
variants in alternating processes on an idle machine.
"""
import sys, time
from pathlib import Path
if len(sys.argv) not in (5, 7) or not all(a.isdigit() for a in sys.argv[4:]):
    sys.exit(__doc__)  # the usage above, for --help or arguments that do not fit it
sys.path.insert(0, str(Path(__file__).resolve().parent))
from aiayn.host.hugepages import use_huge_pages
use_huge_pages()
import torch
from aiayn.host.denormals import flush_denormals
flush_denormals()
size, mode, variant, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
threads, batch = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 5 else (2, 64)
torch.set_num_threads(threads)
from aiayn.host.allocator import reuse_freed_memory
reuse_freed_memory()
import aiayn.model.attention as A

if variant in ("explicit", "explicit_f32"):  # matmul, masked softmax, matmul; explicit_f32 in float32
    orig, upcast = A.attention_fast, variant == "explicit_f32"
    def fast(q, k, v, mask, is_causal, p_drop=0.0, training=False):
        if training or is_causal:
            return orig(q, k, v, mask, is_causal, p_drop, training)
        dt = q.dtype
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        s = torch.matmul(q, k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v).to(dt)
    A.attention_fast = fast
elif variant == "math":
    from torch.nn.attention import sdpa_kernel, SDPBackend
    ctx = sdpa_kernel([SDPBackend.MATH]); ctx.__enter__()
elif variant == "int8dyn":
    import aiayn
    plain = aiayn.Transformer
    aiayn.Transformer = lambda cfg: torch.ao.quantization.quantize_dynamic(plain(cfg).eval(), {torch.nn.Linear},
                                                                           dtype=torch.qint8)
elif variant == "kernel_notopk":
    from aiayn.decode.adapter import CachedDecoder
    del CachedDecoder.step_topk  # the search then takes step + select_topk
from translate_throughput import build_aiayn
run = build_aiayn(size, mode, batch, 20, 69, 4, c_kernels=variant.startswith("kernel"), packed=variant != "kernel_unpacked")
run()
ts = []
for _ in range(n):
    t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
print(variant, mode, size, f"threads={threads} batch={batch}", " ".join(f"{t:.3f}" for t in ts),
      "min %.3f" % min(ts), "median %.3f" % sorted(ts)[len(ts) // 2], flush=True)
